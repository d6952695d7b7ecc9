"""CPU tests: what jax_hopper.matmul lowers to, the fallback's answers, input errors."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import seed_normal

import jax_hopper
from jax_hopper import _ffi
from jax_hopper.primitives.gemm import gemm

TARGET = "jax_hopper_gemm"
KERNEL_DTYPES = [jnp.float16, jnp.bfloat16]


def lower_text(fn, *args, platform):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("shape", [(256, 512, 128), (129, 257, 72), (1, 256, 64), (1000, 3000, 520), (7, 9, 11)])
def test_cuda_lowering_is_our_custom_call(shape, dtype):
    m, n, k = shape
    a = jax.ShapeDtypeStruct((m, k), dtype)
    b = jax.ShapeDtypeStruct((k, n), dtype)
    text = lower_text(jax_hopper.matmul, a, b, platform="cuda")
    calls = re.findall(r"stablehlo\.custom_call @(\S+)\(", text)
    assert calls == [TARGET], calls
    assert "dot_general" not in text
    # The call's results are the logical [M, N] output, whatever the padding, and its
    # workspace (bytes that XLA plans; nobody reads them).
    out_type = f"tensor<{m}x{n}x{'f16' if dtype == jnp.float16 else 'bf16'}>"
    assert re.search(rf"custom_call @{TARGET}\(.*-> \({re.escape(out_type)}, tensor<\d+xui8>\)", text), text


# (kind, M, N, K, workspace bytes for 132 SMs): the ticket counter (16 bytes) for the
# ticketed kinds; split K's partial sums (64 x 128 f32 per piece) and a counter per tile
# where its pieces meet in global memory: 8 tiles of 16 x 1024 in 33 pieces (264 CTAs,
# two per SM, over 8 tiles), 64 tiles of 16 x 8192 in 4; V5 and one whole piece none.
WORKSPACES = [("persistent", 4096, 4096, 4096, 16), ("v5", 4096, 4096, 4096, 0),
              ("small_m", 16, 1024, 8192, 8 * 33 * 64 * 128 * 4 + 8 * 4),
              ("small_m", 16, 8192, 8192, 64 * 4 * 64 * 128 * 4 + 64 * 4),
              ("small_m", 16, 40960, 128, 0)]


@pytest.mark.parametrize("kind,m,n,k,size", WORKSPACES, ids=lambda v: str(v))
def test_every_call_returns_a_workspace_xla_plans(monkeypatch, kind, m, n, k, size):
    """The call's last result is its workspace, sized by the lowering for the GPU it lowers
    for (here an H100's or H200's 132 SMs); the user gets the product alone."""
    if not jax_hopper.kernel_available():
        pytest.skip("the CUDA extension is not built here")
    monkeypatch.setattr(_ffi, "lowering_sms", lambda: 132)
    a, b = jax.ShapeDtypeStruct((m, k), jnp.float16), jax.ShapeDtypeStruct((k, n), jnp.float16)
    text = lower_text(lambda a, b: gemm(a, b, kernel=kind), a, b, platform="cuda")
    assert re.search(rf"custom_call @{TARGET}\(.*-> \(tensor<{m}x{n}xf16>, tensor<{size}xui8>\)", text), text
    assert re.search(rf"return %0#0 : tensor<{m}x{n}xf16>", text), "the workspace is not returned"


def test_rows_tma_cannot_describe_are_padded_to_16_bytes():
    """Only stored rows are padded: A's K (its rows) and B's N. B keeps its 103 K rows;
    the kernel reads zeros past them (the FFI handler's contract)."""
    a = jax.ShapeDtypeStruct((100, 103), jnp.float16)  # K = 103: not a multiple of 8
    b = jax.ShapeDtypeStruct((103, 101), jnp.float16)  # N = 101
    text = lower_text(jax_hopper.matmul, a, b, platform="cuda")
    assert re.search(rf"custom_call @{TARGET}\(.*tensor<100x104xf16>, tensor<103x104xf16>\) -> \(tensor<100x101xf16>,",
                     text), text


@pytest.mark.parametrize("layout", ["nn", "tt"])
def test_an_odd_k_copies_only_the_k_major_operand(layout):
    """A weight [K, N] with an odd K (jnp.dot's layout) is passed as it is: only the small
    K-major operand is padded. Transposed, B [N, K] is padded and A [K, M] is not."""
    m, n, k = 64, 4096, 4095
    if layout == "nn":
        a, b, dims, passed = (m, k), (k, n), (((1,), (0,)), ((), ())), (f"{m}x4096", f"{k}x{n}")
    else:
        a, b, dims, passed = (k, m), (n, k), (((0,), (1,)), ((), ())), (f"{k}x{m}", f"{n}x4096")
    f = lambda x, y: jax_hopper.dot_general(x, y, dims)  # noqa: E731
    text = lower_text(f, jax.ShapeDtypeStruct(a, jnp.bfloat16), jax.ShapeDtypeStruct(b, jnp.bfloat16),
                      platform="cuda")
    assert re.search(rf"custom_call @{TARGET}\(.*tensor<{passed[0]}xbf16>, tensor<{passed[1]}xbf16>\)", text), text
    assert text.count("stablehlo.pad") == 1, text


def test_aligned_operands_are_passed_without_copies():
    a = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((128, 512), jnp.bfloat16)
    text = lower_text(jax_hopper.matmul, a, b, platform="cuda")
    assert "stablehlo.pad" not in text and "stablehlo.transpose" not in text


def test_cpu_lowering_is_xla_dot():
    a = jax.ShapeDtypeStruct((64, 32), jnp.float16)
    b = jax.ShapeDtypeStruct((32, 16), jnp.float16)
    text = lower_text(jax_hopper.matmul, a, b, platform="cpu")
    assert "custom_call" not in text and "dot_general" in text


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("shape", [(64, 48, 32), (129, 257, 72), (1, 5, 3)])
def test_fallback_matches_jnp_dot(shape, dtype):
    if jax.default_backend() != "cpu":
        pytest.skip("checks the CPU fallback")
    m, n, k = shape
    ka, kb = jax.random.split(jax.random.key(m * n + k))
    a, b = seed_normal(ka, (m, k), dtype, k), seed_normal(kb, (k, n), dtype, k)
    out = jax.jit(jax_hopper.matmul)(a, b)
    assert out.dtype == dtype and out.shape == (m, n)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(jnp.dot(a, b), np.float32))
    # Eager (un-jitted) calls go through the same primitive.
    np.testing.assert_array_equal(np.asarray(jax_hopper.matmul(a, b), np.float32), np.asarray(out, np.float32))


