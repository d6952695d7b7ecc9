"""jax_hopper.dense (bias, activation, residual fused into the epilogue): semantics,
lowering, autodiff, vmap, flax layer. CPU tests; the kernel's own numerics are in
test_dense_gpu.py.

Reference: the unfused computation in f32 (f32 products and sums, f32 bias, activation
and residual), rounded once. The op promises exactly that arithmetic, so its result may
differ from the rounded reference only by the final rounding of a value that carries
f32 summation-order noise: 1.5x the error of rounding the reference itself (the same
rule as the core tests) covers it, while a wrong activation, a lost bias or residual,
or a double rounding is far outside it.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ACTIVATIONS, cuda_text, relative_error, seed_normal, weak
from layer_cases import ERROR_FACTOR, assert_close_to_reference, f32_reference, layer_operands

import jax_hopper
from jax_hopper.primitives import dense as dense_primitive


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("with_bias,with_residual", [(True, True), (True, False), (False, True), (False, False)])
def test_value_is_the_fused_arithmetic(activation, dtype, with_bias, with_residual):
    x, w, b, r = layer_operands((3, 40, 24), 72, dtype, bias=with_bias, residual=with_residual)
    out = jax.jit(lambda *a: jax_hopper.dense(a[0], a[1], a[2], activation=activation, residual=a[3]))(x, w, b, r)
    assert out.shape == (3, 40, 72) and out.dtype == dtype
    assert_close_to_reference(out, x, w, b, r, activation)


@pytest.mark.parametrize("activation", ["gelu_tanh", None])
def test_a_vector_x_is_one_row_of_the_fused_layer(activation):
    """x [K] (and residual [N]): one fused launch on a single row, shaped as jnp's."""
    x, w, b, r = layer_operands((40,), 72, jnp.float16)

    def layer(x, w, b, r):
        return jax_hopper.dense(x, w, b, activation=activation, residual=r)

    assert re.findall(r"stablehlo\.custom_call @(\S+)\(", cuda_text(layer, x, w, b, r)) == ["jax_hopper_gemm_fused"]
    out = jax.jit(layer)(x, w, b, r)
    assert out.shape == (72,) and out.dtype == jnp.float16
    assert_close_to_reference(out, x, w, b, r, activation)


def test_kernel_policy_lowers_to_one_fused_call():
    x, w, b, r = layer_operands((256, 128), 512, jnp.float16)
    with jax_hopper.dispatch("kernel"):
        text = cuda_text(lambda *a: jax_hopper.dense(a[0], a[1], a[2], activation="gelu_tanh", residual=a[3]),
                        x, w, b, r)
    calls = re.findall(r"stablehlo\.custom_call @(\S+)\(", text)
    assert calls == ["jax_hopper_gemm_fused"], calls
    assert "dot_general" not in text and "tanh" not in text  # bias, GELU and residual are in the kernel


def test_nothing_to_fuse_is_our_plain_product_and_transposes():
    # No bias, activation or residual: the layer is the plain product (its call, its
    # rules), so jax.linear_transpose works through it in either operand.
    x, w, _, _ = layer_operands((129, 72), 257, jnp.float16, bias=False, residual=False)
    ct = seed_normal(jax.random.key(5), (129, 257), jnp.float16, 257)
    with jax_hopper.dispatch("kernel"):
        text = cuda_text(lambda x, w: jax_hopper.dense(x, w), x, w)
        assert re.findall(r"stablehlo\.custom_call @(\S+)\(", text) == ["jax_hopper_gemm"], text
        assert_close_to_reference(jax.jit(lambda x, w: jax_hopper.dense(x, w))(x, w), x, w, None, None, None)
        (tx,) = jax.linear_transpose(lambda v: jax_hopper.dense(v, w), x)(ct)
        (tw,) = jax.linear_transpose(lambda v: jax_hopper.dense(x, v), w)(ct)
        # Each a product with one rounding: the rule of the value tests, against f32 products.
        f32 = lambda v: v.astype(jnp.float32)  # noqa: E731
        for got, exact in ((tx, jnp.dot(f32(ct), f32(w).T, precision="highest")),
                           (tw, jnp.dot(f32(x).T, f32(ct), precision="highest"))):
            assert got.dtype == jnp.float16
            assert relative_error(got, exact) <= ERROR_FACTOR * relative_error(exact.astype(got.dtype), exact) + 1e-6


