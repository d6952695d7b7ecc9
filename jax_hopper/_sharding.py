"""SPMD partitioning of the GEMM custom call.

A custom call is opaque to XLA's partitioner: left alone, a sharded product would be
gathered onto every device. Each platform's lowering of gemm_p therefore partitions it
by the rules jnp.dot follows -- through custom_partitioning (Shardy rule and GSPMD
callbacks) on Auto mesh axes, and on Explicit axes, whose operand types name their
shardings, through a shard_map planned while lowering (_shard_mapped says why):

  batch / M / N sharded      -> each device multiplies its shards; no communication
  (several batch dims each keep their own sharding -- the heads of multi-head
  attention included -- and the FFI handler folds them into one on each device)
  (x [..., M, K] @ W: each leading dim of x keeps its own sharding -- a sharded
  sequence dim included -- and the FFI handler folds them into M on each device)
  K (contracting) sharded    -> each device multiplies its K slice into f32 partial
                                sums, psum over the K mesh axes, one rounding at the end
                                (the single-device numerics; jnp.dot reduces 16-bit
                                partials)
  one mesh axis on two roles -> the later role (N after M, K after both) is replicated

Each device's product is the local impl on its shards, so where the dispatcher's rules
picked the kind (`rules`) it picks again for the shards' shapes (_primitive._cuda_impl;
for the fused dense layer, _fused._cuda_impl).
Single-device programs and fully manual contexts (shard_map) inline the local product,
so they lower exactly as without this wrapper. A shard_map body manual over only some
mesh axes lowers XLA's dot instead (_partly_manual says why).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import AxisType, NamedSharding, PartitionSpec

_F32 = jnp.dtype(jnp.float32)


def _roles(a_ndim, b_ndim, transpose_a, transpose_b):
    """(a's leading dims that fold into M, positions of (batch dims, m, k) in a, of (batch
    dims, k, n) in b). The batch dims, the same in both, are those before the matrices
    where both operands have rank >= 3 and equal ranks (none otherwise); leading dims
    exist where a rank > 2 `a` meets a rank-2 `b` (x [..., M, K] @ W)."""
    lead = tuple(range(a_ndim - 2)) if b_ndim == 2 else ()
    batch = tuple(range(a_ndim - 2)) if a_ndim == b_ndim >= 3 else ()
    ra, ca, rb, cb = a_ndim - 2, a_ndim - 1, b_ndim - 2, b_ndim - 1
    a = (batch, ca, ra) if transpose_a else (batch, ra, ca)
    b = (batch, cb, rb) if transpose_b else (batch, rb, cb)
    return lead, a, b


class Plan(NamedTuple):
    """Mesh axes per role; `batch` has one entry per batch dim, `lead` one per leading dim of a."""

    batch: tuple
    lead: tuple
    m: tuple
    n: tuple
    k: tuple


def _axes(spec, ndim):
    """A PartitionSpec as one tuple of mesh-axis names per dimension."""
    entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    return [() if e is None else ((e,) if isinstance(e, str) else tuple(e)) for e in entries]


def _spec_of(sharding, ndim):
    spec = getattr(sharding, "spec", None)
    return _axes(PartitionSpec() if spec is None else spec, ndim)


def _plan(a_sharding, b_sharding, a_shape, b_ndim, transpose_a, transpose_b, n_first=False) -> Plan:
    """Mesh axes for each role, each mesh axis used by at most one role (M before N,
    unless n_first)."""
    ndim = len(a_shape)
    lead_dims, (ab, am, ak), (_, bk, bn) = _roles(ndim, b_ndim, transpose_a, transpose_b)
    sa, sb = _spec_of(a_sharding, ndim), _spec_of(b_sharding, b_ndim)
    used: set[str] = set()

    def take(*candidates):
        for axes in candidates:
            if axes and not used.intersection(axes):
                used.update(axes)
                return axes
        return ()

    batch = tuple(take(sa[d], sb[d]) for d in ab)
    lead = tuple(take(sa[d]) for d in lead_dims)
    if n_first:
        n = take(sb[bn])
        m = take(sa[am])
    else:
        m = take(sa[am])
        n = take(sb[bn])
    # K is split only where both operands have it split alike, as XLA's dot does; a K
    # sharded on one side only is gathered (jnp.dot all-gathers it rather than adding an
    # all-reduce of partial products). An uneven split is gathered too: the last shard's
    # padding would be summed into the product (M, N and batch padding only adds rows
    # or columns that are cut away).
    k = take(sa[ak]) if sa[ak] == sb[bk] and _divides(a_sharding, sa[ak], a_shape[ak]) else ()
    return Plan(batch, lead, m, n, k)


def _on_mesh(sharding, mesh):
    """An operand's sharding, or replicated on `mesh` where it names no mesh axes (an
    operand without a mesh next to one typed with explicit axes)."""
    spec = getattr(sharding, "spec", None)
    if spec is None or not getattr(getattr(sharding, "mesh", None), "axis_names", ()):
        return NamedSharding(mesh, PartitionSpec())
    return sharding


def _divides(sharding, axes, size) -> bool:
    mesh_shape = getattr(getattr(sharding, "mesh", None), "shape", None)
    if not axes or mesh_shape is None:
        return True
    return size % math.prod(mesh_shape[a] for a in axes) == 0


def _pspec(dims):
    return PartitionSpec(*[None if not d else (d[0] if len(d) == 1 else d) for d in dims])


def _shardings(mesh, a_ndim, b_ndim, transpose_a, transpose_b, plan: Plan):
    lead_dims, (ab, am, ak), (_, bk, bn) = _roles(a_ndim, b_ndim, transpose_a, transpose_b)
    a_dims, b_dims = [()] * a_ndim, [()] * b_ndim
    for d, axes in zip(ab, plan.batch):
        a_dims[d] = b_dims[d] = axes
    for d, axes in zip(lead_dims, plan.lead):
        a_dims[d] = axes
    a_dims[am], a_dims[ak] = plan.m, plan.k
    b_dims[bk], b_dims[bn] = plan.k, plan.n
    out_dims = list(plan.batch) + list(plan.lead) + [plan.m, plan.n]
    return tuple(NamedSharding(mesh, _pspec(d)) for d in (a_dims, b_dims, out_dims))


def is_explicit(sharding) -> bool:
    """Whether a type's sharding names explicit mesh axes (then it is part of the type)."""
    mesh = getattr(sharding, "mesh", None)
    return hasattr(sharding, "spec") and any("Explicit" in str(t) for t in getattr(mesh, "axis_types", ()))


