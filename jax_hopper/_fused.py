"""The fused dense primitive, C = act(A @ B + bias) + residual in one kernel launch, and
its backward form for an MLP's hidden layer, dz = (g @ w^T) * act'(z).

The bias add, the activation and the residual add run on the f32 accumulator in the
kernel's epilogue (cuda/gemm/epilogue.cuh: FusedOps) before the single rounding to the
16-bit output, so a dense layer's forward is one pass over memory instead of three.
A [..., M, K] @ B [K, N] (A's leading dims fold into M on each device, so a sharded
one keeps its sharding), one 16-bit type for everything. Its JVP (_autodiff.py) runs the products on the plain GEMM
primitive; its batching rule is in _batching.py.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jax_hopper import _dispatch, _ffi
from jax_hopper._dispatch import TMA_WIDTH_MULTIPLE
from jax_hopper._fallback import (
    ACTIVATION_FNS,
    activation_grad_with_bias_grad_reference,
    dense_like_jnp,
    dense_reference,
    dense_with_derivative_like_jnp,
    dense_with_derivative_reference,
)
from jax_hopper._primitive import (
    KERNEL_DTYPES,
    _match_varying_axes,
    _pad_for_tma,
    eager_impl,
    require_devices_at_lowering,
)
from jax_hopper._sharding import dense_lowering, local_only_lowering, output_sharding

# As the FFI handler numbers them (cuda/ffi/gemm_ffi.cc: kActivations).
ACTIVATIONS = {None: 0, "relu": 1, "gelu_tanh": 2, "gelu_exact": 3, "silu": 4}
assert set(ACTIVATIONS) == set(ACTIVATION_FNS)

dense_p = Primitive("jax_hopper_dense")


def _absent(dtype):
    """Stands for an omitted bias or residual: the primitive has a fixed arity, and the
    FFI handler reads an empty operand as "none"."""
    return jnp.zeros((0,), dtype)


def _optional(x, has):
    return x if has else None


def _abstract_eval(x, w, bias, residual, *, activation, has_bias, has_residual, rules=False):
    del activation, rules
    k = x.shape[-1]
    k_w, n = w.shape
    out_shape = x.shape[:-1] + (n,)
    expected = [("bias", bias, (n,))] * has_bias + [("residual", residual, out_shape)] * has_residual
    if x.ndim < 2 or w.ndim != 2 or k != k_w or any(v.shape != shape for _, v, shape in expected):
        raise ValueError(f"jax_hopper_dense: inconsistent shapes x{list(x.shape)}, w{list(w.shape)}, "
                         f"bias{list(bias.shape)}, residual{list(residual.shape)}")
    if any(v.dtype != x.dtype for _, v, _ in [("w", w, None)] + expected) or x.dtype not in KERNEL_DTYPES:
        raise TypeError(f"jax_hopper_dense takes operands of one type, f16 or bf16; got x {x.dtype}, w {w.dtype}")
    # Under explicit mesh axes the result's type follows jnp.dot's rule (M as x, N as w).
    sharding = output_sharding(x, w, False, False)
    extra = {} if sharding is None else {"sharding": sharding}
    return x.update(shape=out_shape, dtype=x.dtype, weak_type=False, **extra)


def _default_impl(x, w, bias, residual, *, activation, has_bias, has_residual, rules=False):
    del rules
    return dense_reference(x, w, _optional(bias, has_bias), _optional(residual, has_residual), activation=activation)


def _cuda_impl(x, w, bias, residual, *, activation, has_bias, has_residual, rules=False):
    reason = _ffi.kernel_unavailable_reason()
    if reason is not None:
        _ffi.warn_no_kernel_once(reason)
        return _default_impl(x, w, bias, residual, activation=activation, has_bias=has_bias,
                             has_residual=has_residual)
    if x.shape[-1] and rules and not _dispatch.layer_runs_kernel(x.shape, w.shape, x.dtype, activation):
        # Under sharding (or vmap) this layer's rows are a device's shard (or the batch's),
        # not what the rules picked the fused kind for; where they would not pick it for
        # these shapes (past the kernel's limits included), the layer is jnp's, as ops.dense
        # computes it unsharded (_primitive._cuda_impl does the same for plain products).
        return dense_like_jnp(x, w, _optional(bias, has_bias), _optional(residual, has_residual),
                              activation=activation)
    # An empty contraction (the fused kinds have no zero-fill path), or a kind forced past
    # the kernel's int32 limits: the kernel's arithmetic through XLA.
    if x.shape[-1] == 0 or not _dispatch.fits_kernel(x.shape, w.shape):
        return _default_impl(x, w, bias, residual, activation=activation, has_bias=has_bias,
                             has_residual=has_residual)
    # x's (and the residual's) leading dims fold into M in the FFI handler, not here (see
    # _primitive._cuda_impl).
    out_shape = x.shape[:-1] + (w.shape[1],)
    x, w = _pad_for_tma(x, w, False, False)
    call = jax.ffi.ffi_call(_ffi.GEMM_FUSED_TARGET, jax.ShapeDtypeStruct(out_shape, x.dtype))
    return call(x, w, bias if has_bias else _absent(x.dtype), residual if has_residual else _absent(x.dtype),
                transpose_a=np.int32(0), transpose_b=np.int32(0), activation=np.int32(ACTIVATIONS[activation]))


dense_p.def_impl(eager_impl(dense_p))
dense_p.def_abstract_eval(_abstract_eval)
# Partitioned like gemm_p when the program spans devices (_sharding.py).
mlir.register_lowering(dense_p, dense_lowering(_default_impl, _default_impl))
mlir.register_lowering(dense_p, dense_lowering(_cuda_impl, _default_impl), platform="cuda")
require_devices_at_lowering(dense_p)


def fused_dense(x, w, bias=None, residual=None, *, activation=None, rules=False):
    """Binds the primitive for x [..., M, K], w [K, N], bias [N], residual [..., M, N] of
    one 16-bit type (validated by ops.dense). `rules`: the dispatcher's rules picked the
    fused kind (policy "auto"); they are asked again for each device's shards."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(a for a in ACTIVATIONS if a)} or None, "
                         f"got {activation!r}")
    operands = _match_varying_axes(x, w, _absent(x.dtype) if bias is None else bias,
                                   _absent(x.dtype) if residual is None else residual)
    return dense_p.bind(*operands, activation=activation, has_bias=bias is not None,
                        has_residual=residual is not None, rules=bool(rules))


