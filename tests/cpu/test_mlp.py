"""jax_hopper.mlp (an MLP block whose backward pass fuses act' into a product's epilogue):
semantics, gradients, lowering, vmap, validation. CPU tests; the kernel's own numerics
are in test_mlp_gpu.py.

Gradients are compared with those of the same block in f32 (f32 operands made from the
same 16-bit values). A 16-bit block cannot match that exactly: jnp's own block rounds
z1, h, the cotangents and every product to 16 bits. The op promises the same roundings
as jnp's block (or fewer: the backward form rounds dh * act'(z1) once), so its error
may be at most ERROR_FACTOR times that of jnp's block on the same inputs (the slack for
a different f32 summation order), while a wrong derivative, a lost bias gradient or a
missing residual path is far outside it.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ACTIVATIONS, F32_ACT, ULP, cuda_text, decided, full_f32, relative_error, seed_normal, slow
from layer_cases import (
    ARGNUMS,
    ERROR_FACTOR,
    assert_as_accurate_as_jnp,
    assert_gradients_as_accurate_as_jnp,
    block_operands,
    grads,
    loss,
    ours,
    plain_block,
)

import jax_hopper
from jax_hopper import _dispatch, _problem
from jax_hopper._reference import activation_derivative, activation_grad_like_jnp, activation_grad_reference
from jax_hopper.primitives.dense_derivative import fused_dense_with_derivative


# Policy "kernel" binds the backward form (on a CPU its reference arithmetic runs).
@pytest.mark.parametrize("policy", ["auto", "kernel"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [pytest.param(jnp.float16, id="f16"), slow(jnp.bfloat16, "bf16")])
def test_gradients(activation, dtype, policy):
    operands = block_operands((2, 40), 24, 72, dtype, seed=3)
    with jax_hopper.dispatch(policy):
        mine = grads(ours(activation), operands)
    assert_gradients_as_accurate_as_jnp(mine, operands, activation)


@pytest.mark.parametrize("policy", ["auto", "kernel"])
@pytest.mark.parametrize("activation", [a for a in ACTIVATIONS if a])
@pytest.mark.parametrize("f", [pytest.param(72, id="F72"), pytest.param(36, id="F36", marks=pytest.mark.slow)])
def test_gradients_with_the_saved_derivative(activation, policy, f):
    """The saved-derivative form (act'(z1) kept instead of z1; the backward multiplies).
    F = 36 is not a multiple of 8: act and act' come from XLA's pass, and the backward
    multiplies in XLA after the product (both kernels need TMA-addressable rows)."""
    operands = block_operands((2, 40), 24, f, jnp.bfloat16, seed=13)
    with jax_hopper.dispatch(policy), _dispatch.saved_derivative({activation}):
        mine = grads(ours(activation), operands)
        text = gradient_program(activation, operands, policy)
    assert_gradients_as_accurate_as_jnp(mine, operands, activation)
    calls = sorted(re.findall(r"stablehlo\.custom_call @(\S+)\(", text))
    if policy == "kernel":
        # forward: act and act' of x w1 + b1 (derivative kind, F72) or the fused x w1 + b1
        # and XLA's pass (F36), then h w2 + b2 + x fused; backward: the multiply form
        # (activation 0, db1 summed in its epilogue; F36: the product dy w2^T and XLA's
        # multiply), h^T dy, x^T dz1, dz1 w1^T.
        forward = ["jax_hopper_gemm_fused_derivative"] if f % 8 == 0 else ["jax_hopper_gemm_fused"]
        dz1 = ["jax_hopper_gemm_fused_grad"] if f % 8 == 0 else ["jax_hopper_gemm"]
        assert calls == sorted(["jax_hopper_gemm"] * 3 + ["jax_hopper_gemm_fused"] + forward + dz1), calls
        if f % 8 == 0:
            assert re.search(r"jax_hopper_gemm_fused_grad\([^\n]*activation = 0 : i32", text), "no multiply form"
    else:  # shapes this small stay on XLA
        assert "jax_hopper_gemm_fused_derivative" not in text


@pytest.mark.parametrize("activation", ["gelu_exact", "gelu_tanh", "silu"])
def test_auto_saves_the_derivative_where_the_derivative_kind_runs(activation):
    """Default: exact GELU, tanh-GELU and SiLU save act'(z1) where the dispatcher runs the
    derivative kind (every dimension >= 4096, K <= 8192: rules fused-activation and
    saved-derivative); ReLU, smaller layers and a longer K keep z1."""
    def structs(width):
        shapes = ((4096, width), (width, 4096), (4096,), (4096, width), (width,))
        return [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]

    text = gradient_program(activation, structs(4096), "auto")
    assert len(re.findall(r"@jax_hopper_gemm_fused_derivative\(", text)) == 1
    wide = gradient_program(activation, structs(8192), "auto")
    assert len(re.findall(r"@jax_hopper_gemm_fused_derivative\(", wide)) == 1
    wider = gradient_program(activation, structs(16384), "auto")
    assert "jax_hopper_gemm_fused_derivative" not in wider
    small = gradient_program(activation, block_operands((256,), 128, 512, jnp.bfloat16), "auto")
    assert "jax_hopper_gemm_fused_derivative" not in small
    assert _dispatch.saves_derivative(activation, True) and not _dispatch.saves_derivative(activation, False)
    assert not _dispatch.saves_derivative("relu", True) and not _dispatch.may_save_derivative("relu")


def test_saved_derivative_dispatch():
    problem = _problem.problem_of((8192, 4096), (4096, 16384), jnp.float16, jnp.float16, False, False)
    assert decided(problem, "auto", op="dense_derivative", activation="gelu_exact") == ("kernel", "fused-activation")
    assert decided(problem, "auto", op="dense_derivative", activation="relu")[0] == "xla"
    assert decided(problem, "kernel", op="dense_derivative", activation="relu") == ("kernel", "policy=kernel")
    assert decided(problem, "xla", op="dense_derivative", activation="silu") == ("xla", "policy=xla")
    # tanh-GELU and SiLU: the fused dense alone stops at K = 4096, the saved form at 8192.
    for activation in ("gelu_tanh", "silu"):
        assert decided(problem, "auto", op="dense_derivative", activation=activation) == ("kernel", "fused-activation")
        k8192 = _problem.problem_of((8192, 8192), (8192, 32768), jnp.bfloat16, jnp.bfloat16, False, False)
        assert decided(k8192, "auto", op="dense_derivative", activation=activation) == ("kernel", "saved-derivative")
        assert decided(k8192, "auto", op="dense", activation=activation) == ("xla", "default")
        k16384 = _problem.problem_of((8192, 16384), (16384, 32768), jnp.float16, jnp.float16, False, False)
        assert decided(k16384, "auto", op="dense_derivative", activation=activation) == (
            "xla", "derivative-kind-not-ahead")
        small_m = _problem.problem_of((2048, 8192), (8192, 32768), jnp.float16, jnp.float16, False, False)
        assert decided(small_m, "auto", op="dense_derivative", activation=activation)[0] == "xla"
    odd = _problem.problem_of((8192, 4096), (4096, 16380), jnp.float16, jnp.float16, False, False)
    assert decided(odd, "kernel", op="dense_derivative", activation="gelu_exact") == (
        "xla", "derivative-width-not-multiple-of-8")


@pytest.mark.parametrize("has_bias", [True, False])
def test_derivative_form_reference_and_vmap(has_bias):
    """The derivative form's values (the reference arithmetic where the kernel cannot run),
    vmapped over x (one call) and over per-example weights (the reference)."""
    x, w1, b1, _, _ = block_operands((3, 10), 16, 40, jnp.float16, seed=21)
    b1 = b1 if has_bias else None
    f = functools.partial(fused_dense_with_derivative, activation="gelu_exact")
    h, d = jax.jit(f)(x, w1, b1)
    z = jnp.einsum("bmk,kn->bmn", x.astype(jnp.float32), w1.astype(jnp.float32), precision="highest")
    z = z + (0 if b1 is None else b1.astype(jnp.float32))
    d_exact = jax.vmap(jax.grad(F32_ACT["gelu_exact"]))(z.ravel()).reshape(z.shape)
    for out, ref in ((h, F32_ACT["gelu_exact"](z)), (d, d_exact)):
        assert out.dtype == jnp.float16
        assert relative_error(out, ref) <= ERROR_FACTOR * relative_error(ref.astype(jnp.float16), ref) + 1e-6
    hv, dv = jax.jit(jax.vmap(lambda x: f(x, w1, b1)))(x)
    np.testing.assert_array_equal(np.asarray(hv), np.asarray(h))
    np.testing.assert_array_equal(np.asarray(dv), np.asarray(d))
    ws = jnp.stack([w1, w1 * 0.5, -w1])
    hw, dw = jax.jit(jax.vmap(lambda x, w: f(x, w, b1)))(x, ws)
    # Per-example weights make XLA run a batched GEMM, whose f32 summation order may differ
    # from the single product's (it did on the H200): an element may then round one f16
    # step the other way, so one ulp (or one subnormal step, 2**-24) apart is the bound.
    for i in range(3):
        hi, di = f(x[i], ws[i], b1)
        for batched, single in ((hw[i], hi), (dw[i], di)):
            np.testing.assert_allclose(np.asarray(batched, np.float32), np.asarray(single, np.float32),
                                       rtol=ULP["float16"], atol=2.0**-24)


def test_value_is_two_fused_dense_layers():
    x, w1, b1, w2, b2 = block_operands((48,), 32, 64, jnp.bfloat16)
    out = jax.jit(ours("gelu_exact"))(x, w1, b1, w2, b2)
    two = jax.jit(lambda x, w1, b1, w2, b2: jax_hopper.dense(
        jax_hopper.dense(x, w1, b1, activation="gelu_exact"), w2, b2, residual=x))(x, w1, b1, w2, b2)
    assert out.dtype == jnp.bfloat16 and out.shape == x.shape
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(two, np.float32))


@pytest.mark.parametrize("b1,b2,residual", [(False, False, False), (True, False, True), (False, True, False)])
def test_optional_operands_and_their_gradients(b1, b2, residual):
    x, w1, bias1, w2, bias2 = block_operands((40,), 24, 56, jnp.float16, seed=5)

    def f(x, w1, bias1, w2, bias2):
        y = jax_hopper.mlp(x, w1, bias1 if b1 else None, w2, bias2 if b2 else None, activation="silu",
                           residual=x if residual else None)
        return 0.5 * jnp.sum(y.astype(jnp.float32) ** 2)

    def g(x, w1, bias1, w2, bias2):
        y = F32_ACT["silu"](x @ w1 + (bias1 if b1 else 0)) @ w2 + (bias2 if b2 else 0) + (x if residual else 0)
        return 0.5 * jnp.sum(y ** 2)

    operands = (x, w1, bias1, w2, bias2)
    mine = jax.jit(jax.grad(f, argnums=ARGNUMS))(*operands)
    with full_f32():
        exact = jax.grad(g, argnums=ARGNUMS)(*[v.astype(jnp.float32) for v in operands])
    for name, m, e, used in zip(("x", "w1", "b1", "w2", "b2"), mine, exact, (True, True, b1, True, b2)):
        if used:  # (an absent bias is not an input of f: its gradient is jax's zeros)
            assert relative_error(m, e) < 2e-2, name  # 16-bit intermediates (see the exact rule above)


def test_vmap_matches_per_example():
    x, w1, b1, w2, b2 = block_operands((3, 16), 24, 40, jnp.float16, seed=7)
    f = jax.vmap(lambda x: jax_hopper.mlp(x, w1, b1, w2, b2, activation="relu", residual=x))
    out = jax.jit(f)(x)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(
            jax_hopper.mlp(x[i], w1, b1, w2, b2, activation="relu", residual=x[i])))
    dx = jax.jit(jax.grad(lambda x: jnp.sum(f(x).astype(jnp.float32))))(x)
    assert dx.shape == x.shape and bool(jnp.isfinite(dx).all())


@pytest.mark.parametrize("saved", [False, True], ids=["z1", "saved_act'"])
@pytest.mark.parametrize("policy", ["auto", "kernel"])
def test_per_example_gradients_of_vectors(policy, saved):
    """vmap of grad with 1-D examples x [D] (the per-example-gradient pattern)."""
    x, w1, b1, w2, b2 = block_operands((4,), 16, 40, jnp.float16, seed=9)

    def per_example(x, w1):
        return jax.grad(lambda x, w1: 0.5 * jnp.sum(jax_hopper.mlp(x, w1, b1, w2, b2, activation="silu",
                                                                   residual=x).astype(jnp.float32) ** 2),
                        argnums=(0, 1))(x, w1)

    with jax_hopper.dispatch(policy), _dispatch.saved_derivative({"silu"} if saved else ()):
        dx, dw1 = jax.jit(jax.vmap(per_example, in_axes=(0, None)))(x, w1)
    assert dx.shape == x.shape and dw1.shape == (4,) + w1.shape
    for i in range(4):
        with full_f32():
            exact = jax.grad(lambda x, w1: 0.5 * jnp.sum((F32_ACT["silu"](x @ w1 + b1.astype(jnp.float32)) @
                                                          w2.astype(jnp.float32) + b2.astype(jnp.float32) + x) ** 2),
                             argnums=(0, 1))(x[i].astype(jnp.float32), w1.astype(jnp.float32))
        assert relative_error(dx[i], exact[0]) < 2e-2 and relative_error(dw1[i], exact[1]) < 2e-2


@pytest.mark.parametrize("saved", [False, True], ids=["z1", "saved_act'"])
@pytest.mark.parametrize("policy", ["auto", "kernel"])
def test_second_order_gradient(policy, saved):
    """grad of grad runs through the backward form's own derivative (its reference's),
    and in the saved-derivative form through the derivative kind's."""
    operands = block_operands((16,), 8, 24, jnp.float16, seed=11)

    def gnorm(block, dtype=None):
        def f(*p):
            g = jax.grad(loss(block), argnums=1)(*p)
            return jnp.sum(g.astype(jnp.float32) ** 2)
        ops = operands if dtype is None else [v.astype(dtype) for v in operands]
        with jax_hopper.dispatch(policy), _dispatch.saved_derivative({"gelu_tanh"} if saved else ()):
            return jax.jit(jax.grad(f, argnums=0))(*ops)

    with full_f32():
        exact = gnorm(plain_block("gelu_tanh"), jnp.float32)
    assert_as_accurate_as_jnp("the gradient's gradient", gnorm(ours("gelu_tanh")), gnorm(plain_block("gelu_tanh")),
                              exact)