def padded_spec(sharding, ndim) -> tuple:
    """A sharding's spec with one entry per dimension (trailing ones unsharded)."""
    return tuple(sharding.spec) + (None,) * (ndim - len(tuple(sharding.spec)))


def output_sharding(a, b, transpose_a, transpose_b):
    """The result's sharding in the avals' type system (explicit mesh axes): batch,
    leading dims and M as `a` has them, N as `b` has it (jnp.dot's rule); None where the
    avals carry none.

    N is replicated where its mesh axes already shard another dim of the result, which
    is what the per-device plan (_plan) computes. jax's public rule refuses such a
    product, and ops runs jax's check first, so only a backward product meets it: FSDP's
    dx = dy w^T, with dy's rows and w's K on one axis, whose result _autodiff then
    reshards to the operand's type as jax's transpose does."""
    mesh = explicit_mesh(a, b)
    if mesh is None:
        return None  # no sharding in the type system: the result's aval carries none either
    lead_dims, (ab, am, _), (_, _, bn) = _roles(a.ndim, b.ndim, transpose_a, transpose_b)
    spec_a, spec_b = explicit_spec(a), explicit_spec(b)
    entries = tuple(spec_a[d] for d in ab + lead_dims) + (spec_a[am],)
    used = {axis for e in entries for axis in _axes(PartitionSpec(e), 1)[0]}
    n = spec_b[bn]
    if used.intersection(_axes(PartitionSpec(n), 1)[0]):
        n = None
    return NamedSharding(mesh, PartitionSpec(*entries, n))


def explicit_mesh(*avals):
    """The mesh of the first aval typed with explicit mesh axes; None if there is none
    (an operand without a mesh -- a constant, an uncommitted array -- is replicated)."""
    for aval in avals:
        sharding = getattr(aval, "sharding", None)
        if is_explicit(sharding):
            return sharding.mesh
    return None


def merge_drops_explicit_sharding(aval, first: int, last: int) -> bool:
    """Whether merging dims first..last (inclusive) of `aval` into one would drop a
    sharding on explicit mesh axes: one of them past `first` is sharded (jax refuses
    that reshape)."""
    return any(explicit_spec(aval)[first + 1:last + 1])