# ---- the backward form: dz = (g @ w^T) * act'(z), and its bias gradient -----------------
# The cotangent of an MLP's hidden pre-activation (jax_hopper.mlp's backward pass): g
# [..., M, K] is the second layer's output cotangent, w [N, K] that layer's weight as
# stored (read K-major, no transposing copy), z [..., M, N] the first layer's saved
# pre-activation (or, with activation None, the act'(z1) the forward saved: the
# saved-derivative form, a multiply). The kernel multiplies the f32 product by act'(z) in its epilogue and
# rounds once (cuBLASLt's DGELU epilogue; XLA runs the product and then a separate
# elementwise pass). With bias_grad, the second result is the first layer's bias
# gradient db = dz summed over every dim but the last (the f32 values before rounding,
# summed in f32, rounded once): the epilogue reduces each 64-row block's columns
# (cuda/gemm/column_sums.cuh) and XLA adds the M / 64 partial rows, where a separate
# pass would read dz again; without it, the second result is empty. N must be a
# multiple of 8 (z is TMA-loaded and the result TMA-stored): the FFI handler refuses
# other widths, and the lowering computes those through XLA with the same arithmetic.
# Programs spanning several devices lower to XLA's computation, which XLA partitions
# (there are no partitioning rules for this primitive). Its derivatives (a second-order
# gradient) are XLA's.
dense_grad_p = Primitive("jax_hopper_dense_activation_grad")
dense_grad_p.multiple_results = True

