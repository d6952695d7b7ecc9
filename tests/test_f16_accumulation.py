"""The opt-in f16-accumulating kernel (accumulation="f16"): its API on any machine, its
answers on a Hopper GPU.

What the answers are held to (GPU tests). The kernel adds one wgmma's 16 products at a
time into an f16 accumulator. Emulated here step by step -- the 16-product partial sum
in f32, added to the f16 accumulator and rounded to nearest f16 -- this model gave the
same relative error as the H200 measured with the benchmark's data to within 1% (K =
1024: 1.18e-3, 4096: 2.35e-3, 8192: 3.31e-3 vs 1.18e-3, 2.35e-3, 3.32e-3;
docs/numerics.md), while rounding toward zero would give 10-30x more. So:
  - every element lies within twice 2^-10 * sum over steps of |partial sum| of the f32
    reference (one f16 unit roundoff per accumulator update, whichever the rounding;
    twice for the perturbed partial sums and the unspecified in-step sum);
  - the relative error is at most 1.25x the emulation's (room for its double rounding
    in f32 then f16, not for a lost K step, which adds ~sqrt(16 / K) relative: 25x
    the whole f16-accumulation error at K = 4096);
  - from K = 512 on, it is at least half the emulation's: the sums really are f16.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import f32_reference, hopper_devices, relative_error, run_into_poison, seed_normal

import jax_hopper
from jax_hopper import _dispatch
from jax_hopper._primitive import KERNELS

F16_UNIT_ROUNDOFF_ANY_ROUNDING = 2.0**-10
F16_ULP = 2.0**-10  # relative: one rounding of an f32 sum to f16 is within half of it
MMA_K = 16
BOUND_SLACK = 2.0
MODEL_FACTOR = 1.25
MANY_STEPS_K = 512
ABS_FLOOR = 1e-6  # f32 noise of the reference itself


def _inputs(a_shape, b_shape, k, seed):
    ka, kb = jax.random.split(jax.random.key(seed))
    return seed_normal(ka, a_shape, jnp.float16, k), seed_normal(kb, b_shape, jnp.float16, k)


# ---- API (any machine) -----------------------------------------------------------------

def test_bf16_operands_are_refused():
    a = jnp.ones((64, 64), jnp.bfloat16)
    with pytest.raises(TypeError, match="two f16"):
        jax_hopper.matmul(a, a, accumulation="f16")


def test_unknown_accumulation_and_high_precision_are_refused():
    a = jnp.ones((64, 64), jnp.float16)
    with pytest.raises(ValueError, match="accumulation must be one of"):
        jax_hopper.matmul(a, a, accumulation="f8")
    with pytest.raises(ValueError, match="does not meet precision"):
        jax_hopper.dot(a, a, accumulation="f16", precision="highest")


DIMS = (((1,), (0,)), ((), ()))


def _path(m, n, k, policy="auto", accumulation="f16"):
    a, b = jax.ShapeDtypeStruct((m, k), jnp.float16), jax.ShapeDtypeStruct((k, n), jnp.float16)
    with jax_hopper.dispatch(policy):
        return jax_hopper.dispatch_path(a, b, DIMS, accumulation=accumulation)


# Shapes measured on the H200 (docs/results/evidence/f16acc_sweep_b966fdd.json and
# bench_b966fdd.json): where the f16-accumulating kernel beat
# cuBLASLt, and where it did not.
F16_FASTER = [(8192, 8192, 8192), (4096, 4096, 4096), (8192, 16384, 4096), (16384, 16384, 16384),
              (4096, 14336, 4096), (4096, 4096, 14336)]
F16_SLOWER = [(6144, 6144, 6144), (3000, 5000, 7000), (8192, 8192, 1024), (2048, 2048, 2048), (256, 8192, 8192)]


@pytest.mark.parametrize("shape", F16_FASTER, ids=lambda s: "x".join(map(str, s)))
def test_auto_runs_f16_accumulation_where_it_was_measured_faster(shape):
    m, n, k = shape
    # Aligned f32-accumulating products go to cuBLASLt, except the wide ones (M, N >= 16384).
    wide = min(m, n) >= _dispatch.WIDE_MIN_MN and k >= _dispatch.WIDE_MIN_K
    assert _path(*shape, accumulation="f32") == (("kernel", "wide-aligned") if wide else ("xla", "default"))
    assert _path(*shape) == ("kernel", "f16-accumulation")


@pytest.mark.parametrize("shape", F16_SLOWER, ids=lambda s: "x".join(map(str, s)))
def test_auto_keeps_the_f32_path_where_f16_accumulation_was_slower(shape):
    assert _path(*shape) == _path(*shape, accumulation="f32") == ("xla", "default")


def test_auto_keeps_unmeasured_kinds_of_product_on_the_f32_path():
    # Measured: unbatched, aligned rows, f16 out. 8191^3 (unaligned) goes to the table's
    # unaligned-rows rule (our f32 kernel), a batched product to the table's default.
    assert _path(8191, 8191, 8191) == ("kernel", "unaligned-rows")
    a = jax.ShapeDtypeStruct((2, 8192, 8192), jnp.float16)
    with jax_hopper.dispatch("auto"):
        assert jax_hopper.dispatch_path(a, a, (((2,), (1,)), ((0,), (0,))), accumulation="f16") == ("xla", "default")


def test_wider_output_and_default_precision_spellings():
    a = jnp.ones((64, 64), jnp.float16)
    with pytest.raises(ValueError, match="asks for wider ones"):
        jax_hopper.matmul(a, a, accumulation="f16", preferred_element_type=jnp.float32)
    for precision in ("fastest", ("default", "bfloat16"), jax.lax.Precision.DEFAULT):
        assert jax_hopper.matmul(a, a, accumulation="f16", precision=precision).dtype == jnp.float16
    with pytest.raises(ValueError, match="accumulation must be one of"):
        jax_hopper.matmul(a, a, accumulation="f8", out_sharding=None)


def test_policies_kernel_and_xla_decide_alone():
    assert _path(2048, 2048, 2048, policy="kernel") == ("kernel", "policy=kernel")
    assert _path(8192, 8192, 8192, policy="xla") == ("xla", "policy=xla")


def test_unaligned_rows_keep_the_table_rule_and_lower_to_the_f32_kernel():
    # 3000 x 5000 x 7001: not f16-faster (a dimension < 4096), rows not 16-byte
    # aligned -> the table's unaligned-rows rule, our f32-accumulating kernel.
    assert _path(3000, 5000, 7001) == ("kernel", "unaligned-rows")
    a = jax.ShapeDtypeStruct((3000, 7001), jnp.float16)
    b = jax.ShapeDtypeStruct((7001, 5000), jnp.float16)
    with jax_hopper.dispatch("auto"):
        text = (jax.jit(lambda x, y: jax_hopper.matmul(x, y, accumulation="f16")).trace(a, b)
                .lower(lowering_platforms=("cuda",)).as_text())
    call = re.search(r"stablehlo\.custom_call @jax_hopper_gemm\(.*", text).group(0)
    assert re.search(rf"kernel = {KERNELS['persistent']} : i32", call), call


def test_cuda_lowering_calls_the_f16_accumulating_instance():
    a = jax.ShapeDtypeStruct((512, 256), jnp.float16)
    b = jax.ShapeDtypeStruct((256, 384), jnp.float16)
    text = (jax.jit(lambda x, y: jax_hopper.matmul(x, y, accumulation="f16")).trace(a, b)
            .lower(lowering_platforms=("cuda",)).as_text())
    call = re.search(r"stablehlo\.custom_call @jax_hopper_gemm\(.*", text).group(0)
    assert re.search(rf"kernel = {KERNELS['persistent_f16acc']} : i32", call), call
    assert re.search(r"stages = 3 : i32", call), call


def test_fallback_answers_with_f32_sums():
    # Without a Hopper GPU the product is XLA's (f32 sums, one rounding to f16): the
    # f16 opt-in never makes the fallback less accurate.
    if hopper_devices():
        pytest.skip("a Hopper GPU runs the f16-accumulating kernel here, not the fallback")
    a, b = _inputs((96, 80), (80, 72), 80, seed=5)
    out = jax_hopper.matmul(a, b, accumulation="f16")
    assert out.dtype == jnp.float16
    assert relative_error(out, f32_reference(a, b)) <= F16_ULP


# ---- answers (Hopper GPU) --------------------------------------------------------------

def _canonical(a, b, dims):
    """a as [..., M, K] and b as [..., K, N] (batch dims, if any, lead in both)."""
    (ca, cb), (ba, _) = dims
    if not ba and ca[0] == 0:
        a = a.T
    if not ba and cb[0] == 1:
        b = b.T
    return a, b


@jax.jit
def _emulate_steps(a, b):
    """Scan over K in steps of MMA_K: the exact f32 sum, the f16-accumulated one and the
    sum over steps of |exact partial sum| (a zero-padded last step adds the same as a
    shorter one)."""
    k = a.shape[-1]
    steps = -(-k // MMA_K)
    pad = steps * MMA_K - k
    a = jnp.pad(a.astype(jnp.float32), [(0, 0)] * (a.ndim - 1) + [(0, pad)])
    b = jnp.pad(b.astype(jnp.float32), [(0, 0)] * (b.ndim - 2) + [(0, pad), (0, 0)])
    a_steps = jnp.moveaxis(a.reshape(a.shape[:-1] + (steps, MMA_K)), -2, 0)  # [S, ..., M, 16]
    b_steps = jnp.moveaxis(b.reshape(b.shape[:-2] + (steps, MMA_K, b.shape[-1])), -3, 0)  # [S, ..., 16, N]
    out_shape = a.shape[:-1] + (b.shape[-1],)

    def step(carry, ab):
        exact, emulated, total = carry
        partial = jnp.matmul(ab[0], ab[1], precision="highest")
        exact = exact + partial
        emulated = (emulated.astype(jnp.float32) + partial).astype(jnp.float16)
        return (exact, emulated, total + jnp.abs(exact)), None

    zeros = jnp.zeros(out_shape, jnp.float32)
    (_, emulated, total), _ = jax.lax.scan(step, (zeros, zeros.astype(jnp.float16), zeros), (a_steps, b_steps))
    return emulated, total


def _f16_accumulation_model(a, b, dims):
    """(emulated f16-accumulated C, per-element bound 2^-10 * sum_steps |partial sum|)."""
    emulated, total = _emulate_steps(*_canonical(a, b, dims))
    return emulated, F16_UNIT_ROUNDOFF_ANY_ROUNDING * total


@pytest.mark.parametrize("layout", ["NN", "TT"])
def test_the_f16_accumulation_model_itself(layout):
    # The model the GPU tests hold the kernel to, against a direct numpy rendering of
    # its definition: K = 40 is two full wgmma steps and a partial one.
    m, n, k = 5, 7, 40
    shapes, dims = LAYOUTS[layout]
    a, b = _inputs(*shapes(m, n, k), k, seed=3)
    a_mk = np.asarray(a, np.float64).T if layout == "TT" else np.asarray(a, np.float64)
    b_kn = np.asarray(b, np.float64).T if layout == "TT" else np.asarray(b, np.float64)
    emulated, bound = _f16_accumulation_model(a, b, dims)
    acc, exact, total = np.zeros((m, n), np.float16), np.zeros((m, n)), np.zeros((m, n))
    for k0 in range(0, k, MMA_K):
        partial = a_mk[:, k0:k0 + MMA_K] @ b_kn[k0:k0 + MMA_K]
        acc = (acc.astype(np.float64) + partial).astype(np.float16)
        exact += partial
        total += np.abs(exact)
    np.testing.assert_array_equal(np.asarray(emulated), acc)
    np.testing.assert_allclose(np.asarray(bound), F16_UNIT_ROUNDOFF_ANY_ROUNDING * total, rtol=1e-6)


def _check_f16_accumulated(out, a, b, dims):
    ref = jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dims, precision="highest")
    emulated, bound = _f16_accumulation_model(a, b, dims)
    excess = jnp.abs(out.astype(jnp.float32) - ref) - BOUND_SLACK * bound
    assert float(excess.max()) <= ABS_FLOOR, f"{int((excess > ABS_FLOOR).sum())} elements past the bound"
    err, err_model = relative_error(out, ref), relative_error(emulated, ref)
    assert err <= MODEL_FACTOR * err_model + ABS_FLOOR, f"{err:.3e} vs the f16-accumulation model's {err_model:.3e}"
    if a.shape[dims[0][0][0]] >= MANY_STEPS_K:
        assert err >= err_model / 2, f"{err:.3e}: too accurate for f16 sums (model {err_model:.3e})"


LAYOUTS = {  # stored A, stored B, dimension numbers
    "NN": (lambda m, n, k: ((m, k), (k, n)), (((1,), (0,)), ((), ()))),
    "NT": (lambda m, n, k: ((m, k), (n, k)), (((1,), (1,)), ((), ()))),
    "TN": (lambda m, n, k: ((k, m), (k, n)), (((0,), (0,)), ((), ()))),
    "TT": (lambda m, n, k: ((k, m), (n, k)), (((0,), (1,)), ((), ()))),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(1000, 3000, 520), (2048, 2048, 4096), (129, 257, 72), (100, 101, 103),
                                   (600, 512, 1)], ids=lambda s: "x".join(map(str, s)))
def test_answers_match_f16_accumulation(hopper, layout, shape):
    m, n, k = shape
    shapes, dims = LAYOUTS[layout]
    a, b = _inputs(*shapes(m, n, k), k, seed=m + n + k)
    f = lambda x, y: jax_hopper.dot_general(x, y, dims, accumulation="f16")  # noqa: E731
    out, _ = run_into_poison(f, (m, n), jnp.float16, a, b)
    assert out.dtype == jnp.float16 and not bool(jnp.isnan(out).any()), "unwritten or NaN elements"
    _check_f16_accumulated(out, a, b, dims)


@pytest.mark.parametrize("out_dtype", [jnp.float16, jnp.float32], ids=["out16", "out32"])
def test_batched_and_f32_output(hopper, out_dtype):
    # f32 output is the kernel's (the public ops refuse to widen f16 sums): the f16
    # accumulator converted exactly, so the same error as f16 output.
    from jax_hopper._primitive import gemm

    bsz, m, n, k = 3, 700, 600, 520
    a, b = _inputs((bsz, m, k), (bsz, k, n), k, seed=7)
    f = lambda x, y: gemm(x, y, out_dtype=out_dtype, kernel="persistent_f16acc")  # noqa: E731
    out, _ = run_into_poison(f, (bsz, m, n), out_dtype, a, b)
    assert out.dtype == out_dtype and not bool(jnp.isnan(out).any())
    _check_f16_accumulated(out, a, b, (((2,), (1,)), ((0,), (0,))))


def test_repeated_calls_are_bitwise_identical_and_grads_run(hopper):
    a, b = _inputs((1000, 520), (520, 3000), 520, seed=9)
    f = jax.jit(lambda x, y: jax_hopper.matmul(x, y, accumulation="f16"))
    first = np.asarray(f(a, b))
    for _ in range(2):
        np.testing.assert_array_equal(np.asarray(f(a, b)), first)
    # The backward products run the default (f32-accumulating) kernel.
    ga = jax.grad(lambda x: jax_hopper.matmul(x, b, accumulation="f16").astype(jnp.float32).sum())(a)
    ref = f32_reference(jnp.ones((1000, 3000), jnp.float16), b.T)
    assert relative_error(ga, ref) <= F16_ULP  # f32 sums, one rounding to f16
