"""Grouped-product cases and their f64 reference, shared by the CPU and GPU tests.

The reference multiplies each group's rows by its own matrix in float64 (numpy), from
the same 16-bit inputs. A correct result, accumulated in f32 and rounded once, differs
from it per element by at most one unit in the last place of its type (at least the
spacing of its subnormals) plus the
worst-case f32 summation error K * u * sum|a||b| (u = 2^-24, K the terms summed):
anything past that is a wrong element.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

ULP = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23}
# The spacing of each type's subnormals: one ulp of a result that small (f16's sums of a
# few short rows land there).
SUBNORMAL_SPACING = {"float16": 2.0**-24, "bfloat16": 2.0**-133, "float32": 2.0**-149}
F32_UNIT_ROUNDOFF = 2.0**-24


def operands(m, k, n, groups, dtype, *, transpose=False, seed=0):
    """lhs [m, k] and rhs [groups, k, n] (transpose: [groups, n, k]) of unit-variance
    products, as the 16-bit type."""
    kl, kr = jax.random.split(jax.random.key(seed))
    lhs = (jax.random.normal(kl, (m, k), jnp.float32) / k**0.25).astype(dtype)
    shape = (groups, n, k) if transpose else (groups, k, n)
    rhs = (jax.random.normal(kr, shape, jnp.float32) / k**0.25).astype(dtype)
    return lhs, rhs


EDGE_SIZES = (0, 1, 15, 16, 17, 100, 1000)


def sizes_of(kind, m, groups, seed=0):
    """int32 group sizes of one pattern: "balanced" (m split evenly), "skewed" (one group
    takes most), "one" (every row in one group), "sparse" (every other group empty),
    "short" (the sizes sum to about 3/4 of m: the rest are zeros), "edges" (EDGE_SIZES in
    turn: an empty group, a single row, and sizes one short of, at and one past a warp's
    16 rows, then groups across tiles; m must hold their sum, the rest are zeros)."""
    rng = np.random.default_rng(seed)
    if kind == "balanced":
        sizes = np.full(groups, m // groups)
        sizes[: m % groups] += 1
    elif kind == "skewed":
        sizes = rng.multinomial(m // 4, np.ones(groups) / groups)
        sizes[rng.integers(groups)] += m - m // 4
    elif kind == "one":
        sizes = np.zeros(groups, np.int64)
        sizes[rng.integers(groups)] = m
    elif kind == "sparse":
        sizes = np.zeros(groups, np.int64)
        live = np.arange(0, groups, 2)
        sizes[live] = rng.multinomial(m, np.ones(len(live)) / len(live))
    elif kind == "short":
        sizes = rng.multinomial(3 * m // 4, np.ones(groups) / groups)
    elif kind == "edges":
        sizes = np.resize(EDGE_SIZES, groups)
        if sizes.sum() > m:
            raise ValueError(f"{groups} groups of EDGE_SIZES need {sizes.sum()} rows, m is {m}")
    else:
        raise ValueError(kind)
    return jnp.asarray(sizes, jnp.int32)


def _f64(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def rows_reference(lhs, rhs, sizes, transpose=False):
    """(ref, sum of |a||b|) of ragged_dot in float64; rows past the sizes are zeros."""
    a, b, s = _f64(lhs), _f64(rhs), np.asarray(sizes)
    if transpose:
        b = b.transpose(0, 2, 1)
    ref = np.zeros((a.shape[0], b.shape[2]))
    mag = np.zeros_like(ref)
    start = 0
    for g, size in enumerate(s):
        end = min(start + int(size), a.shape[0])
        ref[start:end] = a[start:end] @ b[g]
        mag[start:end] = np.abs(a[start:end]) @ np.abs(b[g])
        start = end
    return ref, mag


def contract_reference(lhs, rhs, sizes):
    """(ref, sum of |a||b|) of the ragged contraction [G, A, B] in float64."""
    a, b, s = _f64(lhs), _f64(rhs), np.asarray(sizes)
    ref = np.zeros((len(s), a.shape[1], b.shape[1]))
    mag = np.zeros_like(ref)
    start = 0
    for g, size in enumerate(s):
        end = min(start + int(size), a.shape[0])
        ref[g] = a[start:end].T @ b[start:end]
        mag[g] = np.abs(a[start:end]).T @ np.abs(b[start:end])
        start = end
    return ref, mag


def assert_within_rounding(out, ref, mag, terms):
    """Every element of `out` within one ulp of its type (or its subnormal spacing) plus terms * u * sum|a||b| of
    the float64 reference (and none NaN: a poisoned element left unwritten is NaN)."""
    o = _f64(out)
    assert o.shape == ref.shape, (o.shape, ref.shape)
    assert not np.isnan(o).any(), f"{np.isnan(o).sum()} NaN (unwritten) elements"
    name = jnp.dtype(out.dtype).name
    bound = (np.maximum(ULP[name] * np.abs(ref), SUBNORMAL_SPACING[name]) +
             max(terms, 1) * F32_UNIT_ROUNDOFF * mag)
    excess = np.abs(o - ref) - bound
    assert (excess <= 0).all(), f"{(excess > 0).sum()} of {excess.size} elements off by more than rounding; " \
                                f"worst excess {excess.max():.3e} at {np.unravel_index(excess.argmax(), excess.shape)}"


def assert_gradients_within_rounding(d_lhs, d_rhs, lhs, rhs, ct, sizes, transpose=False):
    """ragged_dot's gradients for cotangent ct: d lhs = ct against each group's rhs
    transposed, d rhs = each group's lhs^T ct (rhs [G, N, K]: transposed), each within
    rounding of the float64 reference."""
    rhs_gkn = jnp.swapaxes(rhs, 1, 2) if transpose else rhs
    ref, mag = rows_reference(ct, jnp.swapaxes(rhs_gkn, 1, 2), sizes)
    assert_within_rounding(d_lhs, ref, mag, ct.shape[1])
    ref, mag = contract_reference(lhs, ct, sizes)
    if transpose:
        ref, mag = ref.transpose(0, 2, 1), mag.transpose(0, 2, 1)
    assert_within_rounding(d_rhs, ref, mag, lhs.shape[0])