# Rows of dz summed into one row of the kernel's partial column sums (cuda/gemm/gemm.h:
# kColumnSumRows, one consumer warpgroup's rows).
COLUMN_SUM_ROWS = 64


def _grad_abstract_eval(g, w, z, *, activation, bias_grad):
    if activation not in ACTIVATIONS:  # None: z is the saved act'(z1), a multiply
        raise ValueError(f"jax_hopper_dense_activation_grad: unknown activation {activation!r}")
    if g.ndim < 2 or w.ndim != 2 or g.shape[-1] != w.shape[1] or z.shape != g.shape[:-1] + (w.shape[0],):
        raise ValueError(f"jax_hopper_dense_activation_grad: inconsistent shapes g{list(g.shape)}, "
                         f"w{list(w.shape)}, z{list(z.shape)}")
    if not (g.dtype == w.dtype == z.dtype) or g.dtype not in KERNEL_DTYPES:
        raise TypeError(f"jax_hopper_dense_activation_grad takes operands of one type, f16 or bf16; got g {g.dtype}, "
                        f"w {w.dtype}, z {z.dtype}")
    # db's type names no shard_map manual axes (how an aval carries them changed between
    # jax releases): jax_hopper.mlp sums db1 through XLA inside shard_map instead.
    db_shape = (z.shape[-1],) if bias_grad else (0,)
    return g.update(shape=z.shape, dtype=g.dtype, weak_type=False), jax.core.ShapedArray(db_shape, g.dtype)


def _grad_default_impl(g, w, z, *, activation, bias_grad):
    return activation_grad_with_bias_grad_reference(g, w, z, activation=activation, bias_grad=bias_grad)