@pytest.mark.parametrize("operand", ["x", "w", "bias", "residual"])
def test_affine_layer_transposes_like_jnp(operand):
    # x w + b + r is affine in each operand: jax.linear_transpose of jnp's layer transposes
    # its linear part (the rest are constants), and so must the fused layer's (the name a
    # remat policy uses is put on where the layer is differentiated, not here).
    x, w, b, r = layer_operands((2, 65, 72), 136, jnp.float16)
    ct = seed_normal(jax.random.key(5), (2, 65, 136), jnp.float16, 136)
    operands = {"x": x, "w": w, "bias": b, "residual": r}

    def layer(fn):
        def f(v):
            ops = dict(operands, **{operand: v})
            return fn(ops["x"], ops["w"], ops["bias"], ops["residual"])
        return f

    ours = layer(lambda x, w, b, r: jax_hopper.dense(x, w, b, residual=r))
    theirs = layer(lambda x, w, b, r: x @ w + b + r)
    with jax_hopper.dispatch("kernel"):
        assert "jax_hopper_dense" in str(jax.make_jaxpr(ours)(operands[operand]))  # the fused layer, not jnp's
        (got,) = jax.jit(jax.linear_transpose(ours, operands[operand]))(ct)
    (expected,) = jax.linear_transpose(theirs, operands[operand])(ct)
    assert got.shape == expected.shape and got.dtype == expected.dtype == jnp.float16
    if operand in ("bias", "residual"):  # no product: jnp's sum (bias) or the cotangent itself
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
        return
    f32 = lambda v: v.astype(jnp.float32)  # noqa: E731
    exact = (jnp.einsum("bmn,kn->bmk", f32(ct), f32(w), precision="highest") if operand == "x"
             else jnp.einsum("bmk,bmn->kn", f32(x), f32(ct), precision="highest"))
    # One product, one rounding: the rule of the value tests, against the f32 product.
    assert relative_error(got, exact) <= ERROR_FACTOR * relative_error(exact.astype(got.dtype), exact) + 1e-6
    with jax_hopper.dispatch("kernel"):
        with pytest.raises(NotImplementedError, match="not linear"):
            jax.linear_transpose(lambda v: jax_hopper.dense(v, w, b, activation="relu"), x)(ct)


def test_auto_policy_on_aligned_shapes_is_xla():
    x, w, b, r = layer_operands((256, 128), 512, jnp.float16)
    with jax_hopper.dispatch("auto"):
        text = cuda_text(lambda *a: jax_hopper.dense(a[0], a[1], a[2], activation="relu", residual=a[3]), x, w, b, r)
    assert "custom_call @jax_hopper" not in text and "dot_general" in text


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradients_match_the_reference_and_run_our_kernel(activation):
    x, w, b, r = layer_operands((64, 48), 80, jnp.float16, seed=1)

    def loss(f):
        return lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2)

    ours = loss(lambda x, w, b, r: jax_hopper.dense(x, w, b, activation=activation, residual=r))
    ref = loss(lambda x, w, b, r: f32_reference(x, w, b, r, activation))
    g_ours = jax.jit(jax.grad(ours, argnums=(0, 1, 2, 3)))(x, w, b, r)
    g_ref = jax.grad(ref, argnums=(0, 1, 2, 3))(x, w, b, r)
    for name, go, gr in zip("x w bias residual".split(), g_ours, g_ref):
        assert go.dtype == jnp.float16, name
        # 16-bit cotangents and operands in every backward product: a few f16 roundings.
        assert relative_error(go, gr.astype(jnp.float32)) < 1e-2, name
    text = cuda_text(jax.grad(ours, argnums=(0, 1)), x, w, b, r)
    assert "dot_general" not in text and text.count("custom_call @jax_hopper_gemm") >= 3


@pytest.mark.parametrize("activation", [None, "relu", "gelu_exact"])
def test_bias_alone_is_differentiable(activation):
    """A bias-only fine-tune (x and w fixed): the bias tangent spans all rows (it was left
    [N]-shaped: grad raised, jvp returned an [N] tangent)."""
    x, w, b, r = layer_operands((32, 16), 24, jnp.float16, seed=4)
    f = lambda bias: jax_hopper.dense(x, w, bias, activation=activation, residual=r)  # noqa: E731
    g = lambda bias: f32_reference(x, w, bias, r, activation)  # noqa: E731
    grad = jax.grad(lambda bias: jnp.sum(f(bias).astype(jnp.float32) ** 2))(b)
    grad_ref = jax.grad(lambda bias: jnp.sum(g(bias) ** 2))(b)
    assert grad.shape == b.shape and relative_error(grad, grad_ref) < 1e-2
    _, dy = jax.jvp(f, (b,), (b,))
    _, dy_ref = jax.jvp(g, (b,), (b,))
    assert dy.shape == (32, 24) and relative_error(dy, dy_ref) < 2e-2


