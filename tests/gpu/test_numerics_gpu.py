"""GPU tests (Hopper only; skipped with a reason elsewhere): the kernel's answers.

Each case draws fresh random inputs (the seed's normal / K^(1/4) data, never zeros),
runs our kernel into a NaN-poisoned output buffer, and compares with an f32 reference
computed from the same rounded inputs.

Tolerance: both our kernel and jnp.dot (cuBLASLt) multiply the same 16-bit inputs
exactly and accumulate in f32, so their errors are dominated by the final rounding to
f16/bf16 (relative 2^-11 / 2^-8 per element) plus f32 summation-order noise far below
that. Their relative errors must therefore be nearly equal; 1.5x jnp.dot's own error
leaves room only for a different summation order, not for a wrong element or a lost
K tile (which would show up as errors of order 1 / sqrt(K) or larger).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import f32_reference, relative_error, require_compiled, run_into_poison, run_into_poisons, seed_normal

import jax_hopper

ERROR_FACTOR = 1.5
SHAPES = [
    (8192, 8192, 8192),
    (4096, 4096, 4096),
    (1000, 3000, 520),  # partial tiles in M and N, K not a multiple of 64
    (129, 257, 72),  # one row / one column past a tile; K tail of 8
    (1, 256, 64),  # M = 1
    (1, 4096, 4096),
    (3000, 1, 256),  # N = 1 (padded row of B)
    (300, 200, 40),  # K < 64
    (64, 64, 8),  # K = 8: a single wgmma's worth, mostly zero-filled tile
    (64, 64, 1),  # K = 1: A zero-padded to one TMA row, B's one K row read with zero fill past it
    (1, 1, 1),
    (100, 101, 103),  # rows TMA cannot describe: padded to 16 bytes
    (300, 256, 100),  # K rows unaligned, N aligned: only A is padded, B's K tail read as TMA zero fill
    (8191, 8191, 8191),
    (256, 512, 4096 + 64 * 3),  # many K tiles: the ring wraps many times, odd count
]
DTYPES = [jnp.float16, jnp.bfloat16]


def _inputs(m, n, k, dtype, seed):
    ka, kb = jax.random.split(jax.random.key(seed))
    return seed_normal(ka, (m, k), dtype, k), seed_normal(kb, (k, n), dtype, k)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_f32_reference_like_jnp_dot(hopper, shape, dtype):
    m, n, k = shape
    a, b = _inputs(m, n, k, dtype, seed=hash((m, n, k)) % 2**31)
    out, _ = run_into_poison(jax_hopper.matmul, (m, n), dtype, a, b)
    assert out.shape == (m, n) and out.dtype == dtype
    assert not bool(jnp.isnan(out).any()), "unwritten (still poisoned) or NaN elements"
    ref = f32_reference(a, b)
    err = relative_error(out, ref)
    err_jnp = relative_error(jnp.dot(a, b), ref)
    assert err <= ERROR_FACTOR * err_jnp, f"relative error {err:.3e} vs jnp.dot {err_jnp:.3e}"


def test_output_is_written_into_the_poisoned_buffer(hopper):
    # The poisoning above only proves something if the kernel writes the NaN buffer.
    a, b = _inputs(256, 512, 128, jnp.float16, seed=1)
    out, aliased = run_into_poison(jax_hopper.matmul, (256, 512), jnp.float16, a, b)
    assert aliased, "XLA did not alias the donated NaN buffer to the output"
    assert not bool(jnp.isnan(out).any())


# Every selectable kernel besides the default: the seed's V5 at its depths, the small-M
# kind, and the default's ablations and experiments (those where the build has them:
# jax_hopper/_kernels.py marks them experimental).
SELECTABLE = [("v5", 2, jnp.float16), ("v5", 3, jnp.float16), ("v5", 4, jnp.float16), ("v5", 4, jnp.bfloat16),
              ("persistent_basic", 4, jnp.float16), ("persistent_tma", 4, jnp.float16),
              ("persistent_wait0", 4, jnp.float16), ("persistent_immediate", 4, jnp.float16),
              ("persistent_static", 4, jnp.float16),
              ("persistent_streamk", 4, jnp.float16),
              ("small_m", 4, jnp.float16), ("small_m", 4, jnp.bfloat16),
              ("persistent_pingpong", 6, jnp.float16)]  # experimental


@pytest.mark.parametrize("kernel,stages,dtype", SELECTABLE, ids=lambda x: getattr(x, "__name__", str(x)))
@pytest.mark.parametrize("shape", [(1000, 3000, 4160), (8192, 8192, 8192), (129, 257, 72), (100, 101, 103)],
                         ids=lambda s: "x".join(map(str, s)))
def test_selectable_kernels_are_correct(hopper, kernel, stages, dtype, shape):
    from jax_hopper.primitives.gemm import gemm

    require_compiled(kernel, dtype, stages)
    m, n, k = shape
    a, b = _inputs(m, n, k, dtype, seed=stages)
    out, _ = run_into_poison(lambda x, y: gemm(x, y, kernel=kernel, stages=stages), (m, n), dtype, a, b)
    assert not bool(jnp.isnan(out).any())
    ref = f32_reference(a, b)
    assert relative_error(out, ref) <= ERROR_FACTOR * relative_error(jnp.dot(a, b), ref)


# The deferred store (config.cuh: kDeferredStore) stages tile i's sub-tile s during tile
# i + 1's K tile s and the rest after its mainloop: one K tile (three sub-tiles left
# over), three, many; a tile whose second warpgroup has no rows between pending ones
# (4160 = 32.5 tiles of 128 rows); M = 300, whose last M tile leaves the second
# warpgroup past M, so only the flush before the pass and after the last tile run
# there; several tiles per CTA at 8192x8192x64 and 4160x4096x192, one or few in the
# others, and a batch. Beside the Frobenius bound, an
# elementwise one: a sub-tile staged from the wrong registers or stored at the wrong
# place gives errors of the output's own size (|ref| ~ 1 here), far beyond rounding
# (half an ulp of |ref|: 2^-11 f16, 2^-8 bf16) plus f32 summation noise.
DEFERRED_STORE_SHAPES = [(8192, 8192, 64), (4160, 4096, 192), (300, 8704, 200), (2048, 4096, 520),
                         (3, 1000, 2000, 136)]


@pytest.mark.parametrize("kernel,dtype", [("persistent", jnp.float16), ("persistent", jnp.bfloat16),
                                          ("persistent_immediate", jnp.float16),  # the ablation: f16 only
                                          ("persistent_static", jnp.float16)],
                         ids=lambda x: getattr(x, "__name__", str(x)))
@pytest.mark.parametrize("shape", DEFERRED_STORE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_deferred_store_edges(hopper, shape, kernel, dtype):
    from jax_hopper.primitives.gemm import gemm

    require_compiled(kernel, dtype)
    *lead, m, n, k = shape
    ka, kb = jax.random.split(jax.random.key(m + n + k))
    a, b = seed_normal(ka, (*lead, m, k), dtype, k), seed_normal(kb, (*lead, k, n), dtype, k)
    out, _ = run_into_poison(lambda x, y: gemm(x, y, kernel=kernel), (*lead, m, n), dtype, a, b)
    _assert_every_element_within_an_ulp(out, a, b, dtype)


def _assert_every_element_within_an_ulp(out, a, b_kn, dtype):
    """Frobenius bound as above, and per element one ulp of the reference's value plus
    1e-3 of f32 summation noise (|ref| ~ 1 for the seed's data)."""
    assert not bool(jnp.isnan(out).any())
    ref = jnp.matmul(a.astype(jnp.float32), b_kn.astype(jnp.float32), precision="highest")
    assert relative_error(out, ref) <= ERROR_FACTOR * relative_error(jnp.matmul(a, b_kn), ref)
    ulp = 2.0 ** -(10 if dtype == jnp.float16 else 7)
    worst = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref) - ulp * jnp.abs(ref)))
    assert worst <= 1e-3, f"an element is off by {worst:.3e} beyond an ulp of its value"


