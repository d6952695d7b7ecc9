"""A new user's check: a flax MLP with dot_general=jax_hopper.dot_general trains like
the default one (same loss and gradients); jax_hopper.nn's layers take flax's parameters.
(On Hopper it runs no cuBLAS product: tests/gpu/test_flax_gpu.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import hopper_devices, relative_error

import jax_hopper

nn = pytest.importorskip("flax.linen", reason="flax is not installed (pip install flax)")

BIG = bool(hopper_devices())
D_IN, D_HIDDEN, D_OUT, BATCH = (1024, 4096, 1024, 512) if BIG else (32, 64, 16, 8)


class MLP(nn.Module):
    dot_general: object = None

    @nn.compact
    def __call__(self, x):
        kw = {} if self.dot_general is None else {"dot_general": self.dot_general}
        x = nn.Dense(D_HIDDEN, dtype=jnp.float16, param_dtype=jnp.float32, **kw)(x)
        x = nn.gelu(x)
        return nn.Dense(D_OUT, dtype=jnp.float16, param_dtype=jnp.float32, **kw)(x)


def _loss(model, params, x, y):
    pred = model.apply(params, x).astype(jnp.float32)
    return jnp.mean((pred - y) ** 2)


def test_mlp_loss_and_grads_match_default_dense():
    kx, ky, kp = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (BATCH, D_IN), jnp.float32)
    y = jax.random.normal(ky, (BATCH, D_OUT), jnp.float32)
    ours, default = MLP(jax_hopper.dot_general), MLP()
    params = default.init(kp, x)
    step = lambda m: jax.jit(jax.value_and_grad(lambda p: _loss(m, p, x, y)))  # noqa: E731
    loss_ours, g_ours = step(ours)(params)
    loss_default, g_default = step(default)(params)
    # Same f16 compute on both sides: per-layer results differ only in summation order.
    assert abs(float(loss_ours) - float(loss_default)) <= 1e-2 * abs(float(loss_default))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_ours), jax.tree_util.tree_leaves(g_default)):
        assert relative_error(a, b) < 2e-2, jax.tree_util.keystr(path)


class PlainBlock(nn.Module):
    """The block a flax user writes: Dense, GELU(tanh), Dense, plus the input."""

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(D_HIDDEN, dtype=jnp.float16, param_dtype=jnp.float32)(x))
        return nn.Dense(D_IN, dtype=jnp.float16, param_dtype=jnp.float32)(h) + x.astype(jnp.float16)


@pytest.mark.parametrize("policy", ["auto", "kernel"])
def test_mlp_module_is_the_plain_block_with_its_parameters(policy):
    """jax_hopper.nn.MLP takes the plain block's parameter tree as it is, and trains like it."""
    from jax_hopper.nn import MLP as FusedMLP

    kx, kp = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (BATCH, D_IN), jnp.float32)
    plain = PlainBlock()
    fused = FusedMLP(D_HIDDEN, activation="gelu_tanh", dtype=jnp.float16)
    params = plain.init(kp, x)
    assert jax.tree.structure(fused.init(kp, x)) == jax.tree.structure(params)

    def step(model, p):
        return jax.jit(jax.value_and_grad(lambda p: 0.5 * jnp.sum(model.apply(p, x, *([x] if model is fused else []))
                                                                   .astype(jnp.float32) ** 2)))(p)

    with jax_hopper.dispatch(policy):
        loss_ours, g_ours = step(fused, params)
    loss_plain, g_plain = step(plain, params)
    assert abs(float(loss_ours) - float(loss_plain)) <= 1e-2 * abs(float(loss_plain))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_ours), jax.tree_util.tree_leaves(g_plain)):
        assert relative_error(a, b) < 2e-2, jax.tree_util.keystr(path)