@pytest.mark.parametrize("dtypes", [(jnp.float32, jnp.float32), (jnp.int32, jnp.int32), (jnp.float16, jnp.bfloat16),
                                    (jnp.float16, jnp.float32)])
def test_other_dtypes_compute_like_jnp_matmul(dtypes):
    a = (jnp.arange(12).reshape(3, 4) % 5).astype(dtypes[0])
    b = (jnp.arange(20).reshape(4, 5) % 3).astype(dtypes[1])
    out = jax.jit(jax_hopper.matmul)(a, b)
    ref = jnp.matmul(a, b)
    assert out.dtype == ref.dtype
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    assert "custom_call" not in lower_text(jax_hopper.matmul, a, b, platform="cuda")


@pytest.mark.parametrize(
    "a_shape,b_shape,match",
    [
        ((4, 8), (9, 16), r"float16\[4, 8\], float16\[9, 16\]"),
        ((), (8, 16), r"float16\[\], float16\[8, 16\]"),
        ((3, 4, 8), (2, 8, 16), r"float16\[3, 4, 8\], float16\[2, 8, 16\]"),
    ],
)
def test_bad_shapes_raise_errors_naming_both_operands(a_shape, b_shape, match):
    a = jnp.ones(a_shape, jnp.float16)
    b = jnp.ones(b_shape, jnp.float16)
    with pytest.raises((TypeError, ValueError), match=match):
        jax.jit(jax_hopper.matmul)(a, b)


def test_non_arrays_raise_type_error():
    # jax's own TypeError (as jnp.matmul raises it), naming our function.
    with pytest.raises(TypeError, match=r"jax_hopper.matmul\(list.*requires ndarray"):
        jax_hopper.matmul([[1.0]], jnp.ones((1, 1), jnp.float16))
