"""The dense layer's and the MLP block's test cases, shared by the CPU and GPU tiers.

A fused layer promises one rounding of the f32 arithmetic: its error against the f32
reference may be at most ERROR_FACTOR times that of rounding the reference itself (only
summation order differs). A block's gradients round intermediates as jnp's own block
does: their error may be at most ERROR_FACTOR times jnp's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from helpers import F32_ACT, full_f32, relative_error, seed_normal

import jax_hopper

ERROR_FACTOR = 1.5


def layer_operands(x_shape, n, dtype, seed=0, bias=True, residual=True):
    k = x_shape[-1]
    kx, kw, kb, kr = jax.random.split(jax.random.key(seed), 4)
    x = seed_normal(kx, x_shape, dtype, k)
    w = seed_normal(kw, (k, n), dtype, k)
    b = jax.random.normal(kb, (n,), jnp.float32).astype(dtype) if bias else None
    r = jax.random.normal(kr, tuple(x_shape[:-1]) + (n,), jnp.float32).astype(dtype) if residual else None
    return x, w, b, r


def f32_reference(x, w, b, r, activation):
    z = jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")
    if b is not None:
        z = z + b.astype(jnp.float32)
    y = F32_ACT[activation](z)
    return y if r is None else y + r.astype(jnp.float32)


def assert_close_to_reference(out, x, w, b, r, activation):
    ref = f32_reference(x, w, b, r, activation)
    err, err_round = relative_error(out, ref), relative_error(ref.astype(out.dtype), ref)
    assert err <= ERROR_FACTOR * err_round + 1e-6, f"{err:.3e} vs rounding alone {err_round:.3e}"


ARGNUMS = (0, 1, 2, 3, 4)  # x, w1, b1, w2, b2


def block_operands(lead, d, f, dtype, seed=0):
    kx, k1, kb1, k2, kb2 = jax.random.split(jax.random.key(seed), 5)
    x = seed_normal(kx, tuple(lead) + (d,), dtype, d)
    w1 = seed_normal(k1, (d, f), dtype, d)
    b1 = jax.random.normal(kb1, (f,), jnp.float32).astype(dtype)
    w2 = seed_normal(k2, (f, d), dtype, f)
    b2 = jax.random.normal(kb2, (d,), jnp.float32).astype(dtype)
    return x, w1, b1, w2, b2


def plain_block(activation):
    """The block as a jnp user writes it (residual: x)."""
    def block(x, w1, b1, w2, b2):
        return F32_ACT[activation](x @ w1 + b1) @ w2 + b2 + x
    return block


def ours(activation):
    def block(x, w1, b1, w2, b2):
        return jax_hopper.mlp(x, w1, b1, w2, b2, activation=activation, residual=x)
    return block


def loss(block):
    # 0.5 sum(y^2): dy = y, unit scale (a mean would push 16-bit cotangents to underflow).
    return lambda *p: 0.5 * jnp.sum(block(*p).astype(jnp.float32) ** 2)


def grads(block, operands, dtype=None):
    if dtype is not None:
        operands = [v.astype(dtype) for v in operands]
    return jax.jit(jax.grad(loss(block), argnums=ARGNUMS))(*operands)


def assert_as_accurate_as_jnp(what, mine, jnp_own, exact):
    """mine's error against the f32 `exact` is at most ERROR_FACTOR times jnp's block's."""
    err, err_jnp = relative_error(mine, exact), relative_error(jnp_own, exact)
    assert err <= ERROR_FACTOR * err_jnp + 1e-6, f"{what}: {err:.3e} vs jnp's block {err_jnp:.3e}"


def assert_gradients_as_accurate_as_jnp(mine, operands, activation):
    with full_f32():
        exact = grads(plain_block(activation), operands, jnp.float32)
    jnp_own = grads(plain_block(activation), operands)
    for name, g, j, e in zip(("x", "w1", "b1", "w2", "b2"), mine, jnp_own, exact):
        assert g.shape == e.shape and g.dtype == operands[0].dtype, name
        assert_as_accurate_as_jnp(f"d{name}", g, j, e)