# C rows TMA cannot store (a row of ldc 16-bit elements not a multiple of 16 bytes): the
# deferred store copies each staged sub-tile out with the warpgroup's own stores
# (epilogue/deferred_store.cuh: copy_out), one 4-byte pair per lane where the pair is aligned in C
# (every other row of an odd N), two 2-byte halves elsewhere, masked at N and M. Odd N
# with several tiles per CTA and one K tile (the flush stores three of four sub-tiles);
# N ending inside a sub-tile on either half of a pair (1001: the last lane's pair is
# half inside; 8199); N below one tile (70); N = 4 and 2 mod 8 (pairs always aligned),
# the latter batched; M = 300, whose last tile has the second warpgroup past M and the
# first's last warp partly past it; B stored K-major ([N, K], x @ w.T). The ablation
# without the deferred store keeps the registers store, for comparison. Same bounds as
# test_deferred_store_edges.
UNALIGNED_C_SHAPES = [(8192, 8191, 64), (300, 8199, 200), (4160, 1001, 520), (129, 70, 72), (2050, 4100, 192),
                      (3, 1000, 2002, 136)]


# B [N, K] only for the default kind: the ablations are compiled for B [K, N] alone.
UNALIGNED_C_KERNELS = [("persistent", jnp.float16, False), ("persistent", jnp.bfloat16, False),
                       ("persistent", jnp.float16, True), ("persistent", jnp.bfloat16, True),
                       ("persistent_static", jnp.float16, False), ("persistent_wait0", jnp.float16, False),
                       ("persistent_immediate", jnp.float16, False)]


