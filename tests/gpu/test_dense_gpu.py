"""GPU tests (Hopper only; skipped with a reason elsewhere): the fused epilogue kernel.

Fresh random inputs, output poisoned with NaN first, compared with the f32 reference of
the unfused computation; tolerance as in test_dense.py (1.5x the error of rounding the
reference itself: the kernel rounds once, like the reference; only f32 summation order
differs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import ACTIVATIONS, run_into_poison
from layer_cases import assert_close_to_reference, layer_operands

import jax_hopper

SHAPES = [
    (4096, 4096, 4096),
    (1000, 600, 520),  # partial tiles in M and N, K not a multiple of 64
    (129, 264, 72),  # one row past a tile
    (100, 101, 103),  # rows TMA cannot describe: operands padded, output stored from registers
    (300, 256, 100),  # K unaligned, N aligned: only x is padded, w's K tail read as TMA zero fill
]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fused_kernel_matches_the_f32_reference(hopper, shape, dtype, activation):
    m, n, k = shape
    x, w, b, r = layer_operands((m, k), n, dtype, seed=m + n)

    def f(x, w, b, r):
        with jax_hopper.dispatch("kernel"):
            return jax_hopper.dense(x, w, b, activation=activation, residual=r)

    out, _ = run_into_poison(f, (m, n), dtype, x, w, b, r)
    assert not bool(jnp.isnan(out).any()), "unwritten (still poisoned) or NaN elements"
    assert_close_to_reference(out, x, w, b, r, activation)


@pytest.mark.parametrize("with_bias,with_residual", [(False, False), (True, False), (False, True)])
def test_optional_operands(hopper, with_bias, with_residual):
    x, w, b, r = layer_operands((300, 520), 264, jnp.float16, bias=with_bias, residual=with_residual)

    def f(x, w, b, r):
        with jax_hopper.dispatch("kernel"):
            return jax_hopper.dense(x, w, b, activation="relu", residual=r)

    assert_close_to_reference(jax.jit(f)(x, w, b, r), x, w, b, r, "relu")


def test_compiled_program_is_one_fused_call(hopper):
    x, w, b, r = layer_operands((512, 256), 512, jnp.bfloat16)
    with jax_hopper.dispatch("kernel"):
        hlo = jax.jit(lambda *a: jax_hopper.dense(a[0], a[1], a[2], activation="silu", residual=a[3])).lower(
            x, w, b, r).compile().as_text()
    assert 'custom_call_target="jax_hopper_gemm_fused"' in hlo and "__cublas" not in hlo


F16 = jnp.float16
# Every handler's last result: its workspace (more than these products need).
WORKSPACE = jax.ShapeDtypeStruct((1 << 20,), jnp.uint8)

FUSED_MISUSE = [  # (bias shape, residual shape, c shape, attributes, message)
    ((65,), (0,), (64, 64), {}, "bias must be"),
    ((0,), (64, 65), (64, 64), {}, "residual must be"),
    ((0,), (0,), (64, 64), {"activation": 9}, "unknown activation"),
    ((0,), (0,), (2, 64, 64), {}, "rank"),
]


@pytest.mark.parametrize("bias_shape,res_shape,c_shape,attrs,match", FUSED_MISUSE,
                         ids=[f"{i}-" + m[-1].replace(" ", "_") for i, m in enumerate(FUSED_MISUSE)])
def test_fused_handler_rejects_inconsistent_calls(hopper, bias_shape, res_shape, c_shape, attrs, match):
    """Called directly (bypassing the Python checks), the fused handler answers a
    malformed call with an error instead of reading bias/residual out of bounds."""
    import numpy as np

    params = {"transpose_a": np.int32(0), "transpose_b": np.int32(0), "activation": np.int32(0)}
    params.update({k: np.int32(v) for k, v in attrs.items()})
    call = jax.ffi.ffi_call("jax_hopper_gemm_fused", (jax.ShapeDtypeStruct(c_shape, F16), WORKSPACE))
    operands = [jnp.ones((64, 32), F16), jnp.ones((32, 64), F16), jnp.ones(bias_shape, F16), jnp.ones(res_shape, F16)]
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(jax.jit(lambda *a: call(*a, **params))(*operands))


GRAD_MISUSE = [  # (z shape, c shape, column_sums shape, activation, message)
    # The backward form needs z or a saved derivative, N a multiple of 8 (z and c go by
    # TMA), and column sums, if any, as one f32 row per 64 rows of c.
    ((0,), (64, 64), (0,), 2, "needs the pre-activation"),
    ((64, 63), (64, 63), (0,), 2, "a multiple of 8"),
    ((64, 62), (64, 62), (0,), 2, "a multiple of 8"),
    ((64, 64), (64, 64), (2, 64), 2, "column_sums must be"),
    ((64, 64), (64, 64), (1, 56), 2, "column_sums must be"),
    ((64, 64), (64, 64), (0,), 9, "unknown activation"),
]


@pytest.mark.parametrize("z_shape,c_shape,sums_shape,activation,match", GRAD_MISUSE,
                         ids=[f"{i}-" + m[-1].replace(" ", "_") for i, m in enumerate(GRAD_MISUSE)])
def test_backward_form_handler_rejects_inconsistent_calls(hopper, z_shape, c_shape, sums_shape, activation, match):
    """Called directly with w [N, K] read K-major (as jax_hopper.mlp passes it), the
    backward form's handler refuses what its tensor maps and column sums cannot take,
    instead of reading or writing out of bounds."""
    import numpy as np

    n = c_shape[1]
    params = {"transpose_a": np.int32(0), "transpose_b": np.int32(1), "activation": np.int32(activation)}
    call = jax.ffi.ffi_call("jax_hopper_gemm_fused_grad",
                            (jax.ShapeDtypeStruct(c_shape, F16), jax.ShapeDtypeStruct(sums_shape, jnp.float32),
                             WORKSPACE))
    operands = [jnp.ones((64, 32), F16), jnp.ones((n, 32), F16), jnp.ones(z_shape, F16)]
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(jax.jit(lambda *a: call(*a, **params))(*operands))