def test_forward_mode():
    x, w, b, r = layer_operands((32, 16), 24, jnp.bfloat16, seed=2)
    tangents = layer_operands((32, 16), 24, jnp.bfloat16, seed=3)
    f = lambda *a: jax_hopper.dense(a[0], a[1], a[2], activation="silu", residual=a[3])  # noqa: E731
    g = lambda *a: f32_reference(*a, "silu")  # noqa: E731
    y, dy = jax.jvp(f, (x, w, b, r), tangents)
    y_ref, dy_ref = jax.jvp(g, (x, w, b, r), tangents)
    assert relative_error(y, y_ref) < 1e-2 and relative_error(dy, dy_ref) < 2e-2


def test_vmap_over_examples_folds_into_one_fused_launch():
    x, w, b, r = layer_operands((6, 32, 64), 128, jnp.float16, seed=4)
    f = jax.vmap(lambda xi, ri: jax_hopper.dense(xi, w, b, activation="relu", residual=ri))
    assert_close_to_reference(jax.jit(f)(x, r), x, w, b, r, "relu")
    with jax_hopper.dispatch("kernel"):
        text = cuda_text(f, x, r)
    assert text.count("custom_call @jax_hopper_gemm_fused") == 1


def test_vmap_over_weights_is_still_right():
    x, w, b, r = layer_operands((32, 64), 48, jnp.float16, seed=5)
    ws = jnp.stack([w, -w])
    out = jax.vmap(lambda wi: jax_hopper.dense(x, wi, b, activation="gelu_exact", residual=r))(ws)
    for i in range(2):
        assert_close_to_reference(out[i], x, ws[i], b, r, "gelu_exact")


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(activation="tanh"), ValueError, "activation"),
    (dict(activation=["relu"]), ValueError, "activation must be None or one of"),  # was "unhashable type"
    (dict(bias=jnp.zeros((7,), jnp.float16)), ValueError, "bias must be"),
    (dict(residual=jnp.zeros((3, 5), jnp.float16)), ValueError, "residual must be"),
    (dict(bias=[1.0] * 8), TypeError, "bias must be a jax or numpy array"),
])
def test_bad_arguments_are_named(kwargs, error, match):
    x, w = jnp.ones((4, 16), jnp.float16), jnp.ones((16, 8), jnp.float16)
    with pytest.raises(error, match=match):
        jax_hopper.dense(x, w, **kwargs)


@pytest.mark.parametrize("bias_shape", [(1, 24), (1, 1, 24)], ids=["1xN", "1x1xN"])
def test_a_bias_with_one_value_per_column_in_another_shape_is_fused(bias_shape):
    """jnp's x @ w + b broadcasts b; [1, N] (as TF/Keras checkpoints store biases) or
    [1, 1, N] against x [B, M, K] is the [N] bias reshaped: the fused layer takes it as
    [N], and its gradient comes back in b's shape."""
    x, w, b, r = layer_operands((2, 16, 32), 24, jnp.float16, seed=8)
    b = b.reshape(bias_shape)

    def layer(x, w, b, r):
        return jax_hopper.dense(x, w, b, activation="gelu_tanh", residual=r)

    with jax_hopper.dispatch("kernel"):
        out = jax.jit(layer)(x, w, b, r)
        as_vector = jax.jit(layer)(x, w, b.reshape(24), r)
        text = cuda_text(layer, x, w, b, r)
        grad = jax.jit(jax.grad(lambda *a: jnp.sum(layer(*a).astype(jnp.float32)), argnums=2))
        db, db_vector = grad(x, w, b, r), grad(x, w, b.reshape(24), r)
    assert out.shape == (2, 16, 24) and bool((out == as_vector).all())
    assert re.findall(r"stablehlo\.custom_call @(\S+)\(", text) == ["jax_hopper_gemm_fused"]
    assert db.shape == b.shape and bool((db.reshape(24) == db_vector).all())


