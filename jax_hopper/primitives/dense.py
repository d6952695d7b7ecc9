"""dense_p: a dense layer act(x @ w + bias) + residual in one launch, and the layer's
path through the dispatcher.

The bias add, the activation and the residual add run on the f32 accumulator in the
kernel's epilogue before the single rounding to the 16-bit output. x [..., M, K] (its
leading dims fold into M on each device, so a sharded one keeps its sharding), w [K, N],
bias [N], residual [..., M, N], one 16-bit type; an absent bias or residual is an empty
array. Partitioned like gemm_p (bias with N, residual with the output; a K split sums
f32 partial products, then the epilogue runs through XLA). Its JVP runs the tangent
products on gemm_p (16-bit cotangents, as jnp's); vmap over x makes one launch.

`layer` decides, for validated operands, between this primitive and jnp's computation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from jax_hopper import _compat, _dispatch, _ffi, _kernels
from jax_hopper import _partitioning as part
from jax_hopper._problem import fits_kernel, layer_problem, numeric
from jax_hopper._reference import (
    ACTIVATION_FNS,
    activation_with_derivative,
    dense_epilogue,
    dense_like_jnp,
    dense_reference,
)
from jax_hopper.primitives import gemm
from jax_hopper.primitives.dense_derivative import absent, fused_dense_with_derivative

dense_p = Primitive("jax_hopper_dense")
F32 = jnp.dtype(jnp.float32)


def _optional(x, has):
    return x if has else None


def _abstract_eval(x, w, bias, residual, *, activation, has_bias, has_residual, rules=False):
    del activation, rules
    return gemm.layer_aval("jax_hopper_dense", x, w, _optional(bias, has_bias), _optional(residual, has_residual))


def _xla_impl(x, w, bias, residual, *, activation, has_bias, has_residual, rules=False):
    del rules
    return dense_reference(x, w, _optional(bias, has_bias), _optional(residual, has_residual), activation=activation)


def layer_runs_kernel(x_shape, w_shape, dtype, activation) -> bool:
    """Whether decide() sends a layer of these shapes to the fused kind (a symbolic dim
    keeps the kernel: no sizes to ask about)."""
    if not numeric(*x_shape, *w_shape):
        return True
    problem = layer_problem(x_shape, w_shape, dtype, op="dense", activation=activation)
    return _dispatch.decide(problem, "auto").path == "kernel"


def _cuda_impl(x, w, bias, residual, *, activation, has_bias, has_residual, rules=False):
    params = dict(activation=activation, has_bias=has_bias, has_residual=has_residual)
    reason = _ffi.kernel_unavailable_reason()
    if reason is not None:
        _ffi.warn_no_kernel_once(reason)
        return _xla_impl(x, w, bias, residual, **params)
    if x.shape[-1] and rules and not layer_runs_kernel(x.shape, w.shape, x.dtype, activation):
        # A device's shard (or vmap's batch) that decide() would not fuse: jnp's layer.
        return dense_like_jnp(x, w, _optional(bias, has_bias), _optional(residual, has_residual),
                              activation=activation)
    # An empty contraction (the fused kinds have no zero-fill path), or past the int32 limits.
    if x.shape[-1] == 0 or not fits_kernel(x.shape, w.shape):
        return _xla_impl(x, w, bias, residual, **params)
    out_shape = x.shape[:-1] + (w.shape[1],)
    x, w = gemm.pad_for_tma(x, w, False, False)
    call = jax.ffi.ffi_call(_kernels.FUSED, (jax.ShapeDtypeStruct(out_shape, x.dtype),
                                             gemm.ffi_workspace(_kernels.FUSED_KIND, x, w, False, False)))
    out, _ = call(x, w, bias if has_bias else absent(x.dtype), residual if has_residual else absent(x.dtype),
                  transpose_a=np.int32(0), transpose_b=np.int32(0),
                  activation=np.int32(_kernels.ACTIVATION_IDS[activation]))
    return out


# ---- partitioning: gemm_p's rules, bias with N, residual with the output -------------------
def _shardings(mesh, arg_shapes, has_bias, has_residual, result_shape=None):
    plan, (x_s, w_s, out_s) = gemm.operand_shardings(mesh, arg_shapes, False, False, result_shape)
    replicated = NamedSharding(mesh, PartitionSpec())
    bias_s = NamedSharding(mesh, part.pspec([plan.n])) if has_bias else replicated
    residual_s = out_s if has_residual else replicated
    return plan.k, (x_s, w_s, bias_s, residual_s), out_s


def _per_device(local_impl, k_axes, activation, has_bias, has_residual, rules):
    """Each device's fused layer; with K split, f32 partial products on gemm_p, psum, then
    the epilogue through XLA on the sum (it needs the whole sum)."""
    def layer(x, w, bias, residual):
        if not k_axes:
            return local_impl(x, w, bias, residual, activation=activation, has_bias=has_bias,
                              has_residual=has_residual, rules=rules)
        partial = gemm.gemm_p.bind(x, w, transpose_a=False, transpose_b=False, out_dtype=F32,
                                   kernel=_kernels.DEFAULT_KIND, stages=_kernels.stages_of(_kernels.DEFAULT_KIND),
                                   rules=rules)
        return dense_epilogue(jax.lax.psum(partial, k_axes), _optional(bias, has_bias),
                              _optional(residual, has_residual), activation=activation, dtype=x.dtype)

    return layer


def _infer(activation, has_bias, has_residual, rules, mesh, arg_shapes, result_shape):
    del activation, rules, result_shape
    return _shardings(mesh, arg_shapes, has_bias, has_residual)[2]


def _partition(local_impl, activation, has_bias, has_residual, rules, mesh, arg_shapes, result_shape):
    k_axes, arg_shardings, out_sharding = _shardings(mesh, arg_shapes, has_bias, has_residual, result_shape)
    per_device = _per_device(local_impl, k_axes, activation, has_bias, has_residual, rules)
    return mesh, part.without_context_mesh(per_device), out_sharding, arg_shardings


def _sharding_rule(activation, has_bias, has_residual, rules, mesh, value_types, result_types):
    del activation, rules, mesh, result_types
    lead, _ = gemm.lead_factors(len(value_types[0].shape), 2)
    bias = "n" if has_bias else "p"
    residual = f"{lead}m n" if has_residual else "q"
    return f"{lead}m k, k n, {bias}, {residual} -> {lead}m n", {"reduction_factors": ("k",)}


def _partitioned(local_impl):
    @functools.partial(custom_partitioning, static_argnums=(4, 5, 6, 7))
    def call(x, w, bias, residual, activation, has_bias, has_residual, rules):
        return local_impl(x, w, bias, residual, activation=activation, has_bias=has_bias, has_residual=has_residual,
                          rules=rules)

    call.def_partition(partition=functools.partial(_partition, local_impl), infer_sharding_from_operands=_infer,
                       sharding_rule=_sharding_rule)

    def impl(x, w, bias, residual, *, activation, has_bias, has_residual, rules=False):
        return call(x, w, bias, residual, activation, has_bias, has_residual, rules)

    return impl


def _explicit(local_impl):
    def impl(x, w, bias, residual, *, activation, has_bias, has_residual, rules=False):
        types = tuple(jax.typeof(v) for v in (x, w, bias, residual))
        result = gemm.output_sharding(types[0], types[1], False, False)
        if x.shape[-1] == 0:  # an empty sum: the epilogue of zeros
            zeros = jnp.zeros(x.shape[:-1] + w.shape[-1:], F32, out_sharding=result)
            return dense_epilogue(zeros, _optional(bias, has_bias), _optional(residual, has_residual),
                                  activation=activation, dtype=x.dtype)
        k_axes, arg_shardings, out_sharding = _shardings(part.explicit_mesh(*types), types, has_bias, has_residual)
        per_device = _per_device(local_impl, k_axes, activation, has_bias, has_residual, rules)
        return part.shard_mapped(per_device, arg_shardings, out_sharding, result, x, w, bias, residual)

    return impl


def _lowering(local_impl):
    return part.lowering(local_impl, _partitioned(local_impl), _explicit(local_impl), _xla_impl)


dense_p.def_impl(_compat.eager_impl(dense_p))
dense_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(dense_p, _lowering(_xla_impl))
mlir.register_lowering(dense_p, _lowering(_cuda_impl), platform="cuda")
_compat.require_devices_at_lowering(dense_p)


def fused_dense(x, w, bias=None, residual=None, *, activation=None, rules=False):
    """Binds the primitive for x [..., M, K], w [K, N], bias [N], residual [..., M, N] of
    one 16-bit type. `rules`: decide() picked the fused kind, so each device's shards are
    decided again."""
    if activation not in _kernels.ACTIVATION_IDS:
        raise ValueError(f"activation must be one of {sorted(a for a in _kernels.ACTIVATION_IDS if a)} or None, "
                         f"got {activation!r}")
    operands = _compat.match_varying_axes(x, w, absent(x.dtype) if bias is None else bias,
                                          absent(x.dtype) if residual is None else residual)
    return dense_p.bind(*operands, activation=activation, has_bias=bias is not None,
                        has_residual=residual is not None, rules=bool(rules))


# ---- the layer's path ---------------------------------------------------------------------
def _epilogue_changes_result_type(x, w, bias, residual) -> bool:
    """Under explicit mesh axes, whether jnp's `x @ w + bias` / `... + residual` has
    another result type than x @ w (jnp's sum combines the shardings)."""
    x_spec, w_spec = part.value_spec(x), part.value_spec(w)
    for v in (bias, residual):
        spec = None if v is None else part.value_spec(v)
        if spec is None:
            continue
        if x_spec is None or w_spec is None:
            return True
        product = (tuple(x_spec[:-1]) + (w_spec[-1],))[-len(spec):]
        if any(s is not None and s != p for s, p in zip(spec, product)):
            return True
    return False


def layer(x, w, bias=None, residual=None, activation=None):
    """act(x @ w + bias) + residual for validated operands of one 16-bit type (x [..., K],
    w [K, N], bias [N], residual of the result's shape): the fused kind where decide()
    picks it, else jnp's computation; with nothing to fuse, jax_hopper.matmul's product."""
    if bias is None and residual is None and activation is None:
        return gemm.matmul_rows(x, w)
    if _epilogue_changes_result_type(x, w, bias, residual) or not numeric(*np.shape(x), *np.shape(w)):
        return dense_like_jnp(x, w, bias, residual, activation=activation)
    problem = layer_problem(x.shape, w.shape, x.dtype, op="dense", activation=activation)
    decision = _dispatch.decide(problem)
    if not (min(problem.m, problem.n, problem.k) > 0 and decision.path == "kernel"):
        return dense_like_jnp(x, w, bias, residual, activation=activation)
    out_shape = x.shape[:-1] + w.shape[-1:]
    x2 = x.reshape(1, problem.k) if x.ndim == 1 else x
    r2 = None if residual is None else residual.reshape(x2.shape[:-1] + w.shape[-1:])
    return fused_dense(x2, w, bias, r2, activation=activation, rules=decision.by_rules).reshape(out_shape)


# ---- autodiff ----------------------------------------------------------------------------
# y = act(z) + r with z = x w + b: dy = act'(z) (dx w + x dw + db) + dr. Where decide()
# sends the plain product x w to XLA (the fused kind was picked for its activation only),
# the JVP is jnp's computation's. Otherwise the tangent products go through gemm_p in the
# operands' type. Without an activation the primal stays one fused call; with one, the
# kernel writes z (bias fused) rounded to the operands' type -- jnp's rounding point and
# the cheapest thing to save -- and XLA applies act and the residual (so a differentiated
# layer carries one more rounding than the undifferentiated fused call). The
# saved-derivative form (no residual; _dispatch.saves_derivative) instead writes act(z)
# and act'(z) in one launch, and the tangent is act'(z) dz.
def derivative_kind_runs(x, w, b, activation) -> bool:
    """Whether decide() sends act(z), act'(z) of z = x w + b to the derivative kind."""
    if activation is None:
        return False
    problem = layer_problem(x.shape, w.shape, x.dtype, op="dense_derivative", activation=activation)
    explicit = any(part.explicitly_typed(v) for v in (x, w, b) if v is not None)
    return not explicit and _dispatch.decide(problem).path == "kernel"


def saved_derivative_choice(x, w, b, activation) -> tuple[bool, bool]:
    """(whether to save act'(z) instead of z, whether the derivative kind computes it)."""
    # Only asked where the form can apply: asking may warn that the kernel is missing.
    kernel = _dispatch.may_save_derivative(activation) and derivative_kind_runs(x, w, b, activation)
    return _dispatch.saves_derivative(activation, kernel), kernel


def activation_and_derivative(x, w, b, activation, kernel):
    """(act(z), act'(z)) for z = x w + b: one launch of the derivative kind if `kernel`,
    else the layer and one XLA pass computing both from its 16-bit result."""
    if kernel:
        return fused_dense_with_derivative(x, w, b, activation=activation)
    return activation_with_derivative(layer(x, w, b), activation)


def z_tangent(x, w, dx, dw, dbias, has_bias):
    """dz = dx w + x dw + db, each product decided like a plain one (16-bit, as jnp's)."""
    dz = None
    for tangent, prod in ((dx, lambda t: gemm.product(t, w)), (dw, lambda t: gemm.product(x, t))):
        if not isinstance(tangent, ad.Zero):
            dz = prod(tangent) if dz is None else dz + prod(tangent)
    if has_bias and not isinstance(dbias, ad.Zero):
        # Alone (a bias-only fine-tune) the bias tangent still spans all rows.
        dz = jnp.broadcast_to(dbias, x.shape[:-1] + w.shape[1:]) if dz is None else dz + dbias
    return jnp.zeros(x.shape[:-1] + w.shape[1:], x.dtype) if dz is None else dz


def _jvp(primals, tangents, **params):
    # Named here, where differentiated, not in `layer`: jax has no transpose rule for a
    # name, and an undifferentiated affine layer must stay transposable.
    y, dy = _jvp_unnamed(primals, tangents, **params)
    return checkpoint_name(y, gemm.PRODUCT_NAME), dy


def _jvp_unnamed(primals, tangents, *, activation, has_bias, has_residual, rules=False):
    x, w, bias, residual = primals
    dx, dw, dbias, dresidual = tangents
    optional_bias = _optional(bias, has_bias)
    if activation is not None and not has_residual:
        save, kernel = saved_derivative_choice(x, w, optional_bias, activation)
        if save:
            y, derivative = activation_and_derivative(x, w, optional_bias, activation, kernel)
            derivative = checkpoint_name(derivative, gemm.PRODUCT_NAME)
            return y, derivative * z_tangent(x, w, dx, dw, dbias, has_bias)
    product_problem = layer_problem(x.shape, w.shape, x.dtype)
    if _dispatch.decide(product_problem).path != "kernel":
        # The plain product is XLA's (the fused kind was picked for its activation, a
        # saving the derivative cannot use): differentiate jnp's own computation.
        def like_jnp(x, w, bias, residual):
            return dense_like_jnp(x, w, _optional(bias, has_bias), _optional(residual, has_residual),
                                  activation=activation)

        return gemm.jvp_where_moving(like_jnp, primals, tangents, ad.Zero, None)
    dz = z_tangent(x, w, dx, dw, dbias, has_bias)
    if activation is None:
        y = fused_dense(x, w, optional_bias, _optional(residual, has_residual), rules=rules)
        dy = dz
    else:
        # z runs as the plain product's rules picked it (the layer's rules, asked again on
        # shards, could answer otherwise).
        z = checkpoint_name(fused_dense(x, w, optional_bias, None), gemm.PRODUCT_NAME)
        y, dy = jax.jvp(ACTIVATION_FNS[activation], (z.astype(F32),), (dz.astype(F32),))
        if has_residual:
            y = y + residual.astype(F32)
        y, dy = y.astype(x.dtype), dy.astype(x.dtype)
    if has_residual and not isinstance(dresidual, ad.Zero):
        dy = dy + dresidual
    return y, dy


ad.primitive_jvps[dense_p] = _jvp


def _transpose(ct, x, w, bias, residual, *, activation, has_bias, has_residual, rules=False):
    """jax.linear_transpose through a layer without activation, linear in its one undefined
    operand: the transposes of the maps its JVP uses (the product's rules, the bias
    broadcast's sum), which keep the operands' types. grad never needs this."""
    del rules
    if activation is not None:
        raise NotImplementedError(f"Transpose rule for 'jax_hopper_dense' with activation {activation!r}: "
                                  "the layer is not linear")
    if ad.is_undefined_primal(x) and ad.is_undefined_primal(w):
        raise NotImplementedError("Transpose rule for 'jax_hopper_dense': x and w both linear inputs (bilinear)")
    ct = ad.instantiate_zeros(ct)
    flags = dict(transpose_a=False, transpose_b=False)
    return [gemm.transpose_lhs(ct, x, w, **flags) if ad.is_undefined_primal(x) else None,
            gemm.transpose_rhs(ct, x, w, **flags) if ad.is_undefined_primal(w) else None,
            # In ct's own type, as jax transposes jnp's bias broadcast.
            lax.reduce(ct, np.zeros((), ct.dtype), lax.add, tuple(range(ct.ndim - 1)))
            if has_bias and ad.is_undefined_primal(bias) else None,
            ct if has_residual and ad.is_undefined_primal(residual) else None]


ad.primitive_transposes[dense_p] = _transpose


# ---- batching -------------------------------------------------------------------------------
def _batch_rule(args, dims, *, activation, has_bias, has_residual, rules=False):
    """A vmapped x (and residual) against shared weights and bias becomes a leading dim of
    x: one fused launch (decided again for the batched layer where decide() picked it).
    Per-example weights take the reference arithmetic, vmapped by jax."""
    x, w, bias, residual = args
    dx, dw, dbias, dres = dims
    params = dict(activation=activation, has_bias=has_bias, has_residual=has_residual, rules=rules)
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not gemm.NOT_MAPPED)
    if dw is gemm.NOT_MAPPED and dbias is gemm.NOT_MAPPED and numeric(size):
        x = gemm.to_front(x, dx, size)
        if has_residual:
            residual = gemm.to_front(residual, dres, size)
        return dense_p.bind(x, w, bias, residual, **params), 0

    def reference(x, w, b, r):
        return dense_reference(x, w, _optional(b, has_bias), _optional(r, has_residual), activation=activation)

    # Named as the JVP names its output: no dense_p is bound here for that rule to run on.
    out = jax.vmap(reference)(*[gemm.to_front(a, d, size) for a, d in zip(args, dims)])
    return checkpoint_name(out, gemm.PRODUCT_NAME), 0


batching.primitive_batchers[dense_p] = _batch_rule
