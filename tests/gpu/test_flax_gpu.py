"""On Hopper, a flax MLP with dot_general=jax_hopper.dot_general runs every product of its
training step on our kernel, none on cuBLAS."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jax_hopper

nn = pytest.importorskip("flax.linen", reason="flax is not installed (pip install flax)")


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        dense = dict(dtype=jnp.float16, param_dtype=jnp.float32, dot_general=jax_hopper.dot_general)
        return nn.Dense(1024, **dense)(nn.gelu(nn.Dense(4096, **dense)(x)))


def test_mlp_hlo_has_no_cublas_product_on_hopper(hopper):
    x, y = jnp.ones((512, 1024), jnp.float32), jnp.ones((512, 1024), jnp.float32)
    model = MLP()
    params = model.init(jax.random.key(0), x)
    loss = lambda p: jnp.mean((model.apply(p, x).astype(jnp.float32) - y) ** 2)  # noqa: E731
    hlo = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
    assert hlo.count('custom_call_target="jax_hopper_gemm"') == 5  # 2 forward, 3 backward
    assert "__cublas" not in hlo
