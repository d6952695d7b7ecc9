"""ragged_dot_p and ragged_contract_p: grouped products (mixtures of experts), each with
every rule it needs.

  ragged_dot_p       lhs [M, K], rhs [G, K, N] (or [G, N, K] with transpose_rhs), int32
                     group_sizes [G] -> [M, N]: group g's rows of lhs (the sizes in
                     order) times rhs[g]; rows past the sizes' sum are zeros
                     (jax.lax.ragged_dot's semantics).
  ragged_contract_p  lhs [R, A], rhs [R, B], group_sizes [G] -> [G, A, B]: per group g,
                     its rows of lhs transposed times its rows of rhs (ragged_dot's
                     gradient with respect to its rhs, and lax.ragged_dot_general's
                     ragged-contracting form).

Results are the operands' 16-bit type or f32, accumulated in f32. On CUDA both lower to
the jax_hopper_ragged_dot custom call (kinds "grouped" and "grouped_k"), elsewhere to
jax's ragged_dot_general. They are each other's transposes: the gradient of a
ragged_dot with respect to lhs is a ragged_dot against rhs read transposed (no copy),
with respect to rhs a ragged_contract, and the reverse; so first and second derivatives
run on the kernel. A cotangent in f32 takes jax's arithmetic (the kernel multiplies
16-bit operands). vmap over lhs alone is one launch (each entry's groups then a gap
group, rhs shared: `period`); other vmaps take jax's computation. A program spanning
devices on Auto mesh axes partitions both by their rows (each device's rows with the
sizes clipped to them); on Explicit axes, in a partly manual shard_map and for export,
they take jax's computation, which XLA partitions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding

from jax_hopper import _compat, _ffi, _kernels
from jax_hopper import _partitioning as part
from jax_hopper._problem import TMA_ROW_MULTIPLE

KERNEL_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
F32 = jnp.dtype(jnp.float32)
MAX_GROUPS = 1024  # the kernel's group table (cuda/gemm/scheduler/group_table.cuh)
INT32_MAX = 2**31 - 1
NOT_MAPPED = None  # vmap's unbatched operand

ragged_dot_p = Primitive("jax_hopper_ragged_dot")
ragged_contract_p = Primitive("jax_hopper_ragged_contract")

# lax.ragged_dot_general's dimension numbers of the two forms.
ROWS_DIMS = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [1]), ([], [])),
                                          lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
ROWS_DIMS_TRANSPOSED = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                                     lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
CONTRACT_DIMS = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                              lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


# ---- abstract evaluation -----------------------------------------------------------------
def _check_operands(name, lhs, rhs, group_sizes, out_dtype):
    if lhs.dtype != rhs.dtype or lhs.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name} takes two f16 or two bf16 operands, got {lhs.dtype} and {rhs.dtype}")
    if out_dtype not in (lhs.dtype, F32):
        raise TypeError(f"{name} computes {lhs.dtype} or float32 results, not {out_dtype}")
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"{name}: group_sizes must be a 1-D integer array, got {group_sizes.dtype}"
                        f"{list(group_sizes.shape)}")


def _rows_abstract_eval(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype, period=0):
    _check_operands("jax_hopper_ragged_dot", lhs, rhs, group_sizes, out_dtype)
    k_rhs, n = (rhs.shape[2], rhs.shape[1]) if transpose_rhs else (rhs.shape[1:] if rhs.ndim == 3 else (None, None))
    entries = period - 1 if period else group_sizes.shape[0]
    if (lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != k_rhs or rhs.shape[0] != entries
            or (period and group_sizes.shape[0] % period)):
        raise ValueError(f"jax_hopper_ragged_dot takes lhs [M, K], rhs [G, K, N] (or [G, N, K] with transpose_rhs) "
                         f"and group_sizes [G] (batched: [B * period], G = period - 1); got {lhs.shape}, "
                         f"{rhs.shape}, {group_sizes.shape}, period={period}")
    return lhs.update(shape=(lhs.shape[0], n), dtype=out_dtype, weak_type=False)


def _contract_abstract_eval(lhs, rhs, group_sizes, *, out_dtype):
    _check_operands("jax_hopper_ragged_contract", lhs, rhs, group_sizes, out_dtype)
    if lhs.ndim != 2 or rhs.ndim != 2 or lhs.shape[0] != rhs.shape[0]:
        raise ValueError(f"jax_hopper_ragged_contract takes lhs [R, A], rhs [R, B] and group_sizes [G]; got "
                         f"{lhs.shape}, {rhs.shape}, {group_sizes.shape}")
    return lhs.update(shape=(group_sizes.shape[0], lhs.shape[1], rhs.shape[1]), dtype=out_dtype, weak_type=False)


# ---- jax's computation (other platforms; the kernel's stand-in) ----------------------------
def rows_reference(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype, period=0):
    dims = ROWS_DIMS_TRANSPOSED if transpose_rhs else ROWS_DIMS
    if period:  # each gap group multiplies a zero entry
        rhs = jnp.tile(jnp.concatenate([rhs, jnp.zeros((1,) + rhs.shape[1:], rhs.dtype)]),
                       (group_sizes.shape[0] // period, 1, 1))
    return lax.ragged_dot_general(lhs, rhs, group_sizes.astype(jnp.int32), dims, preferred_element_type=out_dtype)


def contract_reference(lhs, rhs, group_sizes, *, out_dtype):
    return lax.ragged_dot_general(lhs, rhs, group_sizes.astype(jnp.int32), CONTRACT_DIMS,
                                  preferred_element_type=out_dtype)


# ---- the kernel ------------------------------------------------------------------------------
def _dtype_name(dtype) -> str:
    return "bf16" if dtype == jnp.bfloat16 else "f16"


def rows_fit(m, k, n, groups, transpose_rhs) -> bool:
    """Whether the kernel takes this ragged_dot as stored: rows TMA can read in place
    (16-byte multiples: K for lhs, and rhs's last dim), 1 to MAX_GROUPS groups, and
    dims within int32 (other shapes take jax's computation)."""
    rhs_row = k if transpose_rhs else n
    return (k % TMA_ROW_MULTIPLE == 0 and rhs_row % TMA_ROW_MULTIPLE == 0 and 1 <= groups <= MAX_GROUPS
            and max(m, k, n) <= INT32_MAX)


def contract_fit(r, a, b, groups) -> bool:
    return (a % TMA_ROW_MULTIPLE == 0 and b % TMA_ROW_MULTIPLE == 0 and 1 <= groups <= MAX_GROUPS
            and max(r, a, b) <= INT32_MAX)


def _call(kind, out_shape, out_dtype, lhs, rhs, group_sizes, transpose_rhs, period=0):
    major_a, major_b = ("MN", "MN") if kind == _kernels.GROUPED_K_KIND else ("K", "K" if transpose_rhs else "MN")
    workspace = _ffi.workspace(kind, _dtype_name(lhs.dtype), major_a, major_b, _kernels.stages_of(kind), 1,
                               1, 1, 1)
    call = jax.ffi.ffi_call(_kernels.RAGGED, (jax.ShapeDtypeStruct(out_shape, out_dtype), workspace))
    out, _ = call(lhs, rhs, group_sizes.astype(jnp.int32), transpose_b=np.int32(transpose_rhs),
                  kernel=np.int32(_kernels.KIND_BY_NAME[kind].id), period=np.int32(period))
    return out


def _rows_cuda(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype, period=0):
    reason = _ffi.kernel_unavailable_reason()
    if reason is not None:
        _ffi.warn_no_kernel_once(reason)
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if reason is not None or not rows_fit(m, k, n, group_sizes.shape[0], transpose_rhs):
        return rows_reference(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, out_dtype=out_dtype, period=period)
    return _call(_kernels.GROUPED_KIND, (m, n), out_dtype, lhs, rhs, group_sizes, transpose_rhs, period)


def _contract_cuda(lhs, rhs, group_sizes, *, out_dtype):
    reason = _ffi.kernel_unavailable_reason()
    if reason is not None:
        _ffi.warn_no_kernel_once(reason)
    (r, a), b, groups = lhs.shape, rhs.shape[1], group_sizes.shape[0]
    if reason is not None or not contract_fit(r, a, b, groups):
        return contract_reference(lhs, rhs, group_sizes, out_dtype=out_dtype)
    return _call(_kernels.GROUPED_K_KIND, (groups, a, b), out_dtype, lhs, rhs, group_sizes, False)


# ---- partitioning (Auto mesh axes) ------------------------------------------------------------
# A program spanning devices on Auto axes partitions both forms by their rows: each device
# takes its rows of the operands with the global group sizes and its slice of the row
# indices (an extra operand, sharded like the rows), whose first entry places its rows
# among the groups; it multiplies its rows with the sizes clipped to them. Ragged rows:
# the result's rows are the device's; N may stay sharded as rhs has it. The contraction:
# each device's partial sums per group (f32) are added across the row axes, then rounded
# once; A and B may stay sharded. K, the groups of rhs and the sizes are replicated.
def shard_sizes(group_sizes, start, rows):
    """The group sizes of a shard of `rows` rows from row `start` on: each group's rows
    clipped to the shard's. The groups' ends are summed saturating at the shard's end (the
    clipping needs no more), so sizes that add up past int32 do not wrap, and negative
    sizes count as 0, as in the kernel."""
    end = start + rows
    sizes = jnp.clip(group_sizes.astype(jnp.int32), 0, end)
    ends = lax.associative_scan(lambda a, b: jnp.minimum(a + b, end), sizes)
    return jnp.diff(jnp.clip(ends - start, 0, rows), prepend=0)


def _local_sizes(group_sizes, row_ids):
    """A partitioned device's sizes, from its slice of the row indices."""
    return shard_sizes(group_sizes, row_ids[0] if row_ids.shape[0] else 0, row_ids.shape[0])


def _row_axes(sharding, rows):
    """The axes sharding an operand's rows, where they split them evenly; else none."""
    axes = part.spec_of(sharding, len(getattr(sharding, "spec", ())) or 1)[0]
    return axes if axes and part.divides(sharding, axes, rows) else ()


def _kept(sharding, ndim, dim, size, taken):
    """The axes sharding dim `dim` of an operand, kept where they split it evenly and
    shard nothing else the plan keeps."""
    axes = part.spec_of(sharding, ndim)[dim]
    return axes if axes and not set(axes) & set(taken) and part.divides(sharding, axes, size) else ()


def _rows_plan(mesh, arg_shapes, transpose_rhs):
    lhs, rhs = arg_shapes[0], arg_shapes[1]
    rows = _row_axes(part.on_mesh(lhs.sharding, mesh), lhs.shape[0])
    n_dim = 1 if transpose_rhs else 2
    n = _kept(part.on_mesh(rhs.sharding, mesh), 3, n_dim, rhs.shape[n_dim], rows)
    named = lambda *dims: NamedSharding(mesh, part.pspec(dims))  # noqa: E731
    rhs_dims = [(), (), ()]
    rhs_dims[n_dim] = n
    args = (named(rows, ()), named(*rhs_dims), named(()), named(rows))
    return args, named(rows, n)


def _contract_plan(mesh, arg_shapes):
    lhs, rhs = arg_shapes[0], arg_shapes[1]
    rows = _row_axes(part.on_mesh(lhs.sharding, mesh), lhs.shape[0])
    a = _kept(part.on_mesh(lhs.sharding, mesh), 2, 1, lhs.shape[1], rows)
    b = _kept(part.on_mesh(rhs.sharding, mesh), 2, 1, rhs.shape[1], rows + a)
    named = lambda *dims: NamedSharding(mesh, part.pspec(dims))  # noqa: E731
    return rows, (named(rows, a), named(rows, b), named(()), named(rows)), named((), a, b)


def _rows_partitioned(local_impl):
    @functools.partial(custom_partitioning, static_argnums=(4, 5, 6))
    def call(lhs, rhs, group_sizes, rows, transpose_rhs, out_dtype, period):
        del rows  # unpartitioned, the sizes are the rows'
        return local_impl(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, out_dtype=out_dtype, period=period)

    def per_device(transpose_rhs, out_dtype, period):
        def body(lhs, rhs, group_sizes, rows):
            return local_impl(lhs, rhs, _local_sizes(group_sizes, rows), transpose_rhs=transpose_rhs,
                              out_dtype=out_dtype, period=period)
        return body

    def infer(transpose_rhs, out_dtype, period, mesh, arg_shapes, result_shape):
        return _rows_plan(mesh, arg_shapes, transpose_rhs)[1]

    def partition(transpose_rhs, out_dtype, period, mesh, arg_shapes, result_shape):
        args, out = _rows_plan(mesh, arg_shapes, transpose_rhs)
        return mesh, part.without_context_mesh(per_device(transpose_rhs, out_dtype, period)), out, args

    def rule(transpose_rhs, out_dtype, period, mesh, value_types, result_types):
        return "m k, e n k, g, m -> m n" if transpose_rhs else "m k, e k n, g, m -> m n"

    call.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule)

    def impl(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype, period=0):
        return call(lhs, rhs, group_sizes, lax.iota(jnp.int32, lhs.shape[0]), transpose_rhs, out_dtype, period)

    return impl


def _contract_partitioned(local_impl):
    @functools.partial(custom_partitioning, static_argnums=(4,))
    def call(lhs, rhs, group_sizes, rows, out_dtype):
        del rows
        return local_impl(lhs, rhs, group_sizes, out_dtype=out_dtype)

    def per_device(row_axes, out_dtype):
        def body(lhs, rhs, group_sizes, rows):
            local = _local_sizes(group_sizes, rows)
            if not row_axes:
                return local_impl(lhs, rhs, local, out_dtype=out_dtype)
            return lax.psum(local_impl(lhs, rhs, local, out_dtype=F32), row_axes).astype(out_dtype)
        return body

    def infer(out_dtype, mesh, arg_shapes, result_shape):
        return _contract_plan(mesh, arg_shapes)[2]

    def partition(out_dtype, mesh, arg_shapes, result_shape):
        rows, args, out = _contract_plan(mesh, arg_shapes)
        return mesh, part.without_context_mesh(per_device(rows, out_dtype)), out, args

    def rule(out_dtype, mesh, value_types, result_types):
        return "r a, r b, g, r -> g a b", {"reduction_factors": ("r",)}

    call.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule)

    def impl(lhs, rhs, group_sizes, *, out_dtype):
        return call(lhs, rhs, group_sizes, lax.iota(jnp.int32, lhs.shape[0]), out_dtype)

    return impl