@pytest.mark.parametrize("policy", ["auto", "kernel"])
@pytest.mark.parametrize("activation,saved", [(a, False) for a in ACTIVATIONS] + [(a, True) for a in ACTIVATIONS if a],
                         ids=[str(a) for a in ACTIVATIONS] + [f"{a}-saved_act'" for a in ACTIVATIONS if a])
@pytest.mark.parametrize("dtype", [pytest.param(jnp.float16, id="f16"), slow(jnp.bfloat16, "bf16")])
def test_forward_mode(activation, dtype, policy, saved):
    """jax.jvp through the block: its tangent map evaluated forward (dispatched products,
    act' or the saved act'(z1) by XLA), as accurate as jnp's block's jvp (same rule as
    the gradients: the same 16-bit roundings, up to the f32 summation order)."""
    operands = block_operands((2, 40), 24, 72, dtype, seed=21)
    tangents = block_operands((2, 40), 24, 72, dtype, seed=22)
    with jax_hopper.dispatch(policy), _dispatch.saved_derivative({activation} if saved else ()):
        mine = jax.jit(lambda p, t: jax.jvp(ours(activation), p, t))(operands, tangents)
    jnp_own = jax.jit(lambda p, t: jax.jvp(plain_block(activation), p, t))(operands, tangents)
    with full_f32():
        exact = jax.jvp(plain_block(activation), *[[v.astype(jnp.float32) for v in vs] for vs in (operands, tangents)])
    for what, m, j, e in zip(("value", "tangent"), mine, jnp_own, exact):
        assert m.dtype == dtype and m.shape == e.shape
        assert_as_accurate_as_jnp(what, m, j, e)