def explicit_spec(aval) -> tuple:
    """An aval's spec per dimension under explicit axes; all None (replicated) for one
    without them."""
    sharding = getattr(aval, "sharding", None)
    return padded_spec(sharding, aval.ndim) if is_explicit(sharding) else (None,) * aval.ndim


def _operand_shardings(mesh, arg_shapes, transpose_a, transpose_b, result_shape=None):
    """(plan, (a, b, result shardings)) for the operands' shardings. N's axes are taken
    before M's where the partitioner's result (`result_shape`) shards N and not M: with
    one mesh axis on both, Shardy gives it to the larger dim, as for jnp.dot, and the plan
    follows (M gathered) rather than gathering the larger operand and reshuffling the
    result. (An axis shared with only part of M's axes is not followed: an all-to-all.)"""
    a, b = arg_shapes[0], arg_shapes[1]
    a_sharding, b_sharding = _on_mesh(a.sharding, mesh), _on_mesh(b.sharding, mesh)
    n_first = False
    if result_shape is not None and getattr(result_shape, "sharding", None) is not None:
        out = _spec_of(result_shape.sharding, len(result_shape.shape))
        n_first = bool(out[-1]) and not out[-2]
    plan = _plan(a_sharding, b_sharding, a.shape, len(b.shape), transpose_a, transpose_b, n_first)
    return plan, _shardings(mesh, len(a.shape), len(b.shape), transpose_a, transpose_b, plan)


def _infer(transpose_a, transpose_b, out_dtype, kernel, stages, rules, mesh, arg_shapes, result_shape):
    del out_dtype, kernel, stages, rules, result_shape
    return _operand_shardings(mesh, arg_shapes, transpose_a, transpose_b)[1][2]


def _without_context_mesh(per_device):
    """A partition callback's per_device, traced with no mesh in context (as when the
    caller sets none; shard_map bodies keep theirs). custom_partitioning traces its
    per-device body under whatever mesh the caller set (jax.set_mesh): under an explicit
    one, the body's jnp ops (a layer's bias broadcast, the product's f32 result) carry
    sharding annotations that XLA meets after partitioning and cannot run ('No registered
    implementation for untyped custom call to Sharding', jax 0.11.2; operands with no mesh
    in their type, which take this path and not _shard_mapped's)."""
    empty = jax.sharding.AbstractMesh((), ())

    def body(*args):
        with jax.sharding.use_abstract_mesh(empty):
            return per_device(*args)

    return body


def _per_device_product(local_impl, k_axes, out_dtype, **params):
    """What each device computes: its product, or (K split over k_axes) its f32 partial
    sums, added over those axes and rounded once."""
    def product(a, b):
        if not k_axes:
            return local_impl(a, b, out_dtype=out_dtype, **params)
        partial_sums = local_impl(a, b, out_dtype=_F32, **params)
        return jax.lax.psum(partial_sums, k_axes).astype(out_dtype)

    return product


def _partition(local_impl, transpose_a, transpose_b, out_dtype, kernel, stages, rules, mesh, arg_shapes,
               result_shape):
    plan, (a_sharding, b_sharding, out_sharding) = _operand_shardings(mesh, arg_shapes, transpose_a, transpose_b,
                                                                      result_shape)
    lower_fn = _per_device_product(local_impl, plan.k, out_dtype, transpose_a=transpose_a, transpose_b=transpose_b,
                                   kernel=kernel, stages=stages, rules=rules)
    return mesh, _without_context_mesh(lower_fn), out_sharding, (a_sharding, b_sharding)


def _shard_mapped(per_device, arg_shardings, out_sharding, result_sharding, *args):
    """Explicit mesh axes: the operands' types name their shardings, so the plan is made
    while lowering and each device's product runs in a shard_map (resharding operands
    the plan does not split as they are, and the result to the type the primitive
    declared). custom_partitioning does not serve here: its per-device body is traced
    under the explicit mesh, so it carried sharding annotations into the partitioned
    module (XLA: 'No registered implementation for custom call to Sharding') and its
    psum's reducer was no longer a plain add (XLA aborted: all_reduce_thunk
    'reduction_kind.has_value()'); seen with jax 0.11.2 on two H200s."""
    args = [jax.sharding.reshard(x, s) for x, s in zip(args, arg_shardings)]
    out = jax.shard_map(per_device, mesh=out_sharding.mesh, in_specs=tuple(s.spec for s in arg_shardings),
                        out_specs=out_sharding.spec, check_vma=False)(*args)
    return jax.sharding.reshard(out, result_sharding)


