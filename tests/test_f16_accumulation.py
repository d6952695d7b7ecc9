"""The opt-in f16-accumulating kernel (accumulation="f16"): its API on any machine, its
answers on a Hopper GPU.

Error bound (GPU tests): the kernel adds one wgmma's 16 products at a time into an f16
accumulator, so after the j-th K step of 16 the accumulator is s_j rounded to f16,
an error of at most 2^-10 |s_j| (one f16 unit roundoff, whichever way the hardware
rounds). Summed over the K / 16 steps, element (i, j) of C is off by at most
2^-10 * sum_steps |s_step(i, j)|, computed here from the exact (f32) partial sums.
A factor 2 covers what the bound leaves out (the partial sums the kernel sees are
themselves perturbed, and the product sum inside one wgmma is not specified); a wrong
element or a lost K step is off by |C| itself. The same tests check the error is larger
than f32 accumulation's, so the kind really accumulates in f16.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import f32_reference, hopper_devices, relative_error, run_into_poison, seed_normal

import jax_hopper
from jax_hopper._primitive import KERNELS

F16_UNIT_ROUNDOFF_ANY_ROUNDING = 2.0**-10
F16_ULP = 2.0**-10  # relative: one rounding of an f32 sum to f16 is within half of it
MMA_K = 16
BOUND_SLACK = 2.0


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


# Shapes measured on the H200 (BENCHMARKS.md): where the f16-accumulating kernel beat
# cuBLASLt, and where it did not.
F16_FASTER = [(8192, 8192, 8192), (4096, 4096, 4096), (8192, 16384, 4096), (16384, 16384, 16384),
              (4096, 14336, 4096), (4096, 4096, 14336)]
F16_SLOWER = [(6144, 6144, 6144), (3000, 5000, 7000), (8192, 8192, 1024), (2048, 2048, 2048), (256, 8192, 8192)]


@pytest.mark.parametrize("shape", F16_FASTER, ids=lambda s: "x".join(map(str, s)))
def test_auto_runs_f16_accumulation_where_it_was_measured_faster(shape):
    assert _path(*shape, accumulation="f32")[0] == "xla"  # aligned: f32 products go to cuBLASLt
    assert _path(*shape) == ("kernel", "f16-accumulation")


@pytest.mark.parametrize("shape", F16_SLOWER, ids=lambda s: "x".join(map(str, s)))
def test_auto_keeps_the_f32_path_where_f16_accumulation_was_slower(shape):
    assert _path(*shape) == _path(*shape, accumulation="f32") == ("xla", "default")


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

def _f16_accumulation_bound(a, b, dims):
    """2^-10 * sum over K steps of |partial sum| per element, from f32 partial sums."""
    (ca, cb), _ = dims
    k = a.shape[ca[0]]
    a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
    partial = None
    total = None
    for k0 in range(0, k, MMA_K):
        sl = slice(k0, min(k0 + MMA_K, k))
        a_step = jax.lax.slice_in_dim(a32, sl.start, sl.stop, axis=ca[0])
        b_step = jax.lax.slice_in_dim(b32, sl.start, sl.stop, axis=cb[0])
        step = jax.lax.dot_general(a_step, b_step, dims, precision="highest")
        partial = step if partial is None else partial + step
        total = jnp.abs(partial) if total is None else total + jnp.abs(partial)
    return F16_UNIT_ROUNDOFF_ANY_ROUNDING * total


LAYOUTS = {  # stored A, stored B, dimension numbers
    "NN": (lambda m, n, k: ((m, k), (k, n)), (((1,), (0,)), ((), ()))),
    "NT": (lambda m, n, k: ((m, k), (n, k)), (((1,), (1,)), ((), ()))),
    "TN": (lambda m, n, k: ((k, m), (k, n)), (((0,), (0,)), ((), ()))),
    "TT": (lambda m, n, k: ((k, m), (n, k)), (((0,), (1,)), ((), ()))),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(1000, 3000, 520), (2048, 2048, 4096), (129, 257, 72), (100, 101, 103),
                                   (600, 512, 1)], ids=lambda s: "x".join(map(str, s)))
def test_within_the_f16_accumulation_bound(hopper, layout, shape):
    m, n, k = shape
    shapes, dims = LAYOUTS[layout]
    a, b = _inputs(*shapes(m, n, k), k, seed=m + n + k)
    f = lambda x, y: jax_hopper.dot_general(x, y, dims, accumulation="f16")  # noqa: E731
    out, _ = run_into_poison(f, (m, n), jnp.float16, a, b)
    assert out.dtype == jnp.float16 and not bool(jnp.isnan(out).any()), "unwritten or NaN elements"
    ref = jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dims, precision="highest")
    excess = jnp.abs(out.astype(jnp.float32) - ref) - BOUND_SLACK * _f16_accumulation_bound(a, b, dims)
    assert float(excess.max()) <= 1e-6, f"{int((excess > 1e-6).sum())} elements past the bound"
    if k >= 512:  # many roundings: f16 accumulation must show, or this is not the f16 kind
        err, err_f32 = relative_error(out, ref), relative_error(jax.lax.dot_general(a, b, dims), ref)
        assert err > 1.5 * err_f32, f"{err:.2e} vs f32 accumulation's {err_f32:.2e}"


@pytest.mark.parametrize("out_dtype", [None, jnp.float32], ids=["out16", "out32"])
def test_batched_and_f32_output(hopper, out_dtype):
    bsz, m, n, k = 3, 700, 600, 520
    a, b = _inputs((bsz, m, k), (bsz, k, n), k, seed=7)
    f = lambda x, y: jax_hopper.matmul(x, y, preferred_element_type=out_dtype, accumulation="f16")  # noqa: E731
    out, _ = run_into_poison(f, (bsz, m, n), out_dtype or jnp.float16, a, b)
    assert not bool(jnp.isnan(out).any())
    dims = (((2,), (1,)), ((0,), (0,)))
    ref = jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dims, precision="highest")
    excess = jnp.abs(out.astype(jnp.float32) - ref) - BOUND_SLACK * _f16_accumulation_bound(a, b, dims)
    assert float(excess.max()) <= 1e-6


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