@pytest.mark.parametrize("moving", range(6), ids=["x", "w1", "b1", "w2", "b2", "residual"])
def test_forward_mode_in_one_operand(moving):
    """One operand moving, the others fixed (their tangents symbolic zeros): the tangent
    map takes only the products that one needs. A residual's tangent is the output's,
    exactly; any other against jnp's block as above."""
    x, w1, b1, w2, b2 = block_operands((40,), 24, 72, jnp.float16, seed=23)
    r = seed_normal(jax.random.key(24), x.shape, x.dtype, 1)
    operands = [x, w1, b1, w2, b2, r]
    tangent = block_operands((40,), 24, 72, jnp.float16, seed=25)[moving] if moving < 5 else -r

    def at(block, dtype):
        def f(v):
            args = [u.astype(dtype) for u in operands]
            args[moving] = v
            return block(*args)
        return f

    def ours_with_residual(x, w1, b1, w2, b2, r):
        return jax_hopper.mlp(x, w1, b1, w2, b2, activation="gelu_tanh", residual=r)

    def jnp_with_residual(x, w1, b1, w2, b2, r):
        return F32_ACT["gelu_tanh"](x @ w1 + b1) @ w2 + b2 + r

    _, mine = jax.jit(lambda v, t: jax.jvp(at(ours_with_residual, jnp.float16), (v,), (t,)))(operands[moving], tangent)
    if moving == 5:
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(tangent))
        return
    _, jnp_own = jax.jvp(at(jnp_with_residual, jnp.float16), (operands[moving],), (tangent,))
    with full_f32():
        _, exact = jax.jvp(at(jnp_with_residual, jnp.float32), (operands[moving].astype(jnp.float32),),
                           (tangent.astype(jnp.float32),))
    assert_as_accurate_as_jnp("tangent", mine, jnp_own, exact)


