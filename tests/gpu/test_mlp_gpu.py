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
import numpy as np
import pytest
from helpers import ACTIVATIONS, F32_ACT, ULP, relative_error, run_into_poison, run_into_poisons, seed_normal
from layer_cases import (
    ARGNUMS,
    ERROR_FACTOR,
    assert_gradients_as_accurate_as_jnp,
    block_operands,
    grads,
    loss,
    ours,
)

import jax_hopper
from jax_hopper import _dispatch
from jax_hopper.primitives.dense_derivative import fused_dense_with_derivative
from jax_hopper.primitives.dense_grad import fused_activation_grad

SHAPES = [  # (M, N, K): g [M, K], w [N, K], z [M, N]
    (4096, 4096, 4096),
    (1000, 600, 520),  # partial tiles in M and N, K not a multiple of 64
    (129, 264, 72),  # one row past a tile
    (100, 102, 103),  # odd K: g and w padded for TMA; N not a multiple of 8: through XLA
]


def _operands(lead, n, k, dtype, seed):
    kg, kw, kz = jax.random.split(jax.random.key(seed), 3)
    g = seed_normal(kg, tuple(lead) + (k,), dtype, k)
    w = seed_normal(kw, (n, k), dtype, k)
    # Pre-activations spread over the activations' curved range and tails (|z| up to ~8).
    z = (2.0 * jax.random.normal(kz, tuple(lead) + (n,), jnp.float32)).astype(dtype)
    return g, w, z


def _f32_derivative(z, activation):
    z = z.astype(jnp.float32)
    if activation is None:  # z is the saved act'(z1) itself
        return z
    return jax.vmap(jax.grad(F32_ACT[activation]))(z.ravel()).reshape(z.shape)


def _reference(g, w, z, activation):
    f32 = jnp.float32
    dh = jnp.einsum("...k,nk->...n", g.astype(f32), w.astype(f32), precision="highest")
    return dh * _f32_derivative(z, activation)


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


DERIVATIVE_SHAPES = [  # (M, N, K): x [M, K], w [K, N]; N a multiple of 8 (D is TMA-stored)
    (4096, 4096, 4096),
    (1000, 600, 520),  # partial tiles in M and N, K not a multiple of 64
    (129, 264, 72),  # one row past a tile
    (100, 104, 103),  # odd K: x and w padded for TMA
]