@pytest.mark.parametrize("policy", ["kernel", pytest.param("auto", marks=pytest.mark.slow)])
@pytest.mark.parametrize("bias_shape,residual_shape", [
    ((16, 1), None), ((16, 24), None), ((3, 16, 24), None),  # per row, per element, a larger result
    ((24,), (24,)), ((24,), (1, 24)), ((24,), (3, 1, 24)), ((1, 1, 24), None),  # residual broadcast; more dims
    ((), None), ((1,), None),  # one value for every column
], ids=["rows", "full", "larger", "res_N", "res_1xN", "res_larger", "bias_adds_dims", "scalar", "1"])
def test_other_broadcasts_are_jnps_own_layer(policy, bias_shape, residual_shape):
    """A bias that varies along rows or is broadcast along them, a residual not of the
    product's shape, or operands that broadcast to a larger result: jnp's
    act(x @ w + b) + r, bit for bit, in jnp's result shape, and jnp's bias gradient."""
    x, w, _, _ = layer_operands((16, 32), 24, jnp.float16, seed=9, bias=False, residual=False)
    kb, kr = jax.random.split(jax.random.key(10))
    b = jax.random.normal(kb, bias_shape, jnp.float32).astype(jnp.float16)
    r = None if residual_shape is None else jax.random.normal(kr, residual_shape, jnp.float32).astype(jnp.float16)
    def ours(x, w, b, r):
        return jax_hopper.dense(x, w, b, activation="silu", residual=r)

    def theirs(x, w, b, r):
        return jax.nn.silu(x @ w + b) + (0 if r is None else r)

    def bias_grad(layer):
        return jax.jit(jax.grad(lambda *a: jnp.sum(layer(*a).astype(jnp.float32)), argnums=2))(x, w, b, r)

    with jax_hopper.dispatch(policy):
        out, db = jax.jit(ours)(x, w, b, r), bias_grad(ours)
    mine = jax.jit(theirs)(x, w, b, r)
    assert out.shape == mine.shape and out.dtype == mine.dtype and bool((out == mine).all())
    assert bool((db == bias_grad(theirs)).all())


@pytest.mark.parametrize("scalar", [0.5, 2, np.float32(0.5), np.float16(0.5)], ids=["float", "int", "np32", "np16"])
def test_scalar_bias_and_residual_are_jnps(scalar):
    """jnp's x @ w + 0.5: a Python number is weakly typed (the layer stays 16-bit), a NumPy
    scalar has its own type (an f32 one promotes the layer). jnp's layer, bit for bit."""
    x, w, _, _ = layer_operands((16, 32), 24, jnp.float16, seed=11, bias=False, residual=False)
    for kwargs, theirs in ((dict(bias=scalar), lambda x, w: jax.nn.silu(x @ w + scalar)),
                           (dict(residual=scalar), lambda x, w: jax.nn.silu(x @ w) + scalar)):
        out = jax.jit(lambda x, w: jax_hopper.dense(x, w, activation="silu", **kwargs))(x, w)
        mine = jax.jit(theirs)(x, w)
        assert out.dtype == mine.dtype and out.shape == mine.shape and bool((out == mine).all())
    out = jax_hopper.mlp(x, w, scalar, w.T, scalar, activation="silu", residual=scalar)
    mine = jax.nn.silu(x @ w + scalar) @ w.T + scalar + scalar
    assert out.dtype == mine.dtype and bool((out == mine).all())


@pytest.mark.parametrize("kwargs,match", [
    (dict(bias=jnp.zeros((2, 8), jnp.float16)), r"bias must be \[N\] = \[8\] or broadcast against the result \[4, 8\]"),
    (dict(residual=jnp.zeros((3, 8), jnp.float16)), r"residual must be \[4, 8\] or broadcast"),
    (dict(bias=jnp.zeros((3, 1, 8), jnp.float16), residual=jnp.zeros((2, 1, 8), jnp.float16)),
     r"residual must be .* against the result \[3, 4, 8\]"),
])
def test_shapes_jnp_would_refuse_are_named(kwargs, match):
    x, w = jnp.ones((4, 16), jnp.float16), jnp.ones((16, 8), jnp.float16)
    with pytest.raises(ValueError, match=match):
        jax_hopper.dense(x, w, **kwargs)


