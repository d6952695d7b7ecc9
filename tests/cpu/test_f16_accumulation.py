"""The opt-in f16-accumulating kernel (accumulation="f16"): its API and dispatch on any
machine, and the model its answers are held to (tests/f16_model.py; the answers
themselves: tests/gpu/test_f16_accumulation_gpu.py)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from f16_model import F16_ULP, F16_UNIT_ROUNDOFF_ANY_ROUNDING, LAYOUTS, MMA_K, f16_accumulation_model, inputs
from helpers import f32_reference, hopper_devices, kernel_ids, relative_error

import jax_hopper
from jax_hopper import _rules

KERNELS = kernel_ids()

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


# Shapes measured on the H200 (docs/results/evidence/f16acc_sweep.json and
# bench.json): where the f16-accumulating kernel beat cuBLASLt, and where it did not.
F16_FASTER = [(8192, 8192, 8192), (4096, 4096, 4096), (8192, 16384, 4096), (16384, 16384, 16384),
              (4096, 14336, 4096), (4096, 4096, 14336)]
F16_SLOWER = [(6144, 6144, 6144), (3000, 5000, 7000), (8192, 8192, 1024), (2048, 2048, 2048), (256, 8192, 8192)]


@pytest.mark.parametrize("shape", F16_FASTER, ids=lambda s: "x".join(map(str, s)))
def test_auto_runs_f16_accumulation_where_it_was_measured_faster(shape):
    m, n, k = shape
    # Aligned f32-accumulating products go to cuBLASLt, except the wide ones (M, N >= 16384).
    wide = min(m, n) >= _rules.WIDE_MIN_MN and k >= _rules.WIDE_MIN_K
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
    a, b = inputs((96, 80), (80, 72), 80, seed=5)
    out = jax_hopper.matmul(a, b, accumulation="f16")
    assert out.dtype == jnp.float16
    assert relative_error(out, f32_reference(a, b)) <= F16_ULP


@pytest.mark.parametrize("layout", ["NN", "TT"])
def test_the_f16_accumulation_model_itself(layout):
    # The model the GPU tests hold the kernel to, against a direct numpy rendering of
    # its definition: K = 40 is two full wgmma steps and a partial one.
    m, n, k = 5, 7, 40
    shapes, dims = LAYOUTS[layout]
    a, b = inputs(*shapes(m, n, k), k, seed=3)
    a_mk = np.asarray(a, np.float64).T if layout == "TT" else np.asarray(a, np.float64)
    b_kn = np.asarray(b, np.float64).T if layout == "TT" else np.asarray(b, np.float64)
    emulated, bound = f16_accumulation_model(a, b, dims)
    acc, exact, total = np.zeros((m, n), np.float16), np.zeros((m, n)), np.zeros((m, n))
    for k0 in range(0, k, MMA_K):
        partial = a_mk[:, k0:k0 + MMA_K] @ b_kn[k0:k0 + MMA_K]
        acc = (acc.astype(np.float64) + partial).astype(np.float16)
        exact += partial
        total += np.abs(exact)
    np.testing.assert_array_equal(np.asarray(emulated), acc)
    np.testing.assert_allclose(np.asarray(bound), F16_UNIT_ROUNDOFF_ANY_ROUNDING * total, rtol=1e-6)