def _grad_cuda_impl(g, w, z, *, activation, bias_grad):
    reason = _ffi.kernel_unavailable_reason()
    if reason is not None:
        _ffi.warn_no_kernel_once(reason)
        return _grad_default_impl(g, w, z, activation=activation, bias_grad=bias_grad)
    # z and the result go through TMA (see above); an empty contraction has no kernel
    # path; the kernel's int32 limits.
    if z.shape[-1] % TMA_WIDTH_MULTIPLE or g.shape[-1] == 0 or not _dispatch.fits_kernel(g.shape, w.shape, False, True):
        return _grad_default_impl(g, w, z, activation=activation, bias_grad=bias_grad)
    n = z.shape[-1]
    row_blocks = -(-math.prod(z.shape[:-1]) // COLUMN_SUM_ROWS)
    partial = jax.ShapeDtypeStruct((row_blocks, n) if bias_grad else (0,), jnp.float32)
    g, w = _pad_for_tma(g, w, False, True)
    call = jax.ffi.ffi_call(_ffi.GEMM_FUSED_GRAD_TARGET, (jax.ShapeDtypeStruct(z.shape, z.dtype), partial))
    dz, column_sums = call(g, w, z, transpose_a=np.int32(0), transpose_b=np.int32(1),
                           activation=np.int32(ACTIVATIONS[activation]))
    db = jnp.sum(column_sums, axis=0).astype(z.dtype) if bias_grad else jnp.zeros((0,), z.dtype)
    return dz, db


dense_grad_p.def_impl(eager_impl(dense_grad_p))
dense_grad_p.def_abstract_eval(_grad_abstract_eval)
mlir.register_lowering(dense_grad_p, local_only_lowering(_grad_default_impl, _grad_default_impl,
                                                          multiple_results=True))
mlir.register_lowering(dense_grad_p, local_only_lowering(_grad_cuda_impl, _grad_default_impl, multiple_results=True),
                       platform="cuda")


def fused_activation_grad(g, w, z, *, activation, bias_grad=False):
    """Binds the backward form for g [..., M, K], w [N, K], z [..., M, N] of one 16-bit
    type: returns dz, or (dz, db) with bias_grad."""
    dz, db = dense_grad_p.bind(*_match_varying_axes(g, w, z), activation=activation, bias_grad=bias_grad)
    return (dz, db) if bias_grad else dz


# ---- the forward form that also writes act'(z): (act(z), act'(z)), z = x @ w + bias -----
# jax_hopper.mlp's saved-derivative form: the forward keeps act'(z1) for the backward
# pass to multiply by (dz1 = dh * act'(z1)), instead of keeping z1 and recomputing act'
# (for exact GELU an erf per element, which XLA's backward pass spends 0.42 ms on at
# 8192x16384). Both outputs are functions of the f32 z, each rounded once; there is no
# residual. x [..., M, K], w [K, N], bias [N] (or absent), one 16-bit type. D is written
# by TMA only, so N must be a multiple of 8: the lowering computes other widths through
# XLA with the kernel's arithmetic, and programs spanning several devices as jnp would
# (z rounded to 16 bits; XLA partitions it: the primitive has no partitioning rules).
# Its derivatives (second order) are those of the reference arithmetic.
dense_derivative_p = Primitive("jax_hopper_dense_with_derivative")
dense_derivative_p.multiple_results = True


def _derivative_abstract_eval(x, w, bias, *, activation, has_bias):
    if activation is None or activation not in ACTIVATIONS:
        raise ValueError(f"jax_hopper_dense_with_derivative: needs an activation, got {activation!r}")
    # The absent residual as a type: abstract evaluation runs outside any trace, where
    # jax 0.11 cannot make an array.
    no_residual = jax.ShapeDtypeStruct((0,), x.dtype)
    aval = _abstract_eval(x, w, bias, no_residual, activation=activation, has_bias=has_bias, has_residual=False)
    return aval, aval


def _derivative_default_impl(x, w, bias, *, activation, has_bias):
    return dense_with_derivative_reference(x, w, _optional(bias, has_bias), activation=activation)


def _derivative_like_jnp(x, w, bias, *, activation, has_bias):
    return dense_with_derivative_like_jnp(x, w, _optional(bias, has_bias), activation=activation)


def _derivative_cuda_impl(x, w, bias, *, activation, has_bias):
    reason = _ffi.kernel_unavailable_reason()
    if reason is not None:
        _ffi.warn_no_kernel_once(reason)
        return _derivative_default_impl(x, w, bias, activation=activation, has_bias=has_bias)
    # D by TMA only; no empty-K path; the kernel's int32 limits.
    if w.shape[1] % TMA_WIDTH_MULTIPLE or x.shape[-1] == 0 or not _dispatch.fits_kernel(x.shape, w.shape):
        return _derivative_default_impl(x, w, bias, activation=activation, has_bias=has_bias)
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.shape[1],), x.dtype)
    x, w = _pad_for_tma(x, w, False, False)
    call = jax.ffi.ffi_call(_ffi.GEMM_FUSED_DERIVATIVE_TARGET, (out, out))
    return call(x, w, bias if has_bias else _absent(x.dtype), transpose_a=np.int32(0), transpose_b=np.int32(0),
                activation=np.int32(ACTIVATIONS[activation]))


dense_derivative_p.def_impl(eager_impl(dense_derivative_p))
dense_derivative_p.def_abstract_eval(_derivative_abstract_eval)
# Spanning several devices: jnp's computation, which XLA partitions.
mlir.register_lowering(dense_derivative_p, local_only_lowering(_derivative_default_impl, _derivative_like_jnp,
                                                                multiple_results=True))
mlir.register_lowering(dense_derivative_p, local_only_lowering(_derivative_cuda_impl, _derivative_like_jnp,
                                                                multiple_results=True), platform="cuda")


def fused_dense_with_derivative(x, w, bias=None, *, activation):
    """Binds the derivative form for x [..., M, K], w [K, N], bias [N] of one 16-bit
    type: returns (act(x w + bias), act'(x w + bias))."""
    operands = _match_varying_axes(x, w, _absent(x.dtype) if bias is None else bias)
    return tuple(dense_derivative_p.bind(*operands, activation=activation, has_bias=bias is not None))