def _lowering(local_impl, reference, partitioned):
    """The local form on one device, the partitioned one on Auto axes, and jax's
    computation (which XLA partitions) on Explicit axes, in a partly manual shard_map and
    for export."""
    return part.lowering(local_impl, partitioned(local_impl), reference, reference)


for _p, _abstract, _reference, _cuda, _partitioned in (
        (ragged_dot_p, _rows_abstract_eval, rows_reference, _rows_cuda, _rows_partitioned),
        (ragged_contract_p, _contract_abstract_eval, contract_reference, _contract_cuda, _contract_partitioned)):
    _p.def_impl(_compat.eager_impl(_p))
    _p.def_abstract_eval(_abstract)
    mlir.register_lowering(_p, _lowering(_reference, _reference, _partitioned))
    mlir.register_lowering(_p, _lowering(_cuda, _reference, _partitioned), platform="cuda")
    _compat.require_devices_at_lowering(_p)


# ---- autodiff --------------------------------------------------------------------------------
def _bilinear_jvp(primitive):
    def jvp(primals, tangents, **params):
        lhs, rhs, group_sizes = primals
        dlhs, drhs, _ = tangents
        out = primitive.bind(lhs, rhs, group_sizes, **params)
        terms = []
        if type(dlhs) is not ad.Zero:
            terms.append(primitive.bind(dlhs, rhs, group_sizes, **params))
        if type(drhs) is not ad.Zero:
            terms.append(primitive.bind(lhs, drhs, group_sizes, **params))
        if not terms:
            return out, ad.Zero.from_primal_value(out)
        return out, terms[0] if len(terms) == 1 else terms[0] + terms[1]
    return jvp