def test_mismatched_inner_sizes_and_integerlayer_operands():
    with pytest.raises(ValueError, match=r"x float16\[4, 16\], w float16\[15, 8\]"):
        jax_hopper.dense(jnp.ones((4, 16), jnp.float16), jnp.ones((15, 8), jnp.float16))
    with pytest.raises(TypeError, match="floating-point"):
        jax_hopper.dense(jnp.ones((4, 16), jnp.int32), jnp.ones((16, 8), jnp.int32))


@pytest.mark.parametrize("x_shape,n", [((4, 0), 8), ((0, 16), 8), ((2, 0, 16), 8), ((5, 16), 0)])
def test_empty_dimensions_give_what_jnp_gives(x_shape, n):
    x = jnp.ones(x_shape, jnp.float16)
    w = jnp.ones((x_shape[-1], n), jnp.float16)
    b = jnp.full((n,), 0.5, jnp.float16)
    out = jax.jit(lambda x, w, b: jax_hopper.dense(x, w, b, activation="relu"))(x, w, b)
    expected = jnp.broadcast_to(jax.nn.relu(x @ w + b), x_shape[:-1] + (n,))  # K = 0: act(bias)
    assert out.shape == expected.shape and bool(jnp.all(out == expected))


def test_an_empty_contraction_lowers_to_xla_even_when_the_kernel_is_forced():
    """K = 0: act(bias) (+ residual) with no product; the fused kinds have no zero-fill
    path (their host refuses K = 0), so every fused lowering computes it through XLA."""
    from jax_hopper.primitives.dense_derivative import fused_dense_with_derivative
    from jax_hopper.primitives.dense_grad import fused_activation_grad

    x, w, b = jnp.ones((64, 0), jnp.float16), jnp.ones((0, 64), jnp.float16), jnp.ones((64,), jnp.float16)
    g, w_t, z = jnp.ones((64, 0), jnp.float16), jnp.ones((64, 0), jnp.float16), jnp.ones((64, 64), jnp.float16)
    with jax_hopper.dispatch("kernel"):
        texts = [cuda_text(lambda x, w, b: jax_hopper.dense(x, w, b, activation="gelu_tanh", residual=x @ w), x, w, b),
                 cuda_text(lambda x, w, b: fused_dense_with_derivative(x, w, b, activation="silu"), x, w, b),
                 cuda_text(lambda *a: fused_activation_grad(*a, activation="silu", bias_grad=True), g, w_t, z)]
    for text in texts:
        assert "jax_hopper_gemm_fused" not in text
    dz, db = jax.jit(lambda g, w, z: fused_activation_grad(g, w, z, activation="silu", bias_grad=True))(g, w_t, z)
    assert not bool(jnp.any(dz)) and not bool(jnp.any(db)) and db.shape == (64,)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
def test_mixed_types_are_computed_as_jnp_would(dtype):
    """16-bit x and w with an f32 bias (and residual): jnp multiplies in the 16-bit type,
    rounds, then adds in f32. The layer gives jnp's answer bit for bit, even with the
    kernel forced (the f32 layer type is not the kernel's). (XLA on the CPU keeps a bf16
    x @ w + b in f32, so there only the f16 case tells the two computations apart.)"""
    x, w, b, r = layer_operands((16, 32), 24, dtype, seed=6)
    b, r = b.astype(jnp.float32) + 0.1, r.astype(jnp.float32)  # + 0.1: values no 16-bit type holds
    with jax_hopper.dispatch("kernel"):
        out = jax.jit(lambda x, w, b, r: jax_hopper.dense(x, w, b, activation="silu", residual=r))(x, w, b, r)
        text = cuda_text(lambda x, w, b: jax_hopper.dense(x, w, b), x, w, b)
    mine = jax.jit(lambda x, w, b, r: jax.nn.silu(x @ w + b) + r)(x, w, b, r)  # as a user writes the layer
    assert out.dtype == mine.dtype == jnp.float32 and "custom_call" not in text
    assert bool((out == mine).all())


def test_numpy_operands_of_a_mixed_layer_multiply_as_jnp_does():
    """NumPy f16 x and w with an f32 bias: jnp's product (f32 sums, one f16 rounding), not
    NumPy's f16 matmul on the host (f16 sums, 0.03 apart here)."""
    x, w, b, _ = layer_operands((64, 512), 24, jnp.float16, seed=7, residual=False)
    x_np, w_np, b = np.asarray(x), np.asarray(w), b.astype(jnp.float32)
    out = jax_hopper.dense(x_np, w_np, b)
    assert bool((out == jnp.matmul(x, w) + b).all())


