"""Flax (linen) layers on the fused kernel. Needs flax (``pip install flax``).

``Dense`` is ``flax.linen.Dense`` with an ``activation`` and an optional residual
input, computed by ``jax_hopper.dense`` in one launch. Parameters have the same names,
shapes and initialisers as ``flax.linen.Dense`` ("kernel" [in, features], "bias"
[features]), so checkpoints move between the two.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jax_hopper.ops import dense


class Dense(nn.Module):
    features: int
    use_bias: bool = True
    activation: str | None = None  # None, "relu", "gelu_tanh", "gelu_exact", "silu"
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = nn.initializers.lecun_normal()
    bias_init: Any = nn.initializers.zeros_init()

    @nn.compact
    def __call__(self, x, residual=None):
        kernel = self.param("kernel", self.kernel_init, (jnp.shape(x)[-1], self.features), self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        x, kernel, bias, residual = nn.dtypes.promote_dtype(x, kernel, bias, residual, dtype=self.dtype)
        return dense(x, kernel, bias, activation=self.activation, residual=residual)