@pytest.mark.parametrize("kernel,dtype,transpose_b", UNALIGNED_C_KERNELS,
                         ids=lambda x: {True: "b_nk", False: "b_kn"}.get(x) if isinstance(x, bool)
                         else getattr(x, "__name__", str(x)))
@pytest.mark.parametrize("shape", UNALIGNED_C_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_output_rows_tma_cannot_store(hopper, shape, kernel, dtype, transpose_b):
    from jax_hopper.primitives.gemm import gemm

    require_compiled(kernel, dtype)
    *lead, m, n, k = shape
    ka, kb = jax.random.split(jax.random.key(m * n + k))
    a = seed_normal(ka, (*lead, m, k), dtype, k)
    b = seed_normal(kb, (*lead, n, k) if transpose_b else (*lead, k, n), dtype, k)
    out, _ = run_into_poison(lambda x, y: gemm(x, y, transpose_b=transpose_b, kernel=kernel), (*lead, m, n), dtype,
                             a, b)
    _assert_every_element_within_an_ulp(out, a, jnp.swapaxes(b, -1, -2) if transpose_b else b, dtype)


def test_dynamic_tiles_every_call(hopper):
    # The default kernel's dynamic order hands out tiles by ticket from a counter each
    # call zeroes in its own scratch memory. Three products back to back in one program
    # (2048x4096: 256 tiles, 128 cluster tiles for 66 clusters, so most are ticketed): a
    # counter not zeroed would start where the previous call's ended (128) if XLA gives
    # this call the same scratch, skip tiles and leave NaN poison. (If XLA handed out
    # fresh zeroed memory instead, the test could not see a missing memset.)
    from jax_hopper.primitives.gemm import gemm

    m, n, k = 2048, 4096, 256
    keys = jax.random.split(jax.random.key(7), 6)
    xs = [seed_normal(keys[2 * i], (m, k), jnp.float16, k) for i in range(3)]
    ws = [seed_normal(keys[2 * i + 1], (k, n), jnp.float16, k) for i in range(3)]
    # (Aliasing is not asserted: XLA may pair the three same-shaped NaN buffers with the
    # outputs in another order, which the helper's in-order check would call a failure.)
    outs, _ = run_into_poisons(
        lambda *ops: tuple(gemm(ops[2 * i], ops[2 * i + 1]) for i in range(3)),
        [(m, n)] * 3, jnp.float16, *[t for pair in zip(xs, ws) for t in pair])
    for out, x, w in zip(outs, xs, ws):
        assert not bool(jnp.isnan(out).any())
        ref = jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")
        assert relative_error(out, ref) <= ERROR_FACTOR * relative_error(jnp.matmul(x, w), ref)


@pytest.mark.parametrize("shape", [(8192, 8192, 64), (4160, 4096, 256), (4096, 4096, 4096)],
                         ids=lambda s: "x".join(map(str, s)))
def test_pingpong_turns_with_one_k_tile_and_tiles_past_m(hopper, shape):
    # The experimental ping-pong kind hands the tensor cores from one warpgroup to the
    # other per tile: one K tile per unit (no wgmma wait to keep a warpgroup's warps
    # together), and an odd number of 128-row tiles (the last cluster's second CTA has
    # its units past M, passed through without MMAs) amid many units per CTA.
    from jax_hopper.primitives.gemm import gemm

    require_compiled("persistent_pingpong")

    m, n, k = shape
    a, b = _inputs(m, n, k, jnp.float16, seed=11)
    out, _ = run_into_poison(lambda x, y: gemm(x, y, kernel="persistent_pingpong"), (m, n), jnp.float16, a, b)
    assert not bool(jnp.isnan(out).any())
    ref = f32_reference(a, b)
    assert relative_error(out, ref) <= ERROR_FACTOR * relative_error(jnp.dot(a, b), ref)


def test_compiled_hlo_runs_our_kernel_not_cublas(hopper):
    a, b = _inputs(512, 512, 512, jnp.float16, seed=2)
    hlo = jax.jit(jax_hopper.matmul).lower(a, b).compile().as_text()
    assert 'custom_call_target="jax_hopper_gemm"' in hlo
    assert "__cublas" not in hlo


def test_empty_sum_and_empty_output_match_jnp_dot(hopper):
    a = jnp.ones((64, 0), jnp.float16)
    b = jnp.ones((0, 128), jnp.float16)
    out, _ = run_into_poison(jax_hopper.matmul, (64, 128), jnp.float16, a, b)
    np.testing.assert_array_equal(np.asarray(out), np.zeros((64, 128), np.float16))
    assert jax.jit(jax_hopper.matmul)(jnp.ones((0, 16), jnp.float16), jnp.ones((16, 32), jnp.float16)).shape == (0, 32)


def test_repeated_calls_are_bitwise_identical(hopper):
    a, b = _inputs(1000, 3000, 520, jnp.bfloat16, seed=3)
    f = jax.jit(jax_hopper.matmul)
    first = np.asarray(f(a, b).astype(jnp.float32))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(a, b).astype(jnp.float32)), first)