def test_flax_layer_matches_linen_dense_with_the_same_parameters():
    nn = pytest.importorskip("flax.linen", reason="flax is not installed (pip install flax)")
    from jax_hopper.nn import Dense

    x = seed_normal(jax.random.key(6), (8, 16, 64), jnp.float32, 64)
    res = jax.random.normal(jax.random.key(7), (8, 16, 96), jnp.float32).astype(jnp.bfloat16)
    ours = Dense(96, activation="gelu_tanh", dtype=jnp.bfloat16)
    params = ours.init(jax.random.key(8), x)
    ref_layer = nn.Dense(96, dtype=jnp.bfloat16)
    assert jax.tree.structure(params) == jax.tree.structure(ref_layer.init(jax.random.key(8), x))
    out = ours.apply(params, x, res)
    ref = (jax.nn.gelu(ref_layer.apply(params, x).astype(jnp.float32)) + res.astype(jnp.float32))
    assert out.dtype == jnp.bfloat16 and out.shape == (8, 16, 96)
    # flax's reference rounds x @ W + b to bf16 before the GELU; ours rounds once.
    assert relative_error(out, ref) < 1e-2


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_xla_path_is_jnps_own_computation(activation):
    """Where the dispatcher picks XLA, dense computes what the user's jnp would, bit for
    bit (16-bit intermediates, which XLA fuses into cuBLASLt's epilogue)."""
    act = {None: lambda z: z, "relu": jax.nn.relu, "gelu_tanh": jax.nn.gelu,
           "gelu_exact": lambda z: jax.nn.gelu(z, approximate=False), "silu": jax.nn.silu}[activation]
    x, w, b, r = layer_operands((4, 30), 40, jnp.bfloat16, seed=3)
    with jax_hopper.dispatch("xla"):
        out = jax.jit(lambda *a: jax_hopper.dense(a[0], a[1], a[2], activation=activation, residual=a[3]))(x, w, b, r)
    mine = jax.jit(lambda x, w, b, r: act(x @ w + b) + r)(x, w, b, r)  # as a user writes the layer
    assert out.dtype == jnp.bfloat16
    assert bool((out == mine).all())


@pytest.mark.parametrize("activation", ["gelu_tanh", "silu"])
def test_a_layer_the_rules_leave_to_xla_on_its_shards_is_jnps(activation):
    """Under sharding each device's body is _fused._cuda_impl on its shards; where the
    rules picked the fused kind for the whole layer (rules=True) but would not for these
    shapes, the device computes jnp's layer, bit for bit, as the same shapes unsharded do
    (called directly here: this branch emits no custom call, so it runs anywhere)."""
    from jax_hopper._reference import ACTIVATION_FNS
    from jax_hopper.primitives.dense import _cuda_impl

    if not jax_hopper.kernel_available():
        pytest.skip("without the built kernel the impl computes the reference arithmetic first")
    x, w, b, r = layer_operands((48, 64), 32, jnp.float16, seed=5)
    assert not dense_primitive.layer_runs_kernel(x.shape, w.shape, x.dtype, activation)

    def shard(x, w, b, r):
        return _cuda_impl(x, w, b, r, activation=activation, has_bias=True, has_residual=True, rules=True)

    out = jax.jit(shard)(x, w, b, r)
    mine = jax.jit(lambda x, w, b, r: ACTIVATION_FNS[activation](x @ w + b) + r)(x, w, b, r)
    assert out.dtype == mine.dtype and bool((out == mine).all())


def test_a_differentiated_layer_keeps_its_fused_z_where_the_plain_rules_picked_it():
    """Differentiated with an activation and a residual, the layer computes z = x w + b on
    the fused kind where the plain product's rules pick our kernel ("wide-aligned" at
    16384x4096x16384) and the activation through XLA. The fused layer's rules, asked
    again on each device's shards, would answer otherwise for z ("wide-aligned" is not
    theirs), so z is bound as picked: one device keeps the fused launch."""
    f16 = jnp.float16
    m, k, n = 16384, 4096, 16384
    x, w = jax.ShapeDtypeStruct((m, k), f16), jax.ShapeDtypeStruct((k, n), f16)
    b, r = jax.ShapeDtypeStruct((n,), f16), jax.ShapeDtypeStruct((m, n), f16)

    def layer(x, w, b, r):
        return jax_hopper.dense(x, w, b, activation="gelu_tanh", residual=r)

    with jax_hopper.dispatch("auto"):
        text = cuda_text(lambda x, w, b, r: jax.jvp(lambda x: layer(x, w, b, r), (x,), (x,)), x, w, b, r)
    assert sorted(re.findall(r"stablehlo\.custom_call @(\S+)\(", text)) == ["jax_hopper_gemm", "jax_hopper_gemm_fused"]


