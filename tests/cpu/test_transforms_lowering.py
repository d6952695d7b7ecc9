"""CPU tests of what layouts, batching, vmap and autodiff lower to for CUDA: our custom
call in every product, no transposing copy feeding it, no loop."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from helpers import cuda_text

import jax_hopper

F16 = jnp.float16
M, N, K, B = 256, 512, 128, 3


def calls(text):
    """[(transpose_a, transpose_b)] of every jax_hopper_gemm call in the module."""
    found = re.findall(r"custom_call @(\S+)\((.*)", text)
    out = []
    for target, rest in found:
        assert target == "jax_hopper_gemm", f"unexpected custom call {target}"
        ta = re.search(r"transpose_a = (\d)", rest).group(1)
        tb = re.search(r"transpose_b = (\d)", rest).group(1)
        out.append((int(ta), int(tb)))
    return out


def assert_no_copies_or_loops(text):
    assert "stablehlo.transpose" not in text
    assert "stablehlo.while" not in text
    assert "stablehlo.dot_general" not in text


S = jax.ShapeDtypeStruct
LAYOUTS = {  # name: (lhs shape, rhs shape, dimension numbers, expected flags)
    "NN": ((M, K), (K, N), (((1,), (0,)), ((), ())), (0, 0)),
    "NT": ((M, K), (N, K), (((1,), (1,)), ((), ())), (0, 1)),
    "TN": ((K, M), (K, N), (((0,), (0,)), ((), ())), (1, 0)),
    "TT": ((K, M), (N, K), (((0,), (1,)), ((), ())), (1, 1)),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_each_layout_reads_operands_in_place(layout, dtype):
    ls, rs, dims, flags = LAYOUTS[layout]
    text = cuda_text(lambda a, b: jax_hopper.dot_general(a, b, dims), S(ls, dtype), S(rs, dtype))
    assert calls(text) == [flags]
    assert_no_copies_or_loops(text)


def test_batched_dot_general_is_one_batched_call():
    dims = (((2,), (1,)), ((0,), (0,)))
    text = cuda_text(lambda a, b: jax_hopper.dot_general(a, b, dims), S((B, M, K), F16), S((B, K, N), F16))
    assert calls(text) == [(0, 0)]
    assert re.search(r"-> \(tensor<3x256x512xf16>, tensor<\d+xui8>\)", text)
    assert_no_copies_or_loops(text)


def test_nd_activations_times_weights_fold_into_m():
    """x [4, 8, K] @ W: the custom call takes x and returns C with their leading dims (the
    FFI handler folds them into M): no reshape, which explicit mesh axes would refuse."""
    for lhs in [S((4, 8, K), F16), S((2, 2, 8, K), F16)]:
        text = cuda_text(jax_hopper.dot, lhs, S((K, N), F16))
        assert calls(text) == [(0, 0)]
        out = "x".join(map(str, lhs.shape[:-1]))
        assert re.search(rf"custom_call @jax_hopper_gemm\(.*tensor<{out}x{K}xf16>.*-> \(tensor<{out}x{N}xf16>,", text)
        assert "reshape" not in text
        assert_no_copies_or_loops(text)


def test_matmul_batch_broadcast_is_one_call():
    text = cuda_text(jax_hopper.matmul, S((B, M, K), F16), S((B, K, N), F16))
    assert calls(text) == [(0, 0)]
    assert_no_copies_or_loops(text)


@pytest.mark.parametrize("in_axes", [(0, None), (None, 0), (0, 0), (1, None), (None, 2)])
def test_vmap_is_one_launch_not_a_loop(in_axes):
    shapes = {0: (B, M, K), 1: (M, B, K), None: (M, K)}
    a = S(shapes[in_axes[0]], F16)
    b = S({0: (B, K, N), 2: (K, N, B), None: (K, N)}[in_axes[1]], F16)
    text = cuda_text(jax.vmap(jax_hopper.matmul, in_axes=in_axes), a, b)
    assert len(calls(text)) == 1
    assert "stablehlo.while" not in text


@pytest.mark.parametrize("case", ["weights [v, K, N] against x [M, K]", "weights against x [L, M, K]",
                                  "batched x [v, B, M, K]", "batched weights [v, B, K, N]",
                                  "batched weights [v, B, N, K]"])
def test_vmap_against_a_shared_operand_never_copies_it_per_example(case):
    """jacfwd / vmap over one operand: the shared one is not broadcast to the vmapped
    size (a per-example copy of x for per-example weights cost 64x jnp's memory under
    jacfwd); the vmapped one is folded into M or N instead, one launch."""
    v = 64
    nn, lead, batched, batched_nt = ((((1,), (0,)), ((), ())), (((2,), (0,)), ((), ())),
                                     (((2,), (1,)), ((0,), (0,))), (((2,), (2,)), ((0,), (0,))))
    x, w, dims, dn = {  # the operands as vmap sees them (v leading on the vmapped one)
        "weights [v, K, N] against x [M, K]": ((M, K), (v, K, N), (None, 0), nn),
        "weights against x [L, M, K]": ((B, M, K), (v, K, N), (None, 0), lead),
        "batched x [v, B, M, K]": ((v, B, M, K), (B, K, N), (0, None), batched),
        "batched weights [v, B, K, N]": ((B, M, K), (v, B, K, N), (None, 0), batched),
        "batched weights [v, B, N, K]": ((B, M, K), (v, B, N, K), (None, 0), batched_nt),
    }[case]
    f = jax.vmap(lambda a, b: jax_hopper.dot_general(a, b, dn), in_axes=dims)
    text = cuda_text(f, S(x, F16), S(w, F16))
    shared = x if dims[0] is None else w
    assert len(calls(text)) == 1 and "stablehlo.while" not in text
    broadcast = re.findall(r"stablehlo.broadcast_in_dim .*-> tensor<([0-9x]+)xf16>", text)
    assert not any(tuple(int(d) for d in b.split("x")) == (v,) + shared for b in broadcast), broadcast


@pytest.mark.parametrize("nested", [False, True], ids=["dot_general", "vmap"])
def test_several_batch_dims_reach_the_call_as_they_are(nested):
    """[batch, heads, S, D] products keep each batch dim (the FFI handler folds them): a
    fold before the call would merge a sharded heads dim into the batch dim before it,
    which XLA can only do by gathering q and k. vmap over a batched product adds a dim."""
    dn = (((3,), (3,)), ((0, 1), (0, 1)))
    q, k = S((2, B, M, K), F16), S((2, B, N, K), F16)
    f = lambda q, k: jax_hopper.dot_general(q, k, dn)  # noqa: E731
    if nested:
        f = jax.vmap(lambda q, k: jax_hopper.dot_general(q, k, (((2,), (2,)), ((0,), (0,)))))
    text = cuda_text(f, q, k)
    assert len(calls(text)) == 1
    call = re.search(r"stablehlo\.custom_call @jax_hopper_gemm\(.*\) .*: \((tensor<[^>]*>), (tensor<[^>]*>)\)", text)
    assert call is not None, text
    assert call.groups() == (f"tensor<2x{B}x{M}x{K}xf16>", f"tensor<2x{B}x{N}x{K}xf16>"), call.groups()


def test_nested_vmap_is_one_launch():
    f = jax.vmap(jax.vmap(jax_hopper.matmul))
    text = cuda_text(f, S((2, B, M, K), F16), S((2, B, K, N), F16))
    assert len(calls(text)) == 1 and "stablehlo.while" not in text


@pytest.mark.parametrize("layout", LAYOUTS)
def test_grad_runs_every_product_on_our_kernel_without_transposes(layout):
    ls, rs, dims, _ = LAYOUTS[layout]

    def loss(a, b):  # squared, so the forward product is needed by the backward pass
        c = jax_hopper.dot_general(a, b, dims).astype(jnp.float32)
        return jnp.sum(c * c)

    text = cuda_text(jax.grad(loss, argnums=(0, 1)), S(ls, F16), S(rs, F16))
    assert len(calls(text)) == 3  # forward, dA, dB
    assert "stablehlo.transpose" not in text and "stablehlo.dot_general" not in text


@pytest.mark.parametrize("dtype", [F16, jnp.bfloat16], ids=["f16", "bf16"])
def test_grad_of_batched_and_f32_output_products(dtype):
    # The f32 cotangent is rounded to the operands' type (an f16 one after one power-of-two
    # scale, undone on the f32 product; a bf16 one split into two bf16 parts, two products
    # per gradient) and every backward product stays on our kernel: no mixed f32 x 16-bit dot.
    def loss(a, b):
        c = jax_hopper.matmul(a, b, preferred_element_type=jnp.float32)
        return jnp.sum(c * c)

    text = cuda_text(jax.grad(loss, argnums=(0, 1)), S((B, M, K), dtype), S((B, K, N), dtype))
    assert len(calls(text)) == (3 if dtype == F16 else 5) and "stablehlo.dot_general" not in text


@pytest.mark.parametrize("transform", ["jvp", "linearize", "checkpoint", "vjp"])
def test_other_autodiff_entry_points_lower_to_our_kernel(transform):
    a, b = jnp.ones((M, K), F16), jnp.ones((K, N), F16)
    mm = jax_hopper.matmul
    if transform == "jvp":
        fn = lambda x, y: jax.jvp(mm, (x, y), (x, y))[1]  # noqa: E731
    elif transform == "linearize":
        fn = lambda x, y: jax.linearize(mm, x, y)[1](x, y)  # noqa: E731
    elif transform == "checkpoint":
        fn = jax.grad(lambda x, y: jnp.sum(jax.checkpoint(mm)(x, y).astype(jnp.float32) ** 2))  # noqa: E731
    else:
        fn = lambda x, y: jax.vjp(mm, x, y)[1](jnp.ones((M, N), F16))  # noqa: E731
    text = cuda_text(fn, a, b)
    assert len(calls(text)) >= 2
    assert "stablehlo.dot_general" not in text
