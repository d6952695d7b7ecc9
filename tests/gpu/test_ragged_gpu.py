"""GPU tests (Hopper only; skipped with a reason elsewhere): the grouped kernel
(ragged_dot's forward and both gradient products) against the float64 per-group
reference, outputs poisoned with NaN first (tests/ragged_cases.py: the tolerance is one
ulp of the output type plus the worst-case f32 summation error)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import run_into_poison
from ragged_cases import (
    assert_gradients_within_rounding,
    assert_within_rounding,
    contract_reference,
    operands,
    rows_reference,
    sizes_of,
)

import jax_hopper
from jax_hopper.primitives.ragged_dot import ragged_contract, ragged_rows

DTYPES = [pytest.param(jnp.float16, id="f16"), pytest.param(jnp.bfloat16, id="bf16")]
# (M, K, N, G, sizes): balanced groups over several tiles; skew, partial N tile; one
# group (G = 1); empty groups and groups smaller than a tile (G = 256); the sizes summing
# short of M (rows past them are zeros); a group of one row each; 64 groups over K = 64;
# an odd N (rhs [G, N, K] on the kernel, its C rows stored a half pair at a time where
# unaligned; rhs [G, K, N] then takes jax's computation); group sizes around a warp's 16
# rows, with N = 72 (sub-tiles wholly past N).
ROWS_CASES = [
    (2048, 512, 768, 8, "balanced"),
    (1000, 256, 264, 64, "skewed"),
    (777, 128, 136, 1, "one"),
    (513, 192, 128, 256, "sparse"),
    (1024, 64, 512, 16, "short"),
    (40, 64, 128, 40, "balanced"),
    (3000, 64, 256, 64, "skewed"),
    (1000, 256, 261, 16, "skewed"),
    (513, 64, 7, 8, "short"),
    (1200, 64, 72, 7, "edges"),
]


def _id(case):
    return "x".join(map(str, case[:4])) + "-" + case[4]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose", [False, True], ids=["GKN", "GNK"])
@pytest.mark.parametrize("case", ROWS_CASES, ids=_id)
def test_ragged_rows_match_the_reference(hopper, case, transpose, dtype):
    m, k, n, groups, pattern = case
    lhs, rhs = operands(m, k, n, groups, dtype, transpose=transpose, seed=m + groups)
    sizes = sizes_of(pattern, m, groups, seed=m)
    out, aliased = run_into_poison(lambda a, b, s: ragged_rows(a, b, s, transpose_rhs=transpose), (m, n), dtype,
                                   lhs, rhs, sizes)
    ref, mag = rows_reference(lhs, rhs, sizes, transpose)
    assert_within_rounding(out, ref, mag, k)


@pytest.mark.parametrize("case", [(1000, 256, 264, 64, "skewed"), (1024, 64, 512, 16, "short")], ids=_id)
def test_ragged_rows_in_f32(hopper, case):
    m, k, n, groups, pattern = case
    lhs, rhs = operands(m, k, n, groups, jnp.bfloat16, seed=3)
    sizes = sizes_of(pattern, m, groups, seed=4)
    out, _ = run_into_poison(lambda a, b, s: ragged_rows(a, b, s, out_dtype=jnp.float32), (m, n), jnp.float32,
                             lhs, rhs, sizes)
    ref, mag = rows_reference(lhs, rhs, sizes)
    assert_within_rounding(out, ref, mag, k)


# (R rows, A, B, G, sizes): the contraction's output is [G, A, B]; A = 136 leaves the
# cluster's second tile mostly past A; empty groups give zeros; sizes short of R leave
# rows out; every group shorter than a K tile; group sizes around a warp's 16 rows, with
# C's rows (72) ending inside a warp's.
CONTRACT_CASES = [
    (2048, 256, 512, 8, "balanced"),
    (1000, 136, 264, 64, "skewed"),
    (513, 128, 128, 256, "sparse"),
    (300, 64, 64, 3, "short"),
    (200, 128, 256, 40, "balanced"),
    (1200, 72, 200, 7, "edges"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CONTRACT_CASES, ids=_id)
def test_ragged_contraction_matches_the_reference(hopper, case, dtype):
    rows, a, b, groups, pattern = case
    lhs, _ = operands(rows, a, 8, 1, dtype, seed=rows)
    rhs, _ = operands(rows, b, 8, 1, dtype, seed=rows + 1)
    sizes = sizes_of(pattern, rows, groups, seed=rows)
    out, _ = run_into_poison(ragged_contract, (groups, a, b), dtype, lhs, rhs, sizes)
    ref, mag = contract_reference(lhs, rhs, sizes)
    assert_within_rounding(out, ref, mag, rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose", [False, True], ids=["GKN", "GNK"])
def test_gradients_run_on_the_kernel(hopper, transpose, dtype):
    m, k, n, groups = 1000, 256, 264, 16
    lhs, rhs = operands(m, k, n, groups, dtype, transpose=transpose, seed=7)
    sizes = sizes_of("skewed", m, groups, seed=8)
    ct = jax.random.normal(jax.random.key(9), (m, n), jnp.float32).astype(dtype)
    dims = jax.lax.RaggedDotDimensionNumbers((([1], [2 if transpose else 1]), ([], [])), [0], [0])

    def f(lhs, rhs):
        with jax_hopper.dispatch("kernel"):
            return jax_hopper.ragged_dot_general(lhs, rhs, sizes, dims)

    out, vjp = jax.vjp(f, lhs, rhs)
    d_lhs, d_rhs = jax.jit(vjp)(ct)
    assert_gradients_within_rounding(d_lhs, d_rhs, lhs, rhs, ct, sizes, transpose)
    def forward_and_vjp(x, w, c):
        y, pullback = jax.vjp(f, x, w)
        return y, pullback(c)

    hlo = jax.jit(forward_and_vjp).lower(lhs, rhs, ct).compile().as_text()
    assert hlo.count('custom_call_target="jax_hopper_ragged_dot"') == 3, "forward, d lhs and d rhs on the kernel"


@pytest.mark.parametrize("pattern", ["balanced", "short"])
def test_vmap_over_lhs_on_the_kernel(hopper, pattern):
    """Entries folded into one launch: each entry's groups, then a gap group of zeros."""
    b, m, k, n, groups = 3, 700, 128, 264, 8
    lhs, rhs = operands(b * m, k, n, groups, jnp.bfloat16, seed=12)
    lhs = lhs.reshape(b, m, k)
    sizes = sizes_of(pattern, m, groups, seed=13)

    def f(x, w, s):
        return jax.vmap(lambda xi: ragged_rows(xi, w, s))(x)

    out, _ = run_into_poison(f, (b, m, n), jnp.bfloat16, lhs, rhs, sizes)
    for i in range(b):
        ref, mag = rows_reference(lhs[i], rhs, sizes)
        assert_within_rounding(out[i], ref, mag, k)
    hlo = jax.jit(f).lower(lhs, rhs, sizes).compile().as_text()
    assert hlo.count('custom_call_target="jax_hopper_ragged_dot"') == 1