class TwoDense(nn.Module):
    """jax_hopper.nn.MLP's parameters and computation (no activation) in plain flax, bf16."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(D_HIDDEN, dtype=jnp.bfloat16)(x)  # Dense_0 (flax names layers in creation order)
        return nn.Dense(D_IN, dtype=jnp.bfloat16)(h)


@pytest.mark.parametrize("layer", ["Dense", "MLP"])
def test_a_wider_residual_is_not_rounded_to_the_layer_dtype(layer):
    """An f32 residual stream (values ~100) around a bf16 layer: flax's
    `residual + Dense(..., dtype=bf16)(x)` promotes to f32. Ours must too, so the result
    differs from flax's by the bf16 rounding of the layer's own output (O(1) values:
    2^-8 relative), not by the residual's (100 * 2^-9 = 0.2)."""
    import jax_hopper.nn as jhnn

    kx, kr, kp = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(kx, (BATCH, D_IN), jnp.float32)
    residual = 100.0 + jax.random.normal(kr, (BATCH, D_IN), jnp.float32)
    if layer == "Dense":
        ours = jhnn.Dense(D_IN, dtype=jnp.bfloat16)
        plain = nn.Dense(D_IN, dtype=jnp.bfloat16)
    else:
        ours = jhnn.MLP(D_HIDDEN, activation=None, dtype=jnp.bfloat16)
        plain = TwoDense()
    params = plain.init(kp, x)
    expected = residual + plain.apply(params, x)
    layer_out = plain.apply(params, x).astype(jnp.float32)
    for policy in ("auto", "kernel"):
        with jax_hopper.dispatch(policy):
            got = jax.jit(lambda p: ours.apply(p, x, residual))(params)
        assert got.dtype == expected.dtype == jnp.float32
        bound = 4 * 2.0**-8 * float(jnp.max(jnp.abs(layer_out)))
        assert float(jnp.max(jnp.abs(got - expected))) <= bound, policy


@pytest.mark.parametrize("layer", ["Dense", "MLP"])
def test_a_broadcast_residual_is_added_as_flax_adds_it(layer):
    """flax's `residual + Dense(...)(x)` broadcasts a residual row [N] or a scalar; ours
    must take them too, in the layer's own type as well as a wider one (the layer's type
    went to the epilogue, which takes only [..., N], and raised)."""
    import jax_hopper.nn as jhnn

    kx, kr, kp = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (BATCH, D_IN), jnp.float32)
    row = jax.random.normal(kr, (D_IN,), jnp.float32)
    if layer == "Dense":
        ours, plain = jhnn.Dense(D_IN, dtype=jnp.bfloat16), nn.Dense(D_IN, dtype=jnp.bfloat16)
    else:
        ours, plain = jhnn.MLP(D_HIDDEN, activation=None, dtype=jnp.bfloat16), TwoDense()
    params = plain.init(kp, x)
    layer_out = plain.apply(params, x).astype(jnp.float32)
    bound = 4 * 2.0**-8 * float(jnp.max(jnp.abs(layer_out)))  # the layer's bf16 rounding, as above
    for residual in (row.astype(jnp.bfloat16), row, 1.5):
        expected = residual + plain.apply(params, x)
        for policy in ("auto", "kernel"):
            with jax_hopper.dispatch(policy):
                got = jax.jit(lambda p, r: ours.apply(p, x, r))(params, residual)
            assert got.shape == expected.shape and got.dtype == expected.dtype, (policy, residual)
            err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - expected.astype(jnp.float32))))
            assert err <= bound + 2.0**-8 * float(jnp.max(jnp.abs(expected.astype(jnp.float32)))), (policy, err)


@pytest.mark.parametrize("layer", ["Dense", "MLP"])
def test_complex_layers_compute_like_flax(layer):
    """flax.linen.Dense promotes any inexact type (complex x, or a complex param_dtype);
    ours refused complex operands ('floating-point operands only'). Complex layers are
    jnp's computation: flax's values, to f32 rounding."""
    import jax_hopper.nn as jhnn

    kx, kp = jax.random.split(jax.random.key(9))
    x = jax.random.normal(kx, (BATCH, D_IN), jnp.float32) + 1j * jax.random.normal(kp, (BATCH, D_IN), jnp.float32)

    class TwoDense(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(D_IN, name="Dense_1")(nn.Dense(D_HIDDEN, name="Dense_0")(x))

    for inputs, kw in ((x.astype(jnp.complex64), {}), (x.real, {"param_dtype": jnp.complex64})):
        if layer == "Dense":
            ours, plain = jhnn.Dense(D_IN, **kw), nn.Dense(D_IN, **kw)
        else:
            ours, plain = jhnn.MLP(D_HIDDEN, activation=None, **kw), TwoDense()
            if kw:
                continue  # TwoDense has no param_dtype to share
        params = plain.init(kp, inputs)
        got, want = ours.apply(params, inputs), plain.apply(params, inputs)
        assert got.dtype == want.dtype == jnp.complex64
        assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-5  # complex: no f32 cast