def _explicit(local_impl):
    """The lowering of gemm_p for operands typed with explicit mesh axes (_shard_mapped)."""
    def impl(a, b, *, transpose_a, transpose_b, out_dtype, kernel, stages, rules=False):
        from jax_hopper._primitive import _mnk

        types = (jax.typeof(a), jax.typeof(b))
        result = output_sharding(*types, transpose_a, transpose_b)
        m, n, k, _ = _mnk(a.shape, b.shape, transpose_a, transpose_b)
        if k == 0:  # an empty sum (XLA refuses a shard_map whose operands are all empty)
            return jnp.zeros(a.shape[:-2] + (m, n), out_dtype, out_sharding=result)
        plan, shardings = _operand_shardings(explicit_mesh(*types), types, transpose_a, transpose_b)
        per_device = _per_device_product(local_impl, plan.k, out_dtype, transpose_a=transpose_a,
                                         transpose_b=transpose_b, kernel=kernel, stages=stages, rules=rules)
        return _shard_mapped(per_device, shardings[:2], shardings[2], result, a, b)

    return impl


def _lead_factors(a_ndim, b_ndim):
    """Shardy factor names of (a's and the result's leading dims, b's): the batch dims
    shared by both, or a's leading dims folding into M."""
    if a_ndim == b_ndim >= 3:
        batch = "".join(f"b{i} " for i in range(a_ndim - 2))
        return batch, batch
    return "".join(f"l{i} " for i in range(a_ndim - 2)), ""


def _sharding_rule(transpose_a, transpose_b, out_dtype, kernel, stages, rules, mesh, value_types, result_types):
    del out_dtype, kernel, stages, rules, mesh, result_types
    lead, b_lead = _lead_factors(len(value_types[0].shape), len(value_types[1].shape))
    a = "k m" if transpose_a else "m k"
    b = "n k" if transpose_b else "k n"
    return f"{lead}{a}, {b_lead}{b} -> {lead}m n", {"reduction_factors": ("k",)}


def _explicit_operands(ctx) -> bool:
    """The product's operands (the first two) typed with explicit mesh axes, outside any
    shard_map (inside a partly manual one, _partly_manual decides). A fused layer's bias
    or residual alone does not count: with x and w meshless (ops gives such a layer with a
    typed bias or residual to jnp) it is the empty stand-in for an absent one, which
    jnp.zeros types with the current mesh."""
    shardings = [getattr(aval, "sharding", None) for aval in ctx.avals_in[:2]]
    return any(is_explicit(s) and AxisType.Manual not in s.mesh.axis_types for s in shardings)


def _free_axes(axis_context):
    """The mesh axes a shard_map body leaves to the compiler that span devices."""
    mesh = axis_context.mesh
    manual = set(getattr(axis_context, "manual_axes", ()))
    return [name for name in mesh.axis_names if name not in manual and mesh.shape[name] > 1]


def _spans_devices(ctx) -> bool:
    """Whether this lowering is for a program XLA will partition over several devices
    (custom_partitioning needs real devices; a single device, a cross-platform lowering
    with no devices, or a shard_map body manual over every axis that spans devices lower
    the local product directly)."""
    axis_context = getattr(ctx.module_context, "axis_context", None)
    devices = getattr(axis_context, "device_assignment", None)
    if devices is not None:
        return len(devices) > 1
    if getattr(axis_context, "mesh", None) is not None:
        return bool(_free_axes(axis_context))
    return False


def _for_export(ctx) -> bool:
    """Whether the module is lowered for jax.export."""
    return bool(getattr(getattr(ctx.module_context, "lowering_parameters", None), "for_export", False))


def _partly_manual(ctx) -> bool:
    """Inside a shard_map manual over some mesh axes, with others left to the compiler.
    XLA does not call custom_partitioning's callbacks there (jax 0.10): it gathers the
    custom call's operands over the free axes, and every device computes the whole
    product (measured: a column-parallel product gathered B, a K-split gathered both)."""
    axis_context = getattr(ctx.module_context, "axis_context", None)
    return bool(getattr(axis_context, "manual_axes", ())) and getattr(axis_context, "mesh", None) is not None