def test_eager_call_runs_the_kernel(hopper):
    a, b = _inputs(129, 257, 72, jnp.float16, seed=4)
    ref = f32_reference(a, b)
    assert relative_error(jax_hopper.matmul(a, b), ref) <= ERROR_FACTOR * relative_error(jnp.dot(a, b), ref)


LAYOUT_DIMS = {  # stored A, stored B, dimension numbers
    "NT": (lambda m, n, k: ((m, k), (n, k)), (((1,), (1,)), ((), ()))),
    "TN": (lambda m, n, k: ((k, m), (k, n)), (((0,), (0,)), ((), ()))),
    "TT": (lambda m, n, k: ((k, m), (n, k)), (((0,), (1,)), ((), ()))),
}


@pytest.mark.parametrize("layout", LAYOUT_DIMS)
@pytest.mark.parametrize("shape", [(4096, 4096, 4096), (1000, 3000, 520), (129, 257, 72), (100, 101, 103)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
def test_transposed_layouts_match_f32_reference(hopper, layout, shape, dtype):
    m, n, k = shape
    shapes, dims = LAYOUT_DIMS[layout]
    a_shape, b_shape = shapes(m, n, k)
    ka, kb = jax.random.split(jax.random.key(m + n + k))
    a, b = seed_normal(ka, a_shape, dtype, k), seed_normal(kb, b_shape, dtype, k)
    f = lambda x, y: jax_hopper.dot_general(x, y, dims)  # noqa: E731
    out, _ = run_into_poison(f, (m, n), dtype, a, b)
    assert not bool(jnp.isnan(out).any())
    ref = jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dims, precision="highest")
    err, err_jnp = relative_error(out, ref), relative_error(jax.lax.dot_general(a, b, dims), ref)
    assert err <= ERROR_FACTOR * err_jnp, f"{err:.3e} vs {err_jnp:.3e}"


@pytest.mark.parametrize("k", [520, 517], ids=["k520", "k517"])  # 517: B's K tail per batch entry is zero fill
@pytest.mark.parametrize("out_dtype", [None, jnp.float32], ids=["out16", "out32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
def test_batched_and_f32_output_match_f32_reference(hopper, dtype, out_dtype, k):
    bsz, m, n = 5, 1000, 600
    ka, kb = jax.random.split(jax.random.key(11))
    a, b = seed_normal(ka, (bsz, m, k), dtype, k), seed_normal(kb, (bsz, k, n), dtype, k)
    f = lambda x, y: jax_hopper.matmul(x, y, preferred_element_type=out_dtype)  # noqa: E731
    expect_dtype = out_dtype or dtype
    out, _ = run_into_poison(f, (bsz, m, n), expect_dtype, a, b)
    assert out.dtype == expect_dtype and not bool(jnp.isnan(out).any())
    ref = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32), precision="highest")
    err = relative_error(out, ref)
    err_jnp = relative_error(jnp.matmul(a, b, preferred_element_type=out_dtype), ref)
    if out_dtype is None:
        assert err <= ERROR_FACTOR * err_jnp, f"{err:.3e} vs {err_jnp:.3e}"
    else:
        # f32 output: no final rounding, so both errors are pure f32 summation noise
        # (~sqrt(K) * 2^-24); allow an order-of-magnitude band around that, not 1.5x of it.
        assert err <= max(ERROR_FACTOR * err_jnp, 1e-5), f"{err:.3e} vs {err_jnp:.3e}"


@pytest.mark.parametrize("batch", [(2, 3), (2, 1, 3)], ids=["b2x3", "b2x1x3"])
@pytest.mark.parametrize("transpose_b", [False, True], ids=["nn", "nt"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
def test_several_batch_dims_fold_in_the_handler(hopper, dtype, transpose_b, batch):
    """Attention-like products with several batch dims ([batch, heads, S, D]): the custom
    call gets them as they are (each keeps its own sharding) and the FFI handler folds
    them into one. M = 77 and N = 136 leave partial tiles per batch entry, K = 70 is
    padded on the way in. Same error rule as the 2-D products."""
    m, n, k = 77, 136, 70
    nb = len(batch)
    ka, kb = jax.random.split(jax.random.key(13))
    a = seed_normal(ka, batch + (m, k), dtype, k)
    b = seed_normal(kb, batch + ((n, k) if transpose_b else (k, n)), dtype, k)
    dims = (((nb + 1,), (nb + 1 if transpose_b else nb,)), (tuple(range(nb)), tuple(range(nb))))
    f = lambda x, y: jax_hopper.dot_general(x, y, dims)  # noqa: E731
    out, _ = run_into_poison(f, batch + (m, n), dtype, a, b)
    assert not bool(jnp.isnan(out).any())
    ref = jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dims, precision="highest")
    err, err_jnp = relative_error(out, ref), relative_error(jax.lax.dot_general(a, b, dims), ref)
    assert err <= ERROR_FACTOR * err_jnp, f"{err:.3e} vs {err_jnp:.3e}"
    # vmap over such a product adds one more batch dim in front, not a fold.
    outs = jax.jit(jax.vmap(f))(jnp.stack([a, a]), jnp.stack([b, b]))
    assert all(relative_error(o, ref) <= ERROR_FACTOR * err_jnp for o in outs)


@pytest.mark.parametrize("transpose_b", [False, True], ids=["nn", "nt"])
@pytest.mark.parametrize("out_dtype", [None, jnp.float32], ids=["out16", "out32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
def test_leading_dims_of_a_fold_into_m_in_the_handler(hopper, dtype, out_dtype, transpose_b):
    """x [2, 3, M, K] @ W: the custom call gets x and C with their leading dims (the FFI
    handler folds them into M); K = 70 is padded on the way in (an N-D pad), M = 37 leaves
    a partial tile per fold. Same error rule as the 2-D products."""
    lead, m, n, k = (2, 3), 37, 136, 70
    ka, kb = jax.random.split(jax.random.key(12))
    x = seed_normal(ka, lead + (m, k), dtype, k)
    w = seed_normal(kb, (n, k) if transpose_b else (k, n), dtype, k)
    dn = (((x.ndim - 1,), (1 if transpose_b else 0,)), ((), ()))
    f = lambda x, w: jax_hopper.dot_general(x, w, dn, preferred_element_type=out_dtype)  # noqa: E731
    expect_dtype = out_dtype or dtype
    out, _ = run_into_poison(f, lead + (m, n), expect_dtype, x, w)
    assert out.dtype == expect_dtype and not bool(jnp.isnan(out).any())
    ref = jax.lax.dot_general(x.astype(jnp.float32), w.astype(jnp.float32), dn, precision="highest")
    err = relative_error(out, ref)
    err_jnp = relative_error(jax.lax.dot_general(x, w, dn, preferred_element_type=out_dtype), ref)
    # f32 output: both errors are f32 summation noise; see the batched test's band.
    assert err <= max(ERROR_FACTOR * err_jnp, 1e-5 if out_dtype else 0.0), f"{err:.3e} vs {err_jnp:.3e}"


@pytest.mark.parametrize("shape", [(8192, 8192, 8192), (1000, 3000, 4160), (256, 8192, 8192), (16, 8192, 8192),
                                   (100, 3000, 4160)], ids=lambda s: "x".join(map(str, s)))
def test_stream_k_tail_is_correct_and_deterministic(hopper, shape):
    """The experimental stream-K kind splits the last wave's K iterations over all
    clusters and sums the partial accumulators in a fixed order: right, and bitwise the
    same on every call (8192^3: 1024 cluster tiles on 66 clusters leave a tail of 34)."""
    from jax_hopper.primitives.gemm import gemm

    require_compiled("persistent_streamk")

    m, n, k = shape
    a, b = _inputs(m, n, k, jnp.float16, seed=7)
    f = jax.jit(lambda x, y: gemm(x, y, kernel="persistent_streamk"))
    out, _ = run_into_poison(f, (m, n), jnp.float16, a, b)
    assert not bool(jnp.isnan(out).any())
    ref = f32_reference(a, b)
    assert relative_error(out, ref) <= ERROR_FACTOR * relative_error(jnp.dot(a, b), ref)
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(a, b)), np.asarray(out))


def test_stream_k_really_splits_the_tail(hopper):
    """Split, a tail tile's K range is summed in pieces and added up by the finisher: a
    different f32 summation order from the default kernel's, which some of 256 x 8192
    outputs must show in their last bit. (Until the workspace alignment fix, XLA gave no
    workspace and the kind quietly ran whole tiles: the default kernel's exact bits.)"""
    from jax_hopper.primitives.gemm import gemm

    require_compiled("persistent_streamk")

    a, b = _inputs(256, 8192, 8192, jnp.float16, seed=8)  # 32 tiles on 66 clusters: all tail
    split = np.asarray(jax.jit(lambda x, y: gemm(x, y, kernel="persistent_streamk"))(a, b))
    whole = np.asarray(jax.jit(lambda x, y: gemm(x, y, kernel="persistent"))(a, b))
    assert not np.array_equal(split, whole), "stream-K gave the default kernel's bits: the tail was not split"


@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("shape", [(1, 8192, 8192), (16, 8192, 8192), (40, 8192, 8192), (64, 8192, 8192),
                                   (100, 8192, 8192), (128, 4096, 14336), (16, 256, 8192), (16, 1000, 520),
                                   (17, 14336, 4096), (3, 100, 103), (16, 4096, 4096), (16, 1024, 1024),
                                   (16, 4992, 4096), (16, 5760, 4096), (16, 4097, 4096),
                                   (128, 4096, 4095), (96, 6144, 8191), (256, 4096, 4095), (192, 8192, 8191),
                                   (300, 2048, 8191), (1000, 1536, 4095), (1280, 1280, 4095), (2048, 1024, 4095)],
                         ids=lambda s: "x".join(map(str, s)))
def test_small_m_kind_is_correct_and_deterministic(hopper, shape, dtype):
    """The decode kind splits every tile's K range into pieces, one CTA each, summed in
    piece order, in a cluster of the tile's pieces, each piece summing its share of the
    tile's columns (on an H200: 3 at N = K = 8192, 2 at 100x8192x8192, 8 at 16x1024x1024,
    7 at 16x4096x4096, 6 at 16x4992x4096 and at 16x4097x4096, whose odd N the pieces
    store element by element, 5 at 16x5760x4096) or by the last piece to
    finish through global memory (two tiles cut into 64 pieces at 16x256x8192): right
    (rows past M, warps holding none of them, partial N and K tiles, no split at
    3x100x103; an odd K over 96-2048 rows, as "auto" sends here while its tiles fit one
    wave; 1000 rows end in a partial tile), and bitwise the same on every call."""
    from jax_hopper.primitives.gemm import gemm

    m, n, k = shape
    a, b = _inputs(m, n, k, dtype, seed=11)
    f = jax.jit(lambda x, y: gemm(x, y, kernel="small_m"))
    out, _ = run_into_poison(f, (m, n), dtype, a, b)
    assert not bool(jnp.isnan(out).any())
    ref = f32_reference(a, b)
    assert relative_error(out, ref) <= ERROR_FACTOR * relative_error(jnp.dot(a, b), ref)
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(a, b)), np.asarray(out))
    f32_out = jax.jit(lambda x, y: gemm(x, y, kernel="small_m", out_dtype=jnp.float32))(a, b)
    # f32 output: no final rounding, both errors are f32 summation noise (as in
    # test_batched_and_f32_output_match_f32_reference).
    err_jnp = relative_error(jnp.dot(a, b, preferred_element_type=jnp.float32), ref)
    assert relative_error(f32_out, ref) <= max(ERROR_FACTOR * err_jnp, 1e-5)


