"""Flax (linen) layers on the fused kernel. Needs flax (``pip install flax``).

``Dense`` is ``flax.linen.Dense`` with an ``activation`` and an optional residual
input, computed by ``jax_hopper.dense`` in one launch. Parameters have the same names,
shapes and initialisers as ``flax.linen.Dense`` ("kernel" [in, features], "bias"
[features]), so checkpoints move between the two.

``MLP`` is the block ``Dense -> activation -> Dense`` (+ an optional residual) through
``jax_hopper.mlp``; its parameters are those of that block written with two
``flax.linen.Dense`` layers ("Dense_0", "Dense_1").

``MoE`` is a mixture-of-experts feed-forward layer: top-k routing, the routed rows sorted
by expert, SiLU-gated experts (up, gate and down projections) as grouped products
(``jax_hopper.ragged_dot`` by default, or any function with ``jax.lax.ragged_dot``'s
signature), then unsorted and weighted.

A residual is added in the kernel's epilogue where jnp's promotion with the layer's
dtype gives that dtype; a wider one (an f32 residual stream around a bf16 layer) is added after the
layer, so the result has its type, as ``residual + flax.linen.Dense(...)(x)`` would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_hopper.layers import dense, mlp
from jax_hopper.ragged import ragged_dot


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


class MoE(nn.Module):
    """Top-k routed experts, each SiLU(x w_gate) * (x w_up) then w_down, on grouped products.

    x [..., features] -> [..., features]. Parameters: "router" [features, num_experts]
    (f32 logits), "up" and "gate" [num_experts, features, hidden_features], "down"
    [num_experts, hidden_features, features]. The router's top_k probabilities,
    renormalised, weight each token's experts. `ragged_dot` computes the grouped
    products: ``jax_hopper.ragged_dot`` (the dispatcher's path) or
    ``jax.lax.ragged_dot``, on the same layer.
    """

    num_experts: int
    hidden_features: int
    top_k: int = 2
    dtype: Any = jnp.bfloat16
    param_dtype: Any = jnp.float32
    kernel_init: Callable = nn.initializers.lecun_normal(batch_axis=(0,))
    ragged_dot: Callable = ragged_dot

    @nn.compact
    def __call__(self, x):
        features = x.shape[-1]
        tokens = x.reshape(-1, features)
        experts, hidden = self.num_experts, self.hidden_features
        router = self.param("router", nn.initializers.lecun_normal(), (features, experts), self.param_dtype)
        up = self.param("up", self.kernel_init, (experts, features, hidden), self.param_dtype)
        gate = self.param("gate", self.kernel_init, (experts, features, hidden), self.param_dtype)
        down = self.param("down", self.kernel_init, (experts, hidden, features), self.param_dtype)

        logits = jnp.dot(tokens.astype(jnp.float32), router.astype(jnp.float32))
        weights, chosen = jax.lax.top_k(jax.nn.softmax(logits), self.top_k)  # [T, k]
        weights = weights / weights.sum(-1, keepdims=True)
        flat = chosen.reshape(-1)  # the (token, slot) pairs' experts
        order = jnp.argsort(flat, stable=True)  # pairs sorted by expert
        sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
        rows = tokens.astype(self.dtype)[order // self.top_k]
        cast = lambda w: w.astype(self.dtype)  # noqa: E731
        h = nn.silu(self.ragged_dot(rows, cast(gate), sizes)) * self.ragged_dot(rows, cast(up), sizes)
        out = self.ragged_dot(h, cast(down), sizes)  # [T * k, features], sorted
        unsorted = jnp.zeros_like(out).at[order].set(out).reshape(-1, self.top_k, features)
        mixed = (unsorted.astype(jnp.float32) * weights[..., None]).sum(1)
        return mixed.astype(self.dtype).reshape(x.shape)
