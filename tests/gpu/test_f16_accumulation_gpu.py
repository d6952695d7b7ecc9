"""The f16-accumulating kernel's answers on a Hopper GPU, held to tests/f16_model.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from f16_model import F16_ULP, LAYOUTS, check_f16_accumulated, inputs
from helpers import f32_reference, relative_error, run_into_poison

import jax_hopper


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(1000, 3000, 520), (2048, 2048, 4096), (129, 257, 72), (100, 101, 103),
                                   (600, 512, 1)], ids=lambda s: "x".join(map(str, s)))
def test_answers_match_f16_accumulation(hopper, layout, shape):
    m, n, k = shape
    shapes, dims = LAYOUTS[layout]
    a, b = inputs(*shapes(m, n, k), k, seed=m + n + k)
    f = lambda x, y: jax_hopper.dot_general(x, y, dims, accumulation="f16")  # noqa: E731
    out, _ = run_into_poison(f, (m, n), jnp.float16, a, b)
    assert out.dtype == jnp.float16 and not bool(jnp.isnan(out).any()), "unwritten or NaN elements"
    check_f16_accumulated(out, a, b, dims)


@pytest.mark.parametrize("out_dtype", [jnp.float16, jnp.float32], ids=["out16", "out32"])
def test_batched_and_f32_output(hopper, out_dtype):
    # f32 output is the kernel's (the public ops refuse to widen f16 sums): the f16
    # accumulator converted exactly, so the same error as f16 output.
    from jax_hopper.primitives.gemm import gemm

    bsz, m, n, k = 3, 700, 600, 520
    a, b = inputs((bsz, m, k), (bsz, k, n), k, seed=7)
    f = lambda x, y: gemm(x, y, out_dtype=out_dtype, kernel="persistent_f16acc")  # noqa: E731
    out, _ = run_into_poison(f, (bsz, m, n), out_dtype, a, b)
    assert out.dtype == out_dtype and not bool(jnp.isnan(out).any())
    check_f16_accumulated(out, a, b, (((2,), (1,)), ((0,), (0,))))


def test_repeated_calls_are_bitwise_identical_and_grads_run(hopper):
    a, b = inputs((1000, 520), (520, 3000), 520, seed=9)
    f = jax.jit(lambda x, y: jax_hopper.matmul(x, y, accumulation="f16"))
    first = np.asarray(f(a, b))
    for _ in range(2):
        np.testing.assert_array_equal(np.asarray(f(a, b)), first)
    # The backward products run the default (f32-accumulating) kernel.
    ga = jax.grad(lambda x: jax_hopper.matmul(x, b, accumulation="f16").astype(jnp.float32).sum())(a)
    ref = f32_reference(jnp.ones((1000, 3000), jnp.float16), b.T)
    assert relative_error(ga, ref) <= F16_ULP  # f32 sums, one rounding to f16