def _rows_gradient(a, b, group_sizes, transpose_rhs, ct_dtype, dtype, period=0):
    """A gradient that is a ragged-rows product of a and b, rounded once to `dtype`: on
    the kernel for a 16-bit cotangent, else jax's arithmetic in f32."""
    if ct_dtype in KERNEL_DTYPES:
        out = ragged_dot_p.bind(a, b, group_sizes, transpose_rhs=transpose_rhs,
                                out_dtype=dtype if dtype == ct_dtype else F32, period=period)
    else:
        out = rows_reference(a.astype(F32), b.astype(F32), group_sizes, transpose_rhs=transpose_rhs, out_dtype=F32,
                             period=period)
    return out.astype(dtype)


def _rows_transpose(ct, lhs, rhs, group_sizes, *, transpose_rhs, out_dtype, period=0):
    """d lhs = ct against rhs read transposed; d rhs = the ragged contraction of lhs and ct
    (rhs [G, N, K]: of ct and lhs). An f32 cotangent takes jax's arithmetic."""
    if type(ct) is ad.Zero:
        return None, None, None
    d_lhs = d_rhs = None
    if ad.is_undefined_primal(lhs):
        d_lhs = _rows_gradient(ct, rhs, group_sizes, not transpose_rhs, ct.dtype, lhs.aval.dtype, period)
    if ad.is_undefined_primal(rhs):
        dtype = rhs.aval.dtype
        first, second = (ct, lhs) if transpose_rhs else (lhs, ct)
        # Batched (a period): each batch entry's sum per expert, the gaps dropped, summed
        # over the entries in f32.
        exact = F32 if period or dtype != ct.dtype else dtype
        if ct.dtype in KERNEL_DTYPES:
            d_rhs = ragged_contract_p.bind(first, second, group_sizes, out_dtype=exact)
        else:
            d_rhs = contract_reference(first.astype(F32), second.astype(F32), group_sizes, out_dtype=F32)
        if period:
            d_rhs = d_rhs.reshape((-1, period) + d_rhs.shape[1:])[:, :-1].sum(0, dtype=F32)
        d_rhs = d_rhs.astype(dtype)
    return d_lhs, d_rhs, None