def lowering(local_impl, xla_impl):
    """A lowering rule for gemm_p computing local_impl(a, b, **params) on one device and
    partitioned by the rules above when the program spans several. xla_impl (XLA's dot,
    which XLA partitions itself) serves a partly manual shard_map body (_partly_manual)."""
    return _local_or_partitioned(local_impl, partitioned(local_impl), _explicit(local_impl), xla_impl)


def _local_or_partitioned(local_impl, partitioned_impl, explicit_impl, xla_impl):
    direct = mlir.lower_fun(local_impl, multiple_results=False)
    sharded = mlir.lower_fun(partitioned_impl, multiple_results=False)
    explicit = mlir.lower_fun(explicit_impl, multiple_results=False)
    by_xla = mlir.lower_fun(xla_impl, multiple_results=False)

    def rule(ctx, *args, **params):
        if not _spans_devices(ctx):
            return direct(ctx, *args, **params)
        if _explicit_operands(ctx):
            return explicit(ctx, *args, **params)
        # Partly manual: the operands' shardings over the free axes are unknown here and
        # custom_partitioning would not be consulted, so XLA's own dot, partitioned like
        # jnp.dot's, is the only way not to gather (our kernel does not run there).
        # jax.export: custom_partitioning's callbacks live in this process (jax refuses to
        # serialize them), so an exported program spanning devices on Auto axes holds
        # XLA's dot, partitioned like jnp.dot's.
        return (by_xla if _partly_manual(ctx) or _for_export(ctx) else sharded)(ctx, *args, **params)

    return rule


def local_only_lowering(local_impl, xla_impl, multiple_results=False):
    """A lowering rule computing local_impl on one device (or in a shard_map body manual
    over every axis that spans devices), and xla_impl, which XLA partitions itself,
    wherever the program spans several: for a primitive with no partitioning rules of
    its own (the MLP's backward form, the dense layer that also writes act')."""
    direct = mlir.lower_fun(local_impl, multiple_results=multiple_results)
    by_xla = mlir.lower_fun(xla_impl, multiple_results=multiple_results)

    def rule(ctx, *args, **params):
        return (by_xla if _spans_devices(ctx) else direct)(ctx, *args, **params)

    return rule


def partitioned(local_impl):
    """local_impl(a, b, *, transpose_a, transpose_b, out_dtype, kernel, stages, rules) -> C,
    wrapped so XLA partitions it by the rules above (each device's local_impl sees its
    shards' shapes, and `rules`, to pick its kind for them: _primitive._cuda_impl)."""

    @functools.partial(custom_partitioning, static_argnums=(2, 3, 4, 5, 6, 7))
    def call(a, b, transpose_a, transpose_b, out_dtype, kernel, stages, rules):
        return local_impl(a, b, transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=out_dtype, kernel=kernel,
                          stages=stages, rules=rules)

    call.def_partition(
        partition=functools.partial(_partition, local_impl),
        infer_sharding_from_operands=_infer,
        sharding_rule=_sharding_rule,
    )

    def impl(a, b, *, transpose_a, transpose_b, out_dtype, kernel, stages, rules=False):
        return call(a, b, transpose_a, transpose_b, out_dtype, kernel, stages, rules)

    return impl


# ---- the fused dense primitive (x [..., M, K], w [K, N], bias [N], residual [..., M, N])
# M and N shard as for a plain product, bias with N, residual with the output. A sharded
# K cannot go through the fused epilogue (it needs the whole sum): each device computes
# its f32 partial product with our plain GEMM (the rules asked again where they picked
# the layer's kind: gemm_p's `rules`), the partials are psum'd, and the epilogue
# runs on the sum through XLA. An absent bias / residual is passed as an empty (0,) array, replicated.


def _dense_shardings(mesh, arg_shapes, has_bias, has_residual, result_shape=None):
    plan, (x_s, w_s, out_s) = _operand_shardings(mesh, arg_shapes, False, False, result_shape)
    replicated = NamedSharding(mesh, PartitionSpec())
    bias_s = NamedSharding(mesh, _pspec([plan.n])) if has_bias else replicated
    residual_s = out_s if has_residual else replicated
    return plan.k, (x_s, w_s, bias_s, residual_s), out_s


def _dense_infer(activation, has_bias, has_residual, rules, mesh, arg_shapes, result_shape):
    del activation, rules, result_shape
    return _dense_shardings(mesh, arg_shapes, has_bias, has_residual)[2]


