"""GPU tests (Hopper only; skipped with a reason elsewhere): the fused epilogue's backward
form, dz = (g @ w^T) * act'(z), and jax_hopper.mlp's gradients on the kernel.

Fresh random inputs, output poisoned with NaN first. The backward form rounds once, as
its f32 reference (f32 product times act'(z) in f32) does: the same 1.5x-the-rounding
rule as test_dense.py. The block's gradients follow test_mlp.py's rule (at most 1.5x
the error of jnp's own block, both against the f32 block).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from helpers import relative_error, run_into_poison, seed_normal
from test_dense import ACTIVATIONS, ERROR_FACTOR, F32_ACT
from test_mlp import ARGNUMS, assert_gradients_as_accurate_as_jnp, block_operands, grads, loss, ours

import jax_hopper
from jax_hopper._fused import fused_activation_grad

SHAPES = [  # (M, N, K): g [M, K], w [N, K], z [M, N]
    (4096, 4096, 4096),
    (1000, 600, 520),  # partial tiles in M and N, K not a multiple of 64
    (129, 264, 72),  # one row past a tile
    (100, 102, 103),  # odd K: g and w padded for TMA; N not a multiple of 8: registers store
]


def _operands(lead, n, k, dtype, seed):
    kg, kw, kz = jax.random.split(jax.random.key(seed), 3)
    g = seed_normal(kg, tuple(lead) + (k,), dtype, k)
    w = seed_normal(kw, (n, k), dtype, k)
    # Pre-activations spread over the activations' curved range and tails (|z| up to ~8).
    z = (2.0 * jax.random.normal(kz, tuple(lead) + (n,), jnp.float32)).astype(dtype)
    return g, w, z


def _reference(g, w, z, activation):
    f32 = jnp.float32
    dh = jnp.einsum("...k,nk->...n", g.astype(f32), w.astype(f32), precision="highest")
    derivative = jax.vmap(jax.grad(F32_ACT[activation]))(z.astype(f32).ravel()).reshape(z.shape)
    return dh * derivative


def assert_backward_form_close(out, g, w, z, activation):
    ref = _reference(g, w, z, activation)
    err, err_round = relative_error(out, ref), relative_error(ref.astype(out.dtype), ref)
    assert err <= ERROR_FACTOR * err_round + 1e-6, f"{err:.3e} vs rounding alone {err_round:.3e}"


@pytest.mark.parametrize("activation", [a for a in ACTIVATIONS if a])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_backward_form_matches_the_f32_reference(hopper, shape, dtype, activation):
    m, n, k = shape
    g, w, z = _operands((m,), n, k, dtype, seed=m + n + k)
    out, _ = run_into_poison(lambda g, w, z: fused_activation_grad(g, w, z, activation=activation), (m, n), dtype,
                             g, w, z)
    assert not bool(jnp.isnan(out).any()), "unwritten (still poisoned) or NaN elements"
    assert_backward_form_close(out, g, w, z, activation)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_backward_form_multiplies_a_saved_derivative(hopper, shape, dtype):
    """activation None: z holds act'(z1) itself, and the epilogue multiplies by it."""
    m, n, k = shape
    g, w, d = _operands((m,), n, k, dtype, seed=m * n + k)
    out, _ = run_into_poison(lambda g, w, d: fused_activation_grad(g, w, d, activation=None), (m, n), dtype, g, w, d)
    assert not bool(jnp.isnan(out).any()), "unwritten (still poisoned) or NaN elements"
    ref = jnp.einsum("mk,nk->mn", g.astype(jnp.float32), w.astype(jnp.float32), precision="highest") * \
        d.astype(jnp.float32)
    err, err_round = relative_error(out, ref), relative_error(ref.astype(dtype), ref)
    assert err <= ERROR_FACTOR * err_round + 1e-6, f"{err:.3e} vs rounding alone {err_round:.3e}"


def test_backward_form_with_leading_dims_and_odd_width(hopper):
    """Leading dims fold into M; an odd N (z read in pairs) is computed through XLA."""
    for n in (264, 101):
        g, w, z = _operands((3, 70), n, 136, jnp.bfloat16, seed=n)
        out = jax.jit(lambda g, w, z: fused_activation_grad(g, w, z, activation="gelu_exact"))(g, w, z)
        assert out.shape == (3, 70, n)
        assert_backward_form_close(out, g, w, z, "gelu_exact")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
def test_block_gradients_on_the_kernel(hopper, dtype, activation):
    operands = block_operands((2, 300), 264, 1000, dtype, seed=17)
    with jax_hopper.dispatch("kernel"):
        mine = grads(ours(activation), operands)
    assert_gradients_as_accurate_as_jnp(mine, operands, activation)


def test_block_gradient_program_runs_the_backward_form(hopper):
    operands = block_operands((512,), 256, 1024, jnp.float16)
    with jax_hopper.dispatch("kernel"):
        hlo = jax.jit(jax.grad(loss(ours("gelu_tanh")), argnums=ARGNUMS)).lower(*operands).compile().as_text()
    assert len(re.findall(r'custom_call_target="jax_hopper_gemm_fused"', hlo)) == 3, "two forward, one backward"
    assert "__cublas" not in hlo