def _contract_transpose(ct, lhs, rhs, group_sizes, *, out_dtype):
    """out[g] = lhs_g^T rhs_g: d lhs = rhs against ct read transposed ([G, A, B] as
    [G, N, K]), d rhs = lhs against ct."""
    if type(ct) is ad.Zero:
        return None, None, None
    d_lhs = d_rhs = None
    if ad.is_undefined_primal(lhs):
        d_lhs = _rows_gradient(rhs, ct, group_sizes, True, ct.dtype, lhs.aval.dtype)
    if ad.is_undefined_primal(rhs):
        d_rhs = _rows_gradient(lhs, ct, group_sizes, False, ct.dtype, rhs.aval.dtype)
    return d_lhs, d_rhs, None


ad.primitive_jvps[ragged_dot_p] = _bilinear_jvp(ragged_dot_p)
ad.primitive_jvps[ragged_contract_p] = _bilinear_jvp(ragged_contract_p)
ad.primitive_transposes[ragged_dot_p] = _rows_transpose
ad.primitive_transposes[ragged_contract_p] = _contract_transpose


# ---- vmap -------------------------------------------------------------------------------------
def _batched_sizes(group_sizes, rows):
    """[G] sizes as the kernel's rows take them (each cumulative end clamped to `rows`),
    then a gap group holding the rest of the rows: [G + 1]."""
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), rows)
    sizes = jnp.diff(ends, prepend=0)
    return jnp.concatenate([jnp.maximum(sizes, 0), rows - ends[-1:]])