def _dense_partition(local_impl, activation, has_bias, has_residual, rules, mesh, arg_shapes, result_shape):
    k_axes, arg_shardings, out_sharding = _dense_shardings(mesh, arg_shapes, has_bias, has_residual, result_shape)
    per_device = _per_device_dense(local_impl, k_axes, activation, has_bias, has_residual, rules)
    return mesh, _without_context_mesh(per_device), out_sharding, arg_shardings


def _per_device_dense(local_impl, k_axes, activation, has_bias, has_residual, rules):
    """Each device's fused layer (where the rules picked the kind, `rules`, they pick
    again for its shards: _fused._cuda_impl); with K split, f32 partial products (also
    picked again), psum, then the epilogue through XLA on the sum."""
    from jax_hopper._fallback import dense_epilogue
    from jax_hopper._primitive import DEFAULT_KERNEL, DEFAULT_STAGES, gemm_p

    def layer(x, w, bias, residual):
        if not k_axes:
            return local_impl(x, w, bias, residual, activation=activation, has_bias=has_bias,
                              has_residual=has_residual, rules=rules)
        partial = gemm_p.bind(x, w, transpose_a=False, transpose_b=False, out_dtype=_F32, kernel=DEFAULT_KERNEL,
                              stages=DEFAULT_STAGES, rules=rules)
        return dense_epilogue(jax.lax.psum(partial, k_axes), bias if has_bias else None,
                              residual if has_residual else None, activation=activation, dtype=x.dtype)

    return layer


def _dense_explicit(local_impl):
    """The fused layer's lowering for operands typed with explicit mesh axes (_shard_mapped)."""
    def impl(x, w, bias, residual, *, activation, has_bias, has_residual, rules=False):
        from jax_hopper._fallback import dense_epilogue

        types = tuple(jax.typeof(v) for v in (x, w, bias, residual))
        result = output_sharding(types[0], types[1], False, False)
        if x.shape[-1] == 0:  # an empty sum: the epilogue of zeros (see _explicit)
            zeros = jnp.zeros(x.shape[:-1] + w.shape[-1:], _F32, out_sharding=result)
            return dense_epilogue(zeros, bias if has_bias else None, residual if has_residual else None,
                                  activation=activation, dtype=x.dtype)
        mesh = explicit_mesh(*types)
        k_axes, arg_shardings, out_sharding = _dense_shardings(mesh, types, has_bias, has_residual)
        per_device = _per_device_dense(local_impl, k_axes, activation, has_bias, has_residual, rules)
        return _shard_mapped(per_device, arg_shardings, out_sharding, result, x, w, bias, residual)

    return impl


def _dense_sharding_rule(activation, has_bias, has_residual, rules, mesh, value_types, result_types):
    del activation, rules, mesh, result_types
    lead, _ = _lead_factors(len(value_types[0].shape), 2)
    bias = "n" if has_bias else "p"
    residual = f"{lead}m n" if has_residual else "q"
    return f"{lead}m k, k n, {bias}, {residual} -> {lead}m n", {"reduction_factors": ("k",)}


def dense_partitioned(local_impl):
    """local_impl(x, w, bias, residual, *, activation, has_bias, has_residual, rules),
    wrapped so XLA partitions it by the rules above (each device's local_impl sees its
    shards' shapes, and `rules`: _fused._cuda_impl)."""
    @functools.partial(custom_partitioning, static_argnums=(4, 5, 6, 7))
    def call(x, w, bias, residual, activation, has_bias, has_residual, rules):
        return local_impl(x, w, bias, residual, activation=activation, has_bias=has_bias, has_residual=has_residual,
                          rules=rules)

    call.def_partition(partition=functools.partial(_dense_partition, local_impl),
                       infer_sharding_from_operands=_dense_infer, sharding_rule=_dense_sharding_rule)

    def impl(x, w, bias, residual, *, activation, has_bias, has_residual, rules=False):
        return call(x, w, bias, residual, activation, has_bias, has_residual, rules)

    return impl


def dense_lowering(local_impl, xla_impl):
    """lowering() for the fused dense primitive: local_impl(x, w, bias, residual,
    **params) on one device, partitioned by the rules above on several."""
    return _local_or_partitioned(local_impl, dense_partitioned(local_impl), _dense_explicit(local_impl), xla_impl)