@pytest.mark.parametrize("saved", [False, True], ids=["z1", "saved_act'"])
@pytest.mark.parametrize("policy", ["auto", "kernel"])
def test_hessian_vector_product(policy, saved):
    """jvp of grad (forward over reverse, the usual Hessian-vector product): the forward
    mode of the backward pass (the backward form's and derivative kind's JVP rules)."""
    operands = block_operands((16,), 8, 24, jnp.float16, seed=27)
    tangents = block_operands((16,), 8, 24, jnp.float16, seed=28)

    def hvp(block, dtype=None):
        cast = (lambda vs: vs) if dtype is None else (lambda vs: [v.astype(dtype) for v in vs])
        g = jax.grad(loss(block), argnums=ARGNUMS)
        with jax_hopper.dispatch(policy), _dispatch.saved_derivative({"silu"} if saved else ()):
            return jax.jit(lambda p, t: jax.jvp(g, p, t)[1])(cast(operands), cast(tangents))

    with full_f32():
        exact = hvp(plain_block("silu"), jnp.float32)
    for name, m, j, e in zip(("x", "w1", "b1", "w2", "b2"), hvp(ours("silu")), hvp(plain_block("silu")), exact):
        assert_as_accurate_as_jnp(f"H v for {name}", m, j, e)