def _rows_batch_rule(args, dims, *, transpose_rhs, out_dtype, period=0):
    """A vmapped lhs against a shared rhs and sizes: one launch over every entry's rows,
    each entry's groups followed by a gap group (zeros past its sizes), B shared by period
    (jax's own ragged_dot has no rule for this). Other batchings take jax's computation."""
    lhs, rhs, group_sizes = args
    dl, dr, ds = dims
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not NOT_MAPPED)
    groups = group_sizes.shape[0]
    if dr is NOT_MAPPED and ds is NOT_MAPPED and not period and size * (groups + 1) <= MAX_GROUPS:
        x = jnp.moveaxis(lhs, dl, 0)
        rows = x.shape[1]
        sizes = jnp.tile(_batched_sizes(group_sizes, rows), size)
        out = ragged_dot_p.bind(x.reshape(size * rows, x.shape[2]), rhs, sizes, transpose_rhs=transpose_rhs,
                                out_dtype=out_dtype, period=groups + 1)
        return out.reshape(size, rows, out.shape[-1]), 0
    moved = [a if d is NOT_MAPPED else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    axes = [None if d is NOT_MAPPED else 0 for d in dims]
    ref = lambda *xs: rows_reference(*xs, transpose_rhs=transpose_rhs, out_dtype=out_dtype,  # noqa: E731
                                     period=period)
    return jax.vmap(ref, in_axes=axes, axis_size=size)(*moved), 0


def _contract_batch_rule(args, dims, *, out_dtype):
    moved = [a if d is NOT_MAPPED else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    axes = [None if d is NOT_MAPPED else 0 for d in dims]
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not NOT_MAPPED)
    ref = lambda *xs: contract_reference(*xs, out_dtype=out_dtype)  # noqa: E731
    return jax.vmap(ref, in_axes=axes, axis_size=size)(*moved), 0


batching.primitive_batchers[ragged_dot_p] = _rows_batch_rule
batching.primitive_batchers[ragged_contract_p] = _contract_batch_rule


# ---- binding -------------------------------------------------------------------------------
def ragged_rows(lhs, rhs, group_sizes, *, transpose_rhs=False, out_dtype=None, period=0):
    """lhs [M, K] by rhs [G, K, N] (transpose_rhs: [G, N, K]) per group of rows. With a
    `period` P: group g multiplies rhs[g % P] (rhs has P - 1 entries) and each group
    g % P == P - 1 is a gap whose rows are zeros."""
    out_dtype = jnp.dtype(lhs.dtype if out_dtype is None else out_dtype)
    lhs, rhs, group_sizes = _compat.match_varying_axes(lhs, rhs, group_sizes)
    return ragged_dot_p.bind(lhs, rhs, group_sizes, transpose_rhs=bool(transpose_rhs), out_dtype=out_dtype,
                             period=int(period))


def ragged_contract(lhs, rhs, group_sizes, *, out_dtype=None):
    """[G, A, B]: per group, its rows of lhs [R, A] transposed times its rows of rhs [R, B]."""
    out_dtype = jnp.dtype(lhs.dtype if out_dtype is None else out_dtype)
    lhs, rhs, group_sizes = _compat.match_varying_axes(lhs, rhs, group_sizes)
    return ragged_contract_p.bind(lhs, rhs, group_sizes, out_dtype=out_dtype)