def test_gradient_where_only_the_activation_picked_the_kernel_is_jnps(monkeypatch):
    """The fused-activation rule picks our kernel for the forward value; its gradient
    cannot use the fused activation, and the plain product is XLA's: the derivative is
    jnp's own, bit for bit. (The rule's size threshold is lowered to reach it here.)"""
    from jax_hopper import _rules
    from jax_hopper._reference import ACTIVATION_FNS

    monkeypatch.setattr(_rules, "FUSED_MIN_DIM", 16)
    x, w, b, r = layer_operands((48, 64), 32, jnp.float16, seed=4)

    def loss(f):
        return lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2)

    ours = loss(lambda x, w, b, r: jax_hopper.dense(x, w, b, activation="silu", residual=r))
    theirs = loss(lambda x, w, b, r: ACTIVATION_FNS["silu"](x @ w + b) + r)
    with jax_hopper.dispatch("auto"):
        text = cuda_text(ours, x, w, b, r)
        assert re.findall(r"custom_call @(\S+)\(", text) == ["jax_hopper_gemm_fused"]
        g_ours = jax.jit(jax.grad(ours, argnums=(0, 1, 2, 3)))(x, w, b, r)
    g_theirs = jax.jit(jax.grad(theirs, argnums=(0, 1, 2, 3)))(x, w, b, r)
    for go, gt in zip(g_ours, g_theirs):
        assert go.dtype == gt.dtype and bool((go == gt).all())


def test_all_weak_operands_give_jnps_weak_result():
    """Weakly typed operands throughout (say, arrays built from Python scalars): jnp's
    act(x @ w + b) is weakly typed, so it does not widen a later f16 operand; ours was
    strong f32."""
    x, w, b = (weak(jax.random.normal(jax.random.key(i), shape), jnp.float32)
               for i, shape in enumerate([(4, 8), (8, 3), (3,)]))
    ours = jax_hopper.dense(x, w, b, activation="relu")
    ref = jax.nn.relu(x @ w + b)
    assert jax.typeof(ours) == jax.typeof(ref) and jax.typeof(ref).weak_type
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))
    h = jnp.ones((4, 3), jnp.float16)
    assert (ours + h).dtype == jnp.float16


@pytest.mark.parametrize("policy", ["kernel", "xla"])
@pytest.mark.parametrize("activation", ["relu", "gelu_tanh", "gelu_exact", "silu"])
def test_gradients_with_the_saved_derivative(activation, policy):
    """dense's saved-derivative form (jax_hopper.mlp's, for a layer on its own): the
    forward writes act(z) and act'(z) and the tangent is act'(z) dz. Forced here for
    every activation: under policy "kernel" one launch of the derivative kind, gradients
    as close to the f32 reference as the default form's (test above) and the value the
    undifferentiated call's; under "xla" (no dense primitive: jnp's own computation,
    derivative included) the scope changes nothing."""
    from jax_hopper import _dispatch

    x, w, b, _ = layer_operands((64, 48), 80, jnp.float16, seed=5)

    def loss(f):
        return lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2)

    layer = lambda x, w, b: jax_hopper.dense(x, w, b, activation=activation)  # noqa: E731
    ref = loss(lambda x, w, b: f32_reference(x, w, b, None, activation))
    with jax_hopper.dispatch(policy), _dispatch.saved_derivative({activation}):
        g_ours = jax.jit(jax.grad(loss(layer), argnums=(0, 1, 2)))(x, w, b)
        y, _ = jax.jit(lambda *a: jax.jvp(layer, a, a))(x, w, b)
        undifferentiated = jax.jit(layer)(x, w, b)
        text = cuda_text(jax.grad(loss(layer), argnums=(0, 1, 2)), x, w, b)
    g_ref = jax.grad(ref, argnums=(0, 1, 2))(x, w, b)
    for name, go, gr in zip("x w bias".split(), g_ours, g_ref):
        assert go.dtype == jnp.float16, name
        assert relative_error(go, gr.astype(jnp.float32)) < 1e-2, name
    # Both round act of the same f32 z once (on the kernel path two kernel kinds, which
    # may order the f32 sums differently): at most one f16 step apart.
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(undifferentiated, np.float32),
                               rtol=2.0**-10, atol=2.0**-24)
    # N = 80, a multiple of 8: under policy "kernel" one launch of the derivative kind.
    assert ("@jax_hopper_gemm_fused_derivative(" in text) == (policy == "kernel")