@pytest.mark.parametrize("policy", ["auto", "kernel"])
def test_gradient_of_the_tangent(policy):
    """grad of a function of the jvp's tangent (reverse over forward): the tangent map's
    own JVP rule, as accurate as jnp's block's (the rule above)."""
    operands = block_operands((16,), 8, 24, jnp.float16, seed=31)
    tangents = block_operands((16,), 8, 24, jnp.float16, seed=32)

    def of_tangent(block, dtype):
        def f(*p):
            t = jax.jvp(block, p, tuple(v.astype(dtype) for v in tangents))[1]
            return 0.5 * jnp.sum(t.astype(jnp.float32) ** 2)
        with jax_hopper.dispatch(policy):
            return jax.jit(jax.grad(f, argnums=ARGNUMS))(*[v.astype(dtype) for v in operands])

    with full_f32():
        exact = of_tangent(plain_block("gelu_tanh"), jnp.float32)
    for name, m, j, e in zip(("x", "w1", "b1", "w2", "b2"), of_tangent(ours("gelu_tanh"), jnp.float16),
                             of_tangent(plain_block("gelu_tanh"), jnp.float16), exact):
        if name == "b2":  # the tangent does not depend on b2 (it enters y additively)
            assert not np.asarray(e).any() and not np.asarray(m).any()
            continue
        assert_as_accurate_as_jnp(f"d{name}", m, j, e)


def test_jacfwd_and_hessian():
    """jacfwd (vmap of the tangent map: its batching rule) and hessian (jacfwd of jacrev),
    as accurate as jnp's block's against the same in f32 (the rule above)."""
    x, w1, b1, w2, b2 = block_operands((12,), 8, 16, jnp.float16, seed=29)

    def relu_block(b1, *, dtype, block):
        x_, w1_, w2_, b2_ = (v.astype(dtype) for v in (x, w1, w2, b2))
        return block(x_, w1_, b1, w2_, b2_)

    def jnp_relu(x, w1, b1, w2, b2):
        return F32_ACT["relu"](x @ w1 + b1) @ w2 + b2 + x

    def our_relu(x, w1, b1, w2, b2):
        return jax_hopper.mlp(x, w1, b1, w2, b2, activation="relu", residual=x)

    def half_square(f):
        return lambda b1, **kw: 0.5 * jnp.sum(f(b1, **kw).astype(jnp.float32) ** 2)

    for transform, shape in ((jax.jacfwd, (12, 8, 16)), (jax.hessian, (16, 16))):
        wrap = (lambda f: f) if transform is jax.jacfwd else half_square
        def run(block, dtype):
            return jax.jit(transform(functools.partial(wrap(relu_block), dtype=dtype, block=block)))(b1.astype(dtype))
        mine, jnp_own = run(our_relu, jnp.float16), run(jnp_relu, jnp.float16)
        with full_f32():
            exact = run(jnp_relu, jnp.float32)
        assert mine.shape == shape
        assert_as_accurate_as_jnp(transform.__name__, mine, jnp_own, exact)


