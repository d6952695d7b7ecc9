"""The primitives' computations through XLA: each kernel's arithmetic (f32 products and
epilogue, one rounding), and each layer as jnp computes it.

The kernel's arithmetic is every primitive's lowering off CUDA, on GPUs that are not
Hopper and where the kernel is not built, so one program runs anywhere; jnp's form is
what the dispatcher runs where it leaves a layer to XLA (as fast as the user's own jnp,
and as accurate).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# The fused epilogue's activations, by name; each takes and returns f32.
ACTIVATION_FNS = {
    None: lambda z: z,
    "relu": jax.nn.relu,
    "gelu_tanh": lambda z: jax.nn.gelu(z, approximate=True),
    "gelu_exact": lambda z: jax.nn.gelu(z, approximate=False),
    "silu": jax.nn.silu,
}


def gemm_reference(a, b, *, transpose_a: bool, transpose_b: bool, out_dtype, out_sharding=None):
    """C = op(A) @ op(B) per batch entry (the leading dims when both have one rank), or for A
    [..., M, K] against a rank-2 B, like jnp.dot; out_sharding as lax.dot_general's (a
    derivative passes its operand's, as jax's own transpose rule does: under explicit
    mesh axes a contraction over a sharded dimension needs it)."""
    nb = a.ndim - 2 if b.ndim == a.ndim else 0
    a_contract = a.ndim - 2 + (0 if transpose_a else 1)
    b_contract = b.ndim - 2 + (1 if transpose_b else 0)
    batch = tuple(range(nb))
    preferred = None if out_dtype == a.dtype else out_dtype
    return lax.dot_general(a, b, (((a_contract,), (b_contract,)), (batch, batch)), preferred_element_type=preferred,
                           out_sharding=out_sharding)


def dense_reference(x, w, bias, residual, *, activation):
    """act(x @ w + bias) + residual with the fused kernel's arithmetic: f32 products and
    sums, the activation and residual add in f32, one rounding to x's type at the end."""
    z = lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return dense_epilogue(z, bias, residual, activation=activation, dtype=x.dtype)


def dense_like_jnp(x, w, bias, residual, *, activation):
    """act(x @ w + bias) + residual as a jnp user writes it, in x's 16-bit type: XLA's
    dot (f32 sums) rounded, then the bias, activation and residual on 16-bit values --
    what XLA fuses into cuBLASLt's epilogue, and whose derivative keeps 16-bit
    cotangents. The dispatcher's XLA path for ops.dense: as fast as the user's own jnp,
    as accurate. (dense_reference, the kernel's arithmetic in f32, is the fallback
    where the kernel cannot run; differentiated, its f32 intermediates make the
    backward products f32 ones, measured 2x slower than jnp's on the H200.)"""
    y = jnp.matmul(x, w)  # (NumPy operands: jnp's product, not NumPy's on the host)
    if bias is not None:
        y = y + bias
    y = ACTIVATION_FNS[activation](y)
    return y if residual is None else y + residual


def activation_derivative(z, activation):
    """act'(z), elementwise, in z's type: jax's own derivative of the activation."""
    return jax.jvp(ACTIVATION_FNS[activation], (z,), (jnp.ones_like(z),))[1]


def row_sum(t, dtype):
    """A bias gradient: t summed over every dim but the last, in f32, rounded once to dtype."""
    return jnp.sum(t, axis=tuple(range(t.ndim - 1)), dtype=jnp.float32).astype(dtype)


def _activation_grad_f32(g, w, z, activation):
    """(g @ w^T) * act'(z) in f32: the f32 product times act'(z) of the f32 z."""
    dh = lax.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    z = z.astype(jnp.float32)
    return dh * (z if activation is None else activation_derivative(z, activation))


def activation_grad_reference(g, w, z, *, activation):
    """(g @ w^T) * act'(z) with the backward-form kernel's arithmetic: g [..., M, K], w
    [N, K], z [..., M, N]; the f32 product times act'(z) in f32, one rounding to g's type.
    activation None: z is act'(z1) itself (the saved-derivative form), a multiply."""
    return _activation_grad_f32(g, w, z, activation).astype(g.dtype)


def activation_grad_with_bias_grad_reference(g, w, z, *, activation, bias_grad):
    """(dz, db) as the backward-form kernel computes them: dz as activation_grad_reference;
    db (with bias_grad, else empty) the f32 dz before its rounding, summed over every dim
    but the last in f32, rounded once to g's type."""
    dz = _activation_grad_f32(g, w, z, activation)
    return dz.astype(g.dtype), row_sum(dz, g.dtype) if bias_grad else jnp.zeros((0,), g.dtype)


def activation_grad_like_jnp(g, w, z, *, activation):
    """The same as jnp's backward pass computes it: the product g @ w^T rounded to the
    16-bit type, then the activation's VJP at z on 16-bit values (activation None: the
    product times the saved derivative z)."""
    dh = lax.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ())))
    if activation is None:
        return dh * z
    return jax.vjp(ACTIVATION_FNS[activation], z)[1](dh)[0]


def activation_with_derivative(z, activation):
    """(act(z), act'(z)), both computed from z in z's type."""
    return ACTIVATION_FNS[activation](z), activation_derivative(z, activation)


def dense_with_derivative_reference(x, w, bias, *, activation):
    """(act(z), act'(z)) for z = x @ w + bias with the derivative kernel's arithmetic: f32
    product and sum, both functions of the f32 z, each rounded once to x's type."""
    z = lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    if bias is not None:
        z = z + bias.astype(jnp.float32)
    return tuple(v.astype(x.dtype) for v in activation_with_derivative(z, activation))


def dense_with_derivative_like_jnp(x, w, bias, *, activation):
    """(act(z), act'(z)) as jnp computes them: z = x @ w + bias on 16-bit values (XLA's dot,
    f32 sums, rounded; the bias add fused into cuBLASLt's epilogue), then both functions
    of that z in one elementwise pass. What a program spanning several devices runs (XLA
    partitions it): an f32 product there would double the layer's output traffic."""
    return activation_with_derivative(dense_like_jnp(x, w, bias, None, activation=None), activation)


def dense_epilogue(z, bias, residual, *, activation, dtype):
    """act(z + bias) + residual in f32 for an f32 product z, rounded once to dtype."""
    if bias is not None:
        z = z + bias.astype(jnp.float32)
    y = ACTIVATION_FNS[activation](z)
    if residual is not None:
        y = y + residual.astype(jnp.float32)
    return y.astype(dtype)