@pytest.mark.parametrize("out_dtype", [jnp.float16, jnp.float32], ids=["f16", "f32"])
@pytest.mark.parametrize("shape", [(5, 1000, 4160), (13, 8192, 8192)], ids=lambda s: "x".join(map(str, s)))
def test_small_m_rows_past_the_a_box_stay_out_of_the_result(hopper, shape, out_dtype):
    """The small-M kind loads only A's rows up to M, rounded up to 8 (config.cuh:
    a_box_rows), into its 64-row stages; the stages' other rows keep whatever an earlier
    kernel left in shared memory, and wgmma multiplies them into accumulator rows past M,
    which must never be stored or summed into other rows. The ring is first filled with
    NaN (the same kind on a 64-row A of NaN, on every SM), then M = 5 (an 8-row box, pieces
    summed through global memory) and M = 13 (16 rows, pieces in clusters) run: no NaN may
    reach the result, which must match the f32 reference. (Shared memory is not cleared
    between kernels, so the stale rows are NaN here; were they not, the test would still
    pass with a correct kernel and could only miss a bug.)"""
    from jax_hopper.primitives.gemm import gemm

    m, n, k = shape
    a, b = _inputs(m, n, k, jnp.float16, seed=13)
    ref = f32_reference(a, b)
    err_jnp = relative_error(jnp.dot(a, b, preferred_element_type=out_dtype), ref)
    # 33 tiles of 64x128 in 8 pieces: 264 CTAs, every CTA slot of an H200 (2 per SM).
    nan_a, ones = jnp.full((64, 4096), jnp.nan, jnp.float16), jnp.ones((4096, 33 * 128), jnp.float16)
    fill = jax.jit(lambda x, y: gemm(x, y, kernel="small_m"))
    f = jax.jit(lambda x, y: gemm(x, y, kernel="small_m", out_dtype=out_dtype))
    jax.block_until_ready((f(a, b), fill(nan_a, ones)))  # compiled before the ring is filled
    filled = fill(nan_a, ones)
    out, _ = run_into_poison(f, (m, n), out_dtype, a, b)
    assert bool(jnp.isnan(filled).all()), "the NaN fill did not run"
    assert not bool(jnp.isnan(out).any())
    assert relative_error(out, ref) <= max(ERROR_FACTOR * err_jnp, 1e-5)


def test_small_m_kind_really_splits_k(hopper):
    """At 16 x 8192 x 8192 (64 tiles of 64x128, four pieces each) every tile's K range is
    cut into pieces: the f32 sums come out in a different order from the default
    kernel's, which some outputs must show in their last bit."""
    from jax_hopper.primitives.gemm import gemm

    a, b = _inputs(16, 8192, 8192, jnp.float16, seed=12)
    split = np.asarray(jax.jit(lambda x, y: gemm(x, y, kernel="small_m", out_dtype=jnp.float32))(a, b))
    whole = np.asarray(jax.jit(lambda x, y: gemm(x, y, kernel="persistent", out_dtype=jnp.float32))(a, b))
    assert not np.array_equal(split, whole), "the small-M kind gave the default kernel's bits: K was not split"