def test_a_frozen_bias_gets_no_bias_gradient_summed():
    """Reverse mode transposes the tangent map in the operands being differentiated only:
    with b1 fixed, the backward form sums no db1 (its partial sums' output is empty)."""
    operands = block_operands((256,), 128, 512, jnp.bfloat16)
    with jax_hopper.dispatch("kernel"):
        text = cuda_text(jax.grad(loss(ours("gelu_tanh")), argnums=(0, 1, 3)), *operands)
    assert re.search(r"jax_hopper_gemm_fused_grad\([^\n]*-> \(tensor<256x512xbf16>, tensor<0xf32>, tensor<\d+xui8>\)",
                     text)
    with jax_hopper.dispatch("kernel"):
        text = cuda_text(jax.grad(loss(ours("gelu_tanh")), argnums=(0, 1, 2, 3)), *operands)
    assert re.search(r"jax_hopper_gemm_fused_grad\([^\n]*-> \(tensor<256x512xbf16>, tensor<4x512xf32>, "
                     r"tensor<\d+xui8>\)", text)


def gradient_program(activation, operands, policy):
    """StableHLO (for CUDA) of the block's gradient under `policy`."""
    with jax_hopper.dispatch(policy):
        return cuda_text(jax.grad(loss(ours(activation)), argnums=ARGNUMS), *operands)


@pytest.mark.parametrize("saved", [False, True], ids=["z1", "saved_act'"])
def test_kernel_policy_fuses_the_derivative_into_the_backward_product(saved):
    operands = block_operands((256,), 128, 512, jnp.bfloat16)
    with _dispatch.saved_derivative({"gelu_tanh"} if saved else ()):
        text = gradient_program("gelu_tanh", operands, "kernel")
    calls = re.findall(r"stablehlo\.custom_call @(\S+)\(", text)
    # forward: x w1 + b1 (with act'(z1) in the saved form) and h w2 + b2 + x fused;
    # backward: the backward form (act' from z1, or the multiply by the saved act'; db1
    # summed in its epilogue: a [ceil(256 / 64), 512] f32 partial), h^T dy, x^T dz1 and
    # dz1 w1^T.
    first = "jax_hopper_gemm_fused_derivative" if saved else "jax_hopper_gemm_fused"
    assert sorted(calls) == sorted(["jax_hopper_gemm"] * 3 + [first, "jax_hopper_gemm_fused",
                                                              "jax_hopper_gemm_fused_grad"])
    assert re.search(r"jax_hopper_gemm_fused_grad\([^\n]*-> \(tensor<256x512xbf16>, tensor<4x512xf32>, "
                     r"tensor<\d+xui8>\)", text)
    activation_attr = re.search(r"jax_hopper_gemm_fused_grad\([^\n]*activation = (\d+) : i32", text).group(1)
    assert (activation_attr == "0") == saved  # 0: the multiply form
    assert "dot_general" not in text


def test_auto_policy_runs_the_backward_form_where_measured_ahead():
    """With a bias gradient for the epilogue to sum, every dimension >= 4096 and K <= 8192
    (rule "backward-form-with-bias-gradient"); without one, at K = 16384 (unmeasured) and on
    small layers the product and XLA's pass."""
    def choice(rows, width, hidden, bias_grad):
        problem = _problem.problem_of((rows, width), (hidden, width), jnp.float16, jnp.float16, False, True)
        return decided(problem, "auto", op="activation_grad", activation="gelu_tanh", bias_grad=bias_grad)

    assert choice(8192, 4096, 16384, True) == ("kernel", "backward-form-with-bias-gradient")
    assert choice(4096, 4096, 4096, True) == ("kernel", "backward-form-with-bias-gradient")
    assert choice(8192, 8192, 32768, True) == ("kernel", "backward-form-with-bias-gradient")
    for rows, width, hidden, bias_grad in [(8192, 4096, 16384, False), (8192, 16384, 32768, True),
                                          (2048, 4096, 16384, True), (8192, 4096, 2048, True)]:
        assert choice(rows, width, hidden, bias_grad) == ("xla", "backward-form-slower")
    structs = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((4096, 4096), (4096, 4096), (4096,), (4096, 4096),
                                                                (4096,))]
    text = gradient_program("gelu_tanh", structs, "auto")
    # The backward form with the bias gradient's partial sums, [4096 / 64, 4096] f32.
    assert re.search(r"jax_hopper_gemm_fused_grad\([^\n]*-> \(tensor<4096x4096xbf16>, tensor<64x4096xf32>, "
                     r"tensor<\d+xui8>\)", text)
    small = gradient_program("gelu_tanh", block_operands((256,), 128, 512, jnp.bfloat16), "auto")
    assert "jax_hopper_gemm_fused_grad" not in small