@pytest.mark.parametrize("activation", [a for a in ACTIVATIONS if a])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("shape", DERIVATIVE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_derivative_form_matches_the_f32_reference(hopper, shape, dtype, activation):
    """act(x w + b) and act'(x w + b), both from the f32 sum, each rounded once."""
    m, n, k = shape
    kx, kw, kb = jax.random.split(jax.random.key(m + 3 * n + k), 3)
    x = seed_normal(kx, (m, k), dtype, k)
    w = seed_normal(kw, (k, n), dtype, k)
    b = jax.random.normal(kb, (n,), jnp.float32).astype(dtype)
    (h, d), _ = run_into_poisons(lambda x, w, b: fused_dense_with_derivative(x, w, b, activation=activation),
                                 [(m, n), (m, n)], dtype, x, w, b)
    assert not bool(jnp.isnan(h).any() | jnp.isnan(d).any()), "unwritten (still poisoned) or NaN elements"
    z = jnp.einsum("mk,kn->mn", x.astype(jnp.float32), w.astype(jnp.float32), precision="highest") + \
        b.astype(jnp.float32)
    h_ref = F32_ACT[activation](z)
    d_ref = jax.vmap(jax.grad(F32_ACT[activation]))(z.ravel()).reshape(z.shape)
    if activation == "relu":
        # act' is a step: exact away from 0; where the f32 sums of kernel and reference may
        # differ in sign (|z| within their summation error of 0) either side is right.
        sure = jnp.abs(z) > 1e-3
        assert bool(jnp.all(jnp.where(sure, d == d_ref, (d == 0) | (d == 1)))), "wrong step"
        d, d_ref = jnp.where(sure, d, 0).astype(dtype), jnp.where(sure, d_ref, 0)
    for name, out, ref in (("act", h, h_ref), ("act'", d, d_ref)):
        err, err_round = relative_error(out, ref), relative_error(ref.astype(dtype), ref)
        assert err <= ERROR_FACTOR * err_round + 1e-6, f"{name}: {err:.3e} vs rounding alone {err_round:.3e}"


def test_derivative_form_with_leading_dims_and_other_widths(hopper):
    """Leading dims fold into M; an N that is not a multiple of 8 is computed through XLA."""
    for n in (264, 100):
        x = seed_normal(jax.random.key(n), (3, 70, 136), jnp.bfloat16, 136)
        w = seed_normal(jax.random.key(n + 1), (136, n), jnp.bfloat16, 136)
        h, d = jax.jit(lambda x, w: fused_dense_with_derivative(x, w, activation="gelu_exact"))(x, w)
        z = jnp.einsum("bmk,kn->bmn", x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")
        d_ref = jax.vmap(jax.grad(F32_ACT["gelu_exact"]))(z.ravel()).reshape(z.shape)
        assert h.shape == d.shape == (3, 70, n)
        for out, ref in ((h, F32_ACT["gelu_exact"](z)), (d, d_ref)):
            assert relative_error(out, ref) <= ERROR_FACTOR * relative_error(ref.astype(out.dtype), ref) + 1e-6


@pytest.mark.parametrize("activation", [a for a in ACTIVATIONS if a])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
def test_block_gradients_with_the_saved_derivative_on_the_kernel(hopper, dtype, activation):
    """The forward writes act'(z1) (derivative kind), the backward multiplies by it."""
    operands = block_operands((2, 300), 264, 1000, dtype, seed=19)
    with jax_hopper.dispatch("kernel"), _dispatch.saved_derivative({activation}):
        mine = grads(ours(activation), operands)
        hlo = jax.jit(jax.grad(loss(ours(activation)), argnums=ARGNUMS)).lower(*operands).compile().as_text()
    assert 'custom_call_target="jax_hopper_gemm_fused_derivative"' in hlo
    assert_gradients_as_accurate_as_jnp(mine, operands, activation)


def test_backward_form_with_leading_dims_and_odd_width(hopper):
    """Leading dims fold into M; an N off the TMA multiple of 8 is computed through XLA."""
    for n in (264, 101):
        g, w, z = _operands((3, 70), n, 136, jnp.bfloat16, seed=n)
        out = jax.jit(lambda g, w, z: fused_activation_grad(g, w, z, activation="gelu_exact"))(g, w, z)
        assert out.shape == (3, 70, n)
        assert_backward_form_close(out, g, w, z, "gelu_exact")


# ---- the bias gradient summed in the backward form's epilogue --------------------------
BIAS_GRAD_SHAPES = [  # (leading dims of g and z, N, K)
    ((4096,), 4096, 4096),
    ((1000,), 600, 520),  # partial tiles in M and N; M not a multiple of 64
    ((129,), 264, 72),  # the last tile's second warpgroup has no rows
    ((3, 50), 136, 64),  # leading dims fold into M (150 rows)
]


def _column_sums(g, w, z, activation, rows_per_sum):
    """Per `rows_per_sum` rows of the f32 dz (leading dims folded into M, rows past M
    adding zeros, as the kernel's do), in float64: its column sums, and those of
    |dh| |act'(z)| and of |dh| (|dh| = |g||w|^T), which bound their error
    (column_sum_bound)."""
    f32 = jnp.float32
    n = w.shape[0]
    dh = jnp.einsum("...k,nk->...n", g.astype(f32), w.astype(f32), precision="highest").reshape(-1, n)
    abs_dh = jnp.einsum("...k,nk->...n", jnp.abs(g.astype(f32)), jnp.abs(w.astype(f32)),
                        precision="highest").reshape(-1, n)
    d = _f32_derivative(z, activation).reshape(-1, n)
    pad = -dh.shape[0] % rows_per_sum

    def blocks(t):
        return np.asarray(jnp.pad(t, ((0, pad), (0, 0))), np.float64).reshape(-1, rows_per_sum, n).sum(axis=1)

    return blocks(dh * d), blocks(abs_dh * jnp.abs(d)), blocks(abs_dh)


# act'(z) in f32, the kernel's or jax's, is off by at most this much absolutely: its terms
# are O(1) (|gelu'| < 1.13, |silu'| < 1.1), a few ulps of 1 apart between the kernel's
# exp-based forms and jax's (whose f32 tanh saturates: its tanh-GELU' is exactly 0 below
# z ~ -4.3, where the kernel's is ~1e-7).
DERIVATIVE_ABS_ERROR = 2.0**-18


def column_sum_bound(k, rows_per_sum, sums):
    """The f32 error allowed in the kernel's column sums, from _column_sums' `sums`: K
    roundings in the product and one per row in the sum (relative to the sums of |dz|),
    2^-14 relative for act''s evaluation, and DERIVATIVE_ABS_ERROR times the sums of |dh|."""
    _, abs_sums, abs_dh_sums = sums
    return ((k + rows_per_sum) * 2.0**-24 + 2.0**-14) * abs_sums + DERIVATIVE_ABS_ERROR * abs_dh_sums


@pytest.mark.parametrize("activation", [None, "gelu_exact", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("shape", BIAS_GRAD_SHAPES, ids=lambda s: "x".join(map(str, s[0] + s[1:])))
def test_backward_form_bias_gradient_matches_the_f32_reference(hopper, shape, dtype, activation):
    """db = dz's column sums, from the epilogue's per-64-row sums: within one rounding to
    the output type of the f32 column sums of the f32 dz, plus their f32 error bound; dz
    as the backward form without them."""
    lead, n, k = shape
    g, w, z = _operands(lead, n, k, dtype, seed=len(lead) + n + k)
    rows = int(np.prod(lead))
    (dz, db), _ = run_into_poisons(
        lambda g, w, z: fused_activation_grad(g, w, z, activation=activation, bias_grad=True),
        [lead + (n,), (n,)], dtype, g, w, z)
    assert not bool(jnp.isnan(dz).any() or jnp.isnan(db).any()), "unwritten (still poisoned) or NaN elements"
    sums = _column_sums(g, w, z, activation, rows)
    ref = sums[0][0]
    err = np.abs(np.asarray(db, np.float64) - ref)
    allowed = ULP[jnp.dtype(dtype).name] * np.abs(ref) + column_sum_bound(k, rows, sums)[0]
    assert (err <= allowed).all(), f"worst column {int(np.argmax(err / allowed))}: {err.max():.3e}"
    assert_backward_form_close(dz, g, w, z, activation)


@pytest.mark.parametrize("m,n", [(129, 264), (200, 520), (64, 8)])
def test_backward_form_column_sums_cover_every_block(hopper, m, n):
    """The handler's partial sums, called directly with both results poisoned (NaN):
    every one of the ceil(M / 64) rows and N columns is written, each the column sums of
    its 64 rows of dz (rows past M add nothing)."""
    from jax_hopper.primitives.dense_grad import COLUMN_SUM_ROWS

    k = 200
    g, w, z = _operands((m,), n, k, jnp.float16, seed=m + n)
    row_blocks = -(-m // COLUMN_SUM_ROWS)
    call = jax.ffi.ffi_call("jax_hopper_gemm_fused_grad", (jax.ShapeDtypeStruct((m, n), jnp.float16),
                                                          jax.ShapeDtypeStruct((row_blocks, n), jnp.float32),
                                                          jax.ShapeDtypeStruct((1 << 20,), jnp.uint8)))
    attrs = {"transpose_a": np.int32(0), "transpose_b": np.int32(1), "activation": np.int32(2)}  # tanh-GELU
    poisons = [jnp.full((m, n), jnp.nan, jnp.float16), jnp.full((row_blocks, n), jnp.nan, jnp.float32)]
    ptrs = [p.unsafe_buffer_pointer() for p in poisons]
    outs = jax.jit(lambda p0, p1, g, w, z: call(g, w, z, **attrs), donate_argnums=(0, 1), keep_unused=True)(
        *poisons, g, w, z)
    jax.block_until_ready(outs)
    dz, partial, _ = outs
    assert [o.unsafe_buffer_pointer() for o in (dz, partial)] == ptrs, "the poisoned buffers were not the outputs"
    assert not bool(jnp.isnan(dz).any() or jnp.isnan(partial).any()), "unwritten (still poisoned) elements"
    sums = _column_sums(g, w, z, "gelu_tanh", COLUMN_SUM_ROWS)
    err = np.abs(np.asarray(partial, np.float64) - sums[0])
    bound = column_sum_bound(k, COLUMN_SUM_ROWS, sums)
    assert (err <= bound).all(), f"worst block/column {np.unravel_index(np.argmax(err / bound), err.shape)}"


def test_backward_form_bias_gradient_under_vmap(hopper):
    """vmap over g and z with a shared w: one launch over the joined rows, each example's
    db XLA's f32 sum of its rounded dz (so one more rounding of each |dz| allowed)."""
    g, w, z = _operands((4, 96), 136, 64, jnp.bfloat16, seed=5)
    dz, db = jax.jit(jax.vmap(lambda g, z: fused_activation_grad(g, w, z, activation="silu", bias_grad=True)))(g, z)
    assert dz.shape == (4, 96, 136) and db.shape == (4, 136)
    for i in range(4):
        sums = _column_sums(g[i], w, z[i], "silu", 96)
        ref, abs_sums = sums[0][0], sums[1][0]
        err = np.abs(np.asarray(db[i], np.float64) - ref)
        ulp = ULP["bfloat16"]
        assert (err <= ulp * np.abs(ref) + column_sum_bound(64, 96, sums)[0] + ulp * abs_sums).all()
        assert_backward_form_close(dz[i], g[i], w, z[i], "silu")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
def test_block_gradients_on_the_kernel(hopper, dtype, activation):
    operands = block_operands((2, 300), 264, 1000, dtype, seed=17)
    with jax_hopper.dispatch("kernel"):
        mine = grads(ours(activation), operands)
    assert_gradients_as_accurate_as_jnp(mine, operands, activation)


@pytest.mark.parametrize("saved", [False, True], ids=["z1", "saved_act'"])
def test_block_gradient_program_runs_the_backward_form(hopper, saved):
    operands = block_operands((512,), 256, 1024, jnp.float16)
    with jax_hopper.dispatch("kernel"), _dispatch.saved_derivative({"gelu_tanh"} if saved else ()):
        hlo = jax.jit(jax.grad(loss(ours("gelu_tanh")), argnums=ARGNUMS)).lower(*operands).compile().as_text()
    # Forward: x w1 + b1 (with act'(z1) in the saved form) and h w2 + b2 + x, both fused.
    assert len(re.findall(r'custom_call_target="jax_hopper_gemm_fused"', hlo)) == (1 if saved else 2)
    assert len(re.findall(r'custom_call_target="jax_hopper_gemm_fused_derivative"', hlo)) == int(saved)
    assert len(re.findall(r'custom_call_target="jax_hopper_gemm_fused_grad"', hlo)) == 1, "one backward"
    assert "__cublas" not in hlo


def test_exact_gelu_lower_tail_elementwise(hopper):
    """Exact GELU deep in its lower tail, element by element, in all three epilogue forms.

    bf16 keeps f32's exponent range, so GELU(z) ~ -1e-20 at z = -9.5 is a normal bf16
    value that must come out right, not 0. The bound per element, each term from the
    arithmetic:
    - one bf16 ulp, 2^-7 relative: rounding once costs up to half of it (2^-8), the f32
      value rounded is within 8e-6 relative of the truth (epilogue/activations.cuh: normal_cdf);
    - f32 summation order: the kernel's z may differ from the reference's by
      dz = K u sum|x||w| (+ u |z| for the bias add), which moves act by |act'(z)| dz and
      act' by |act''(z)| dz; the backward form's product likewise, times |act'(z)|;
    - act' = Phi + z phi sums two terms: its f32 error is a few ulp of |Phi| + |z phi|
      (16 u allowed), which matters only near act''s zero at z = -0.75;
    - 2^-122: below z = -13.2 the exp flushes to 0 (ftz), and so do act and act', then
      below 2^-123 in magnitude.
    Every term but the first shrinks with the tail's values, so an output of 0 there
    (the former 0.5 (1 + erff(z / sqrt2)) gave 0 below z = -5.5) still fails.
    """
    dtype, m, n, k = jnp.bfloat16, 256, 264, 64
    u = 2.0**-24  # f32 unit roundoff
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    kx, kw, kg = jax.random.split(jax.random.key(23), 3)
    x = seed_normal(kx, (m, k), dtype, k)
    w = seed_normal(kw, (k, n), dtype, k)
    b = jnp.linspace(-10.0, -2.0, n).astype(dtype)  # z = x w + b spans the tail, |x w| ~ 1
    z = jnp.einsum("mk,kn->mn", f32(x), f32(w), precision="highest") + f32(b)
    z_err = k * u * jnp.einsum("mk,kn->mn", jnp.abs(f32(x)), jnp.abs(f32(w)), precision="highest") + u * jnp.abs(z)

    def derivatives(z):  # act'(z), act''(z) and |Phi| + |z phi| of exact GELU, in f32
        phi = jnp.exp(-0.5 * z * z) / jnp.sqrt(2.0 * jnp.pi)
        cdf = 0.5 * jax.scipy.special.erfc(-z / jnp.sqrt(2.0))
        return cdf + z * phi, phi * (2.0 - z * z), cdf + jnp.abs(z) * phi

    act = F32_ACT["gelu_exact"]
    d_ref, d2, d_terms = derivatives(z)

    def dense(x, w, b):
        with jax_hopper.dispatch("kernel"):
            return jax_hopper.dense(x, w, b, activation="gelu_exact")

    forward, _ = run_into_poison(dense, (m, n), dtype, x, w, b)
    (h, d), _ = run_into_poisons(lambda x, w, b: fused_dense_with_derivative(x, w, b, activation="gelu_exact"),
                                 [(m, n), (m, n)], dtype, x, w, b)
    # The backward form with this z (rounded to bf16, as the forward would save it).
    g = seed_normal(kg, (m, k), dtype, k)
    zb = z.astype(dtype)
    dz, _ = run_into_poison(lambda g, w, z: fused_activation_grad(g, w, z, activation="gelu_exact"), (m, n), dtype,
                            g, w.T, zb)
    zb_grad, _, zb_terms = derivatives(f32(zb))
    dh = jnp.einsum("mk,nk->mn", f32(g), f32(w.T), precision="highest")
    dh_err = k * u * jnp.einsum("mk,nk->mn", jnp.abs(f32(g)), jnp.abs(f32(w.T)), precision="highest")
    checks = (
        ("dense", forward, act(z), jnp.abs(d_ref) * z_err),
        ("derivative form act", h, act(z), jnp.abs(d_ref) * z_err),
        ("derivative form act'", d, d_ref, jnp.abs(d2) * z_err + 16 * u * d_terms),
        ("backward form", dz, dh * zb_grad, dh_err * jnp.abs(zb_grad) + 16 * u * jnp.abs(dh) * zb_terms),
    )
    for name, out, ref, slack in checks:
        o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
        assert not np.isnan(o).any(), f"{name}: unwritten (still poisoned) or NaN elements"
        assert (np.abs(r) > 1e-30).mean() > 0.9, "the test must reach the tail's small values"
        bad = np.abs(o - r) > ULP["bfloat16"] * np.abs(r) + np.asarray(slack, np.float64) + 2.0**-122
        assert not bad.any(), f"{name}: {bad.sum()} elements off, e.g. {o[bad][:3]} vs {r[bad][:3]}"
