"""Flax (linen) layers on the fused kernel. Needs flax (``pip install flax``).

``Dense`` is ``flax.linen.Dense`` with an ``activation`` and an optional residual
input, computed by ``jax_hopper.dense`` in one launch. Parameters have the same names,
shapes and initialisers as ``flax.linen.Dense`` ("kernel" [in, features], "bias"
[features]), so checkpoints move between the two.

``MLP`` is the block ``Dense -> activation -> Dense`` (+ an optional residual) through
``jax_hopper.mlp``; its parameters are those of that block written with two
``flax.linen.Dense`` layers ("Dense_0", "Dense_1").

A residual is added in the kernel's epilogue where jnp's promotion with the layer's
dtype gives that dtype; a wider one (an f32 residual stream around a bf16 layer) is added after the
layer, so the result has its type, as ``residual + flax.linen.Dense(...)(x)`` would.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jax_hopper.layers import dense, mlp


def _dense_params(module, in_features):
    """flax.linen.Dense's parameters ("kernel" [in, features], "bias" [features]), made in
    `module` (which has Dense's fields) as Dense makes them."""
    kernel = module.param("kernel", module.kernel_init, (in_features, module.features), module.param_dtype)
    bias = module.param("bias", module.bias_init, (module.features,), module.param_dtype) if module.use_bias else None
    return kernel, bias


def _fusable(residual, dtype, out_shape):
    """(the residual to add in the kernel's epilogue, the one to add after it) for a layer
    computing `out_shape` in `dtype`. `residual + layer(x)` in flax promotes and
    broadcasts: a residual wider than the layer (an f32 stream around a bf16 layer) gives
    a wider result, and one of another shape (a scalar, a row [N]) is broadcast, so those
    are added after, as jnp would; one of the output's shape whose promotion with `dtype`
    is `dtype` is fused."""
    if residual is None:
        return None, None
    if jnp.shape(residual) == tuple(out_shape) and jnp.promote_types(jnp.result_type(residual), dtype) == dtype:
        return jnp.asarray(residual).astype(dtype), None
    return None, residual


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
        kernel, bias = _dense_params(self, jnp.shape(x)[-1])
        x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
        fused, residual = _fusable(residual, x.dtype, jnp.shape(x)[:-1] + (self.features,))
        y = dense(x, kernel, bias, activation=self.activation, residual=fused)
        return y if residual is None else residual + y


class _DenseParams(nn.Module):
    """flax.linen.Dense's parameters alone (same names, shapes and initialisers)."""
    features: int
    use_bias: bool
    param_dtype: Any
    kernel_init: Any
    bias_init: Any

    @nn.compact
    def __call__(self, in_features):
        return _dense_params(self, in_features)


class MLP(nn.Module):
    hidden_features: int
    features: int | None = None  # the output width; default: x's
    activation: str | None = "gelu_tanh"  # None, "relu", "gelu_tanh", "gelu_exact", "silu"
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = nn.initializers.lecun_normal()
    bias_init: Any = nn.initializers.zeros_init()

    @nn.compact
    def __call__(self, x, residual=None):
        d_in = jnp.shape(x)[-1]
        out = self.features if self.features is not None else d_in
        layer = dict(use_bias=self.use_bias, param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                     bias_init=self.bias_init)
        w1, b1 = _DenseParams(self.hidden_features, name="Dense_0", **layer)(d_in)
        w2, b2 = _DenseParams(out, name="Dense_1", **layer)(self.hidden_features)
        x, w1, b1, w2, b2 = nn.dtypes.promote_dtype(x, w1, b1, w2, b2, dtype=self.dtype)
        fused, residual = _fusable(residual, x.dtype, jnp.shape(x)[:-1] + (out,))
        y = mlp(x, w1, b1, w2, b2, activation=self.activation, residual=fused)
        return y if residual is None else residual + y