@pytest.mark.parametrize("width", [33, 34])
def test_hidden_width_off_the_tma_multiple_takes_xla_for_the_backward_form(width):
    # The backward form TMA-loads z1 and TMA-stores dz1: rows of a multiple of 8 elements.
    problem = _problem.problem_of((256, 128), (width, 128), jnp.float16, jnp.float16, False, True)
    assert decided(problem, "kernel", op="activation_grad", activation="silu") == (
        "xla", "hidden-width-not-multiple-of-8")
    operands = block_operands((64,), 16, width, jnp.float16)
    assert "jax_hopper_gemm_fused_grad" not in gradient_program("silu", operands, "kernel")
    with jax_hopper.dispatch("kernel"):
        mine = grads(ours("silu"), operands)
    assert_gradients_as_accurate_as_jnp(mine, operands, "silu")


def test_activation_derivatives_are_jax_own():
    z = jnp.linspace(-12.0, 12.0, 97, dtype=jnp.float32)
    for activation in ACTIVATIONS:
        expected = jax.vmap(jax.grad(F32_ACT[activation]))(z)
        np.testing.assert_allclose(activation_derivative(z, activation), expected, rtol=1e-5, atol=1e-6)


def test_backward_form_references_agree():
    kg, kw, kz = jax.random.split(jax.random.key(1), 3)
    g = seed_normal(kg, (2, 20, 32), jnp.bfloat16, 32)
    w = seed_normal(kw, (48, 32), jnp.bfloat16, 32)
    z = (2.0 * jax.random.normal(kz, (2, 20, 48), jnp.float32)).astype(jnp.bfloat16)
    exact = jnp.einsum("bmk,nk->bmn", g.astype(jnp.float32), w.astype(jnp.float32), precision="highest") * \
        jax.vmap(jax.grad(F32_ACT["gelu_exact"]))(z.astype(jnp.float32).ravel()).reshape(z.shape)
    fused = activation_grad_reference(g, w, z, activation="gelu_exact")
    two_pass = activation_grad_like_jnp(g, w, z, activation="gelu_exact")
    assert relative_error(fused, exact) <= ERROR_FACTOR * relative_error(exact.astype(jnp.bfloat16), exact)
    assert relative_error(two_pass, exact) < 2 * 2.0**-8


def test_other_types_are_computed_as_jnp():
    x, w1, b1, w2, b2 = block_operands((8,), 8, 16, jnp.float32)
    np.testing.assert_allclose(jax_hopper.mlp(x, w1, b1, w2, b2, activation="silu"),
                               jax.nn.silu(x @ w1 + b1) @ w2 + b2, rtol=1e-5, atol=1e-5)


MISUSE = [
    (dict(w1=np.zeros((9, 16), np.float16)), ValueError, "needs x"),
    (dict(w2=np.zeros((15, 8), np.float16)), ValueError, "needs x"),
    (dict(b1=np.zeros((15,), np.float16)), ValueError, "b1 must be"),
    (dict(b2=np.zeros((9,), np.float16)), ValueError, "b2 must be"),
    (dict(residual=np.zeros((4, 9), np.float16)), ValueError, "residual must be"),
    (dict(activation="tanh"), ValueError, "activation must be"),
    (dict(x=[[1.0]]), TypeError, "must be a jax or numpy array"),
    (dict(x=np.zeros((4, 8), np.int32), w1=np.zeros((8, 16), np.int32), b1=None, w2=np.zeros((16, 8), np.int32),
          b2=None), TypeError, "floating-point"),
]


