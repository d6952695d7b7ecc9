"""dense_grad_p: the MLP's backward form, dz = (g @ w^T) * act'(z), and its bias gradient.

The cotangent of an MLP's hidden pre-activation in one launch: g [..., M, K] is the
second layer's output cotangent, w [N, K] that layer's weight as stored (read K-major,
no copy), z [..., M, N] the saved pre-activation (or, with activation None, the saved
act'(z1): a multiply). The epilogue multiplies the f32 product by act'(z) and rounds
once (cuBLASLt's DGELU epilogue; XLA runs a product and then an elementwise pass). With
bias_grad the second result is db = the f32 dz summed over every dim but the last: the
epilogue sums each 64-row block's columns and XLA adds the M / 64 partial rows. N must
be a multiple of 8 (z and dz go by TMA); other widths compute the same arithmetic through
XLA, as do programs spanning several devices (no partitioning rules). Its derivatives
are those of the reference arithmetic.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_hopper import _compat, _ffi, _kernels
from jax_hopper import _partitioning as part
from jax_hopper._problem import TMA_ROW_MULTIPLE, fits_kernel, numeric
from jax_hopper._reference import activation_grad_with_bias_grad_reference, row_sum
from jax_hopper.primitives.gemm import KERNEL_DTYPES, NOT_MAPPED, ffi_workspace, jvp_of_reference, pad_for_tma, to_front

dense_grad_p = Primitive("jax_hopper_dense_activation_grad")
dense_grad_p.multiple_results = True

COLUMN_SUM_ROWS = 64  # rows of dz summed into one row of the kernel's column sums (gemm.h: kColumnSumRows)


def _abstract_eval(g, w, z, *, activation, bias_grad):
    if activation not in _kernels.ACTIVATION_IDS:
        raise ValueError(f"jax_hopper_dense_activation_grad: unknown activation {activation!r}")
    if g.ndim < 2 or w.ndim != 2 or g.shape[-1] != w.shape[1] or z.shape != g.shape[:-1] + (w.shape[0],):
        raise ValueError(f"jax_hopper_dense_activation_grad: inconsistent shapes g{list(g.shape)}, "
                         f"w{list(w.shape)}, z{list(z.shape)}")
    if not (g.dtype == w.dtype == z.dtype) or g.dtype not in KERNEL_DTYPES:
        raise TypeError(f"jax_hopper_dense_activation_grad takes operands of one type, f16 or bf16; got g {g.dtype}, "
                        f"w {w.dtype}, z {z.dtype}")
    # db's type names no shard_map manual axes: jax_hopper.mlp sums db1 through XLA there.
    db_shape = (z.shape[-1],) if bias_grad else (0,)
    return g.update(shape=z.shape, dtype=g.dtype, weak_type=False), jax.core.ShapedArray(db_shape, g.dtype)


def _xla_impl(g, w, z, *, activation, bias_grad):
    return activation_grad_with_bias_grad_reference(g, w, z, activation=activation, bias_grad=bias_grad)


def _cuda_impl(g, w, z, *, activation, bias_grad):
    reason = _ffi.kernel_unavailable_reason()
    if reason is not None:
        _ffi.warn_no_kernel_once(reason)
        return _xla_impl(g, w, z, activation=activation, bias_grad=bias_grad)
    if z.shape[-1] % TMA_ROW_MULTIPLE or g.shape[-1] == 0 or not fits_kernel(g.shape, w.shape, False, True):
        return _xla_impl(g, w, z, activation=activation, bias_grad=bias_grad)
    n = z.shape[-1]
    row_blocks = -(-math.prod(z.shape[:-1]) // COLUMN_SUM_ROWS)
    partial = jax.ShapeDtypeStruct((row_blocks, n) if bias_grad else (0,), jnp.float32)
    g, w = pad_for_tma(g, w, False, True)
    call = jax.ffi.ffi_call(_kernels.FUSED_GRAD, (jax.ShapeDtypeStruct(z.shape, z.dtype), partial,
                                                  ffi_workspace(_kernels.FUSED_GRAD_KIND, g, w, False, True)))
    dz, column_sums, _ = call(g, w, z, transpose_a=np.int32(0), transpose_b=np.int32(1),
                              activation=np.int32(_kernels.ACTIVATION_IDS[activation]))
    db = jnp.sum(column_sums, axis=0).astype(z.dtype) if bias_grad else jnp.zeros((0,), z.dtype)
    return dz, db


dense_grad_p.def_impl(_compat.eager_impl(dense_grad_p))
dense_grad_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(dense_grad_p, part.local_only_lowering(_xla_impl, _xla_impl, multiple_results=True))
mlir.register_lowering(dense_grad_p, part.local_only_lowering(_cuda_impl, _xla_impl, multiple_results=True),
                       platform="cuda")


# The kernel's values; the tangents of the reference arithmetic (second order by jax).
ad.primitive_jvps[dense_grad_p] = jvp_of_reference(dense_grad_p, _xla_impl)


def _batch_rule(args, dims, *, activation, bias_grad):
    """A vmapped g and z against a shared w join their leading dims (one launch; the bias
    gradient, per example, is then XLA's f32 sum of the rounded dz); per-example weights
    take the reference arithmetic."""
    g, w, z = args
    dg, dw, dz = dims
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not NOT_MAPPED)
    if dw is NOT_MAPPED and numeric(size):
        out, _ = dense_grad_p.bind(to_front(g, dg, size), w, to_front(z, dz, size), activation=activation,
                                   bias_grad=False)
        if not bias_grad:
            return [out, jnp.zeros((size, 0), out.dtype)], [0, 0]
        return [out, jax.vmap(lambda t: row_sum(t, t.dtype))(out)], [0, 0]

    def reference(g, w, z):
        return activation_grad_with_bias_grad_reference(g, w, z, activation=activation, bias_grad=bias_grad)

    return list(jax.vmap(reference)(*[to_front(a, d, size) for a, d in zip(args, dims)])), [0, 0]


batching.primitive_batchers[dense_grad_p] = _batch_rule


def fused_activation_grad(g, w, z, *, activation, bias_grad=False):
    """dz, or (dz, db) with bias_grad, for g [..., M, K], w [N, K], z [..., M, N] of one
    16-bit type."""
    dz, db = dense_grad_p.bind(*_compat.match_varying_axes(g, w, z), activation=activation, bias_grad=bias_grad)
    return (dz, db) if bias_grad else dz
