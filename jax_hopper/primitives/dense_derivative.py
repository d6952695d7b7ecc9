"""dense_derivative_p: (act(z), act'(z)) for z = x @ w + bias in one launch.

The saved-derivative form of mlp (and of a differentiated dense without residual): the
forward keeps act'(z) for the backward pass to multiply by, instead of keeping z and
recomputing act'. Both outputs are functions of the f32 z, each rounded once to the
operands' 16-bit type. x [..., M, K], w [K, N], bias [N] or absent. The derivative is
written by TMA only, so N must be a multiple of 8: other widths compute the same
arithmetic through XLA. A program spanning several devices lowers to jnp's computation,
which XLA partitions (no partitioning rules of its own). Its derivatives (second order)
are those of the reference arithmetic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_hopper import _compat, _ffi, _kernels
from jax_hopper import _partitioning as part
from jax_hopper._problem import TMA_ROW_MULTIPLE, fits_kernel, numeric
from jax_hopper._reference import dense_with_derivative_like_jnp, dense_with_derivative_reference
from jax_hopper.primitives.gemm import NOT_MAPPED, ffi_workspace, jvp_of_reference, layer_aval, pad_for_tma, to_front

dense_derivative_p = Primitive("jax_hopper_dense_with_derivative")
dense_derivative_p.multiple_results = True


def absent(dtype):
    """Stands for an omitted bias or residual: the primitives have a fixed arity, and the
    FFI handlers read an empty operand as "none"."""
    return jnp.zeros((0,), dtype)


def _abstract_eval(x, w, bias, *, activation, has_bias):
    if activation is None or activation not in _kernels.ACTIVATION_IDS:
        raise ValueError(f"jax_hopper_dense_with_derivative: needs an activation, got {activation!r}")
    aval = layer_aval("jax_hopper_dense_with_derivative", x, w, bias if has_bias else None)
    return aval, aval


def _xla_impl(x, w, bias, *, activation, has_bias):
    return dense_with_derivative_reference(x, w, bias if has_bias else None, activation=activation)


def _like_jnp(x, w, bias, *, activation, has_bias):
    return dense_with_derivative_like_jnp(x, w, bias if has_bias else None, activation=activation)


def _cuda_impl(x, w, bias, *, activation, has_bias):
    reason = _ffi.kernel_unavailable_reason()
    if reason is not None:
        _ffi.warn_no_kernel_once(reason)
        return _xla_impl(x, w, bias, activation=activation, has_bias=has_bias)
    # D by TMA only; no empty-K path; the kernel's int32 limits.
    if w.shape[1] % TMA_ROW_MULTIPLE or x.shape[-1] == 0 or not fits_kernel(x.shape, w.shape):
        return _xla_impl(x, w, bias, activation=activation, has_bias=has_bias)
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.shape[1],), x.dtype)
    x, w = pad_for_tma(x, w, False, False)
    call = jax.ffi.ffi_call(_kernels.FUSED_DERIVATIVE,
                            (out, out, ffi_workspace(_kernels.FUSED_DERIVATIVE_KIND, x, w, False, False)))
    h, d, _ = call(x, w, bias if has_bias else absent(x.dtype), transpose_a=np.int32(0), transpose_b=np.int32(0),
                   activation=np.int32(_kernels.ACTIVATION_IDS[activation]))
    return h, d


dense_derivative_p.def_impl(_compat.eager_impl(dense_derivative_p))
dense_derivative_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(dense_derivative_p, part.local_only_lowering(_xla_impl, _like_jnp, multiple_results=True))
mlir.register_lowering(dense_derivative_p, part.local_only_lowering(_cuda_impl, _like_jnp, multiple_results=True),
                       platform="cuda")


# The kernel's values; the tangents of the reference arithmetic (second order by jax).
ad.primitive_jvps[dense_derivative_p] = jvp_of_reference(dense_derivative_p, _xla_impl)


def _batch_rule(args, dims, *, activation, has_bias):
    """A vmapped x against a shared w and bias joins x's leading dims (one launch);
    per-example weights take the reference arithmetic."""
    x, w, bias = args
    dx, dw, db = dims
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not NOT_MAPPED)
    if dw is NOT_MAPPED and db is NOT_MAPPED and numeric(size):
        outs = dense_derivative_p.bind(to_front(x, dx, size), w, bias, activation=activation, has_bias=has_bias)
        return outs, [0, 0]

    def reference(x, w, b):
        return dense_with_derivative_reference(x, w, b if has_bias else None, activation=activation)

    bias = bias if has_bias else absent(x.dtype)
    db = db if has_bias else NOT_MAPPED
    return list(jax.vmap(reference)(*[to_front(a, d, size) for a, d in zip((x, w, bias), (dx, dw, db))])), [0, 0]


batching.primitive_batchers[dense_derivative_p] = _batch_rule


def fused_dense_with_derivative(x, w, bias=None, *, activation):
    """(act(x w + bias), act'(x w + bias)) for x [..., M, K], w [K, N], bias [N] of one
    16-bit type."""
    operands = _compat.match_varying_axes(x, w, absent(x.dtype) if bias is None else bias)
    return tuple(dense_derivative_p.bind(*operands, activation=activation, has_bias=bias is not None))