@pytest.mark.parametrize("change,error,match", MISUSE, ids=[m[-1].replace(" ", "_") for m in MISUSE])
def test_bad_inputs_are_refused(change, error, match):
    args = dict(x=np.zeros((4, 8), np.float16), w1=np.zeros((8, 16), np.float16), b1=np.zeros((16,), np.float16),
                w2=np.zeros((16, 8), np.float16), b2=np.zeros((8,), np.float16), activation="gelu_tanh",
                residual=None)
    args.update(change)
    with pytest.raises(error, match=match):
        jax_hopper.mlp(args.pop("x"), args.pop("w1"), args.pop("b1"), args.pop("w2"), args.pop("b2"), **args)


def test_biases_with_one_value_per_column_in_another_shape_keep_the_block():
    """b1 [1, F] and b2 [1, N] (as TF/Keras checkpoints store biases) add one value per
    column: the block runs as with [F] and [N] (same program, same values), and their
    gradients come back in their own shapes."""
    x, w1, b1, w2, b2 = block_operands((40,), 24, 72, jnp.float16, seed=41)

    def block(x, w1, b1, w2, b2):
        return jax_hopper.mlp(x, w1, b1, w2, b2, activation="gelu_tanh", residual=x)

    with jax_hopper.dispatch("kernel"):
        grads_of = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(block(*a).astype(jnp.float32)), argnums=ARGNUMS))
        value, grads = grads_of(x, w1, b1[None], w2, b2[None])
        value_vector, grads_vector = grads_of(x, w1, b1, w2, b2)
        text, text_vector = (cuda_text(block, x, w1, b, w2, c) for b, c in ((b1[None], b2[None]), (b1, b2)))
    assert float(value) == float(value_vector)
    calls = re.findall(r"stablehlo\.custom_call @(\S+)\(", text)
    assert calls == re.findall(r"stablehlo\.custom_call @(\S+)\(", text_vector) and calls
    for g, g_vector in zip(grads, grads_vector):
        assert bool((g.reshape(g_vector.shape) == g_vector).all())
    assert grads[2].shape == (1, 72) and grads[4].shape == (1, 24)


@pytest.mark.parametrize("b2_shape,residual_shape", [((40, 1), None), ((24,), (24,)), ((3, 40, 24), None)],
                         ids=["b2_rows", "residual_N", "larger"])
def test_other_broadcasts_are_jnps_own_block(b2_shape, residual_shape):
    """A b2 that varies along rows, a residual broadcast along them, a larger result: jnp's
    block, bit for bit, in jnp's result shape."""
    x, w1, b1, w2, _ = block_operands((40,), 24, 72, jnp.float16, seed=42)
    kb, kr = jax.random.split(jax.random.key(43))
    b2 = jax.random.normal(kb, b2_shape, jnp.float32).astype(jnp.float16)
    r = None if residual_shape is None else jax.random.normal(kr, residual_shape, jnp.float32).astype(jnp.float16)
    with jax_hopper.dispatch("kernel"):
        out = jax.jit(lambda *a: jax_hopper.mlp(*a[:5], activation="silu", residual=a[5]))(x, w1, b1, w2, b2, r)
    mine = jax.jit(lambda x, w1, b1, w2, b2, r: jax.nn.silu(x @ w1 + b1) @ w2 + b2 + (0 if r is None else r))(
        x, w1, b1, w2, b2, r)
    assert out.shape == mine.shape and bool((out == mine).all())


@pytest.mark.parametrize("policy", ["auto", "kernel"])
def test_operands_the_block_type_cannot_hold_are_multiplied_as_jnp_does(policy):
    """Integer x and weights with a bf16 bias: jnp multiplies them as they are (-299 is
    not a bf16); converting them to the block's type first changed the answer."""
    x = jnp.array([[300, -299]], jnp.int32)
    w1 = jnp.array([[1], [1]], jnp.int32)
    b1 = jnp.full((1,), 0.5, jnp.bfloat16)
    w2 = jnp.array([[3]], jnp.int32)
    # An int8 pair converts to f16 exactly, but jnp multiplies it as int8 (wrapping to -128)
    # before the f16 bias promotes it.
    int8_block = (jnp.full((2, 8), 20, jnp.int8), jnp.full((8, 4), 20, jnp.int8), jnp.zeros((4,), jnp.float16),
                  jnp.ones((4, 4), jnp.float16))
    for operands in [(x, w1, b1, w2), int8_block]:
        with jax_hopper.dispatch(policy):
            ours = jax.jit(lambda *a: jax_hopper.mlp(*a, None, activation="relu"))(*operands)
        ref = jax.jit(lambda x, w1, b1, w2: jax.nn.relu(x @ w1 + b1) @ w2)(*operands)
        assert ours.dtype == ref.dtype
        np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(ref, np.float32))