def test_saved_derivative_by_default_where_the_derivative_kind_runs():
    """By default (policy "auto") dense saves act'(z) for exact GELU, tanh-GELU and SiLU
    where the fused-activation rule runs the derivative kind, and never with a residual
    (that kind does not add one), for ReLU, or on layers too small for the rule."""
    S = jax.ShapeDtypeStruct
    x, w, b, r = S((4096, 4096), jnp.bfloat16), S((4096, 8192), jnp.bfloat16), S((8192,), jnp.bfloat16), \
        S((4096, 8192), jnp.bfloat16)

    def grad_program(activation, residual=None, shapes=(x, w, b)):
        f = lambda x, w, b, *r: jnp.sum(jax_hopper.dense(x, w, b, activation=activation,  # noqa: E731
                                                         residual=r[0] if r else None).astype(jnp.float32))
        with jax_hopper.dispatch("auto"):
            return cuda_text(jax.grad(f, argnums=(0, 1, 2)), *shapes, *([residual] if residual is not None else []))

    assert len(re.findall(r"@jax_hopper_gemm_fused_derivative\(", grad_program("gelu_exact"))) == 1
    assert "jax_hopper_gemm_fused_derivative" not in grad_program("gelu_exact", residual=r)
    for activation in ("gelu_tanh", "silu"):
        assert len(re.findall(r"@jax_hopper_gemm_fused_derivative\(", grad_program(activation))) == 1
    assert "jax_hopper_gemm_fused_derivative" not in grad_program("relu")
    small = (S((256, 128), jnp.bfloat16), S((128, 512), jnp.bfloat16), S((512,), jnp.bfloat16))
    assert "jax_hopper_gemm_fused_derivative" not in grad_program("gelu_exact", shapes=small)


@pytest.mark.parametrize("policy", ["auto", "kernel"])
@pytest.mark.parametrize("activation", [None, "relu", "gelu_tanh"])
def test_operands_the_layer_type_cannot_hold_are_multiplied_as_jnp_does(policy, activation):
    """A 16-bit bias alone sets the layer's type here. jnp multiplies x and w in their own
    types and rounds the sum once; converting them to bf16 first changed them (-299 is
    not a bf16; nor is 1 + 2^-10, a weak f32 built from Python floats) and the answer."""
    act = {None: lambda z: z, "relu": jax.nn.relu, "gelu_tanh": jax.nn.gelu}[activation]
    x = jnp.array([[300, -299], [7, 5]], jnp.int32)
    w = jnp.array([[1, 2], [1, 3]], jnp.int32)
    b = jnp.full((2,), 0.5, jnp.bfloat16)

    def weak_x(b):  # weakly typed f32 operands, as Python scalars make them inside jit
        xx = jnp.concatenate([jnp.broadcast_to(1.0 + 2**-10, (1, 1)), jnp.broadcast_to(-1.0, (1, 1))], 1)
        return xx, jnp.broadcast_to(1.0, (2, 1)), b[:1]

    # int8 converts to f16 exactly, but jnp multiplies an int8 pair as int8 (20 * 20 * 8
    # wraps to -128) before the f16 bias promotes it: converting first gave 3200.
    int8_pair = (jnp.full((2, 8), 20, jnp.int8), jnp.full((8, 2), 20, jnp.int8), jnp.zeros((2,), jnp.float16))
    for operands in [(x, w, b), jax.jit(weak_x)(b), int8_pair]:
        with jax_hopper.dispatch(policy):
            ours = jax.jit(lambda *a: jax_hopper.dense(*a, activation=activation))(*operands)
        ref = jax.jit(lambda x, w, b: act(x @ w + b))(*operands)
        assert ours.dtype == ref.dtype
        np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(ref, np.float32))
