"""Gradients through our products against jnp's, on CPU (the rules, through the
fallback) and on a Hopper GPU (the kernel in every backward layout).

Tolerance as for the forward product (see test_numerics_gpu.py): each gradient is a
product of 16-bit operands with f32 accumulation rounded to 16 bits, so its relative
error to an f32 reference must be within 1.5x of jnp's own gradient error.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import hopper_devices, relative_error, slow
from jax import lax

import jax_hopper

ERROR_FACTOR = 1.5
BIG = bool(hopper_devices())
M, N, K = (1000, 768, 520) if BIG else (40, 24, 36)
LAYOUTS = {
    "NN": ((M, K), (K, N), (((1,), (0,)), ((), ()))),
    "NT": ((M, K), (N, K), (((1,), (1,)), ((), ()))),
    "TN": ((K, M), (K, N), (((0,), (0,)), ((), ()))),
    "TT": ((K, M), (N, K), (((0,), (1,)), ((), ()))),
    "batched": ((3, M, K), (3, K, N), (((2,), (1,)), ((0,), (0,)))),
}


def _data(key, shapes, dtype):
    ka, kb, kw = jax.random.split(key, 3)
    a = jax.random.normal(ka, shapes[0], jnp.float32).astype(dtype)
    b = jax.random.normal(kb, shapes[1], jnp.float32).astype(dtype)
    return a, b, kw


def _grads(dot_general, a, b, w, dims, preferred=None):
    def loss(x, y):
        c = dot_general(x, y, dims, preferred_element_type=preferred)
        return jnp.sum(c.astype(jnp.float32) * w)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))(a, b)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [pytest.param(jnp.float16, id="f16"), slow(jnp.bfloat16, "bf16")])
@pytest.mark.parametrize("preferred", [None, jnp.float32], ids=["out16", "out32"])
def test_grads_match_jnp(layout, dtype, preferred):
    a_shape, b_shape, dims = LAYOUTS[layout]
    a, b, kw = _data(jax.random.key(hash(layout) % 1000), (a_shape, b_shape), dtype)
    out_shape = jax.eval_shape(lambda x, y: lax.dot_general(x, y, dims), a, b).shape
    w = jax.random.normal(kw, out_shape, jnp.float32)
    ours = _grads(jax_hopper.dot_general, a, b, w, dims, preferred)
    theirs = _grads(lax.dot_general, a, b, w, dims, preferred)
    exact = _grads(lambda x, y, d, preferred_element_type: lax.dot_general(x, y, d, precision="highest"),
                   a.astype(jnp.float32), b.astype(jnp.float32), w, dims)
    for g_ours, g_theirs, g_exact, name in zip(ours, theirs, exact, "ab"):
        assert g_ours.dtype == g_theirs.dtype == dtype and g_ours.shape == g_theirs.shape
        err, err_jnp = relative_error(g_ours, g_exact), relative_error(g_theirs, g_exact)
        # An f32 cotangent is rounded to the operands' type before our kernel uses it
        # (jnp keeps it in f32; an f16 one is scaled by a power of two first, which is
        # exact): one more 16-bit rounding, which at most doubles a rounding-level error.
        allowed = ERROR_FACTOR * err_jnp * (2 if preferred is not None else 1)
        assert err <= allowed, f"d{name}: {err:.3e} vs jnp {err_jnp:.3e}"


@pytest.mark.parametrize("case", ["loss-scaled", "mean-reduced"])
def test_f32_cotangents_of_f16_products_keep_their_range(case):
    """An f32 result of f16 operands gets an f32 cotangent. Rounded to f16 as it is for
    the backward products, a loss-scaled one (past 65504) became inf and a tiny one
    (below f16's smallest subnormal, 2^-24, like a mean over many logits) zero, where
    jnp's gradients are finite and nonzero; it is scaled by a power of two first. The
    data make the checked gradients representable in f16 while the cotangent is not (a
    tiny one times x's 15 rows of O(1) stays subnormal: dx only there, against y ~ 1e3)."""
    scale, x_scale, y_scale, argnums = (1e5, 1e-2, 1e-2, (0, 1)) if case == "loss-scaled" else (1e-8, 1, 1e3, (0,))
    kx, ky, kw = jax.random.split(jax.random.key(3), 3)
    x = (x_scale * jax.random.normal(kx, (3, 5, 8), jnp.float32)).astype(jnp.float16)
    y = (y_scale * jax.random.normal(ky, (8, 64), jnp.float32)).astype(jnp.float16)
    w = jax.random.normal(kw, (3, 5, 64), jnp.float32)

    def grads(matmul):
        loss = lambda a, b: scale * jnp.sum(matmul(a, b, preferred_element_type=jnp.float32) * w)  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=argnums))(x, y)

    ours, theirs = grads(jax_hopper.matmul), grads(jnp.matmul)
    for g_ours, g_theirs, name in zip(ours, theirs, "xy"):
        g_ours, g_theirs = g_ours.astype(jnp.float32), g_theirs.astype(jnp.float32)
        assert bool(jnp.all(jnp.isfinite(g_theirs))) and float(jnp.max(jnp.abs(g_theirs))) > 0, name  # the premise
        # Against jnp's f32 products rounded once to f16: the cotangent's 11-bit rounding
        # and the two gradients' own roundings, each at most 2^-11 of the largest value.
        err = float(jnp.max(jnp.abs(g_ours - g_theirs)) / jnp.max(jnp.abs(g_theirs)))
        assert err <= 2**-9, f"d{name}: {err:.3e}"


def test_a_nan_or_inf_in_an_f16_cotangent_stays_where_jnp_has_it():
    """A nan in one row and an inf in another of an f32 cotangent (values ~1e3, which one
    scale of 2^15 for the non-finite max would push past 65504): the other rows of dx
    stay finite and equal to jnp's within an f16 rounding, the two rows are non-finite
    as jnp's are."""
    kx, ky, kw = jax.random.split(jax.random.key(6), 3)
    x = jax.random.normal(kx, (8, 16), jnp.float32).astype(jnp.float16)
    y = (2.0**-6 * jax.random.normal(ky, (16, 32), jnp.float32)).astype(jnp.float16)
    w = 1e3 * jax.random.normal(kw, (8, 32), jnp.float32)
    w = w.at[1, 3].set(jnp.nan).at[5, 7].set(jnp.inf)

    def dx(matmul):
        loss = lambda a, b: jnp.sum(matmul(a, b, preferred_element_type=jnp.float32) * w)  # noqa: E731
        return jax.jit(jax.grad(loss))(x, y).astype(jnp.float32)

    ours, theirs = dx(jax_hopper.matmul), dx(jnp.matmul)
    finite = jnp.all(jnp.isfinite(theirs), axis=1)
    assert [bool(f) for f in finite] == [i not in (1, 5) for i in range(8)]  # the premise
    assert bool(jnp.all(jnp.isfinite(ours) == jnp.isfinite(theirs)))
    err = jnp.max(jnp.abs(ours - theirs)[finite]) / jnp.max(jnp.abs(theirs)[finite])
    assert float(err) <= 2**-9, float(err)


def _f32_product_vjp(matmul, a, b, ct):
    """The gradients of matmul(a, b) with an f32 result, for the cotangent ct."""
    def f32_product(x, y):
        return matmul(x, y, preferred_element_type=jnp.float32)

    return jax.jit(lambda a, b, c: jax.vjp(f32_product, a, b)[1](c))(a, b, ct)


def test_an_f32_cotangent_of_bf16_products_keeps_16_bits():
    """bf16 x bf16 -> f32: the cotangent is split into two bf16 parts (16 bits together,
    more than the 11 of jax's TF32 product on the GPU). Rounded to bf16 alone, a
    cancelling pair [1 + 2^-10, -1] lost its difference: dA was 0 where jnp's is 2^-10.
    A nan and an inf stay where jnp has them (inf - inf would have put a nan in the low part)."""
    a = jnp.ones((2, 2), jnp.bfloat16)
    b = jnp.ones((2, 2), jnp.bfloat16)
    ct = jnp.array([[1 + 2**-10, -1.0], [jnp.inf, 1.0]], jnp.float32)

    ours, theirs = _f32_product_vjp(jax_hopper.matmul, a, b, ct), _f32_product_vjp(jnp.matmul, a, b, ct)
    for got, want in zip(ours, theirs):
        assert got.dtype == want.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert float(ours[0][0, 0]) == 2**-10


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_an_inf_in_the_other_operand_gives_jnps_inf_not_nan(dtype):
    """An f32 cotangent against an inf of the other operand: jax's one f32 product gives
    inf wherever the cotangent entry is non-zero. The bf16 split multiplied the inf by
    its low part too: 0 for a cotangent exact in bf16 (0 * inf), or of the other sign
    (inf - inf): nan. (An f16 entry below 2^-39 of the largest, which the scale flushes
    to 0, still gives nan there: README.)"""
    a = jnp.array([[1.0, 2.0], [3.0, 4.0]], dtype)
    b = jnp.array([[jnp.inf, 1.0], [1.0, -jnp.inf]], dtype)
    # 1 and 0.25 are exact in bf16; 1 + 2^-9 - 2^-20 splits into a high part 1 + 2^-8
    # and a negative low part.
    ct = jnp.array([[1.0, 0.25], [1 + 2**-9 - 2**-20, 1.0]], jnp.float32)
    ours, theirs = _f32_product_vjp(jax_hopper.matmul, a, b, ct), _f32_product_vjp(jnp.matmul, a, b, ct)
    for got, want in zip(ours, theirs):
        assert got.dtype == want.dtype == dtype
        np.testing.assert_array_equal(jnp.isnan(got), jnp.isnan(want))
        np.testing.assert_array_equal(jnp.isposinf(got), jnp.isposinf(want))
        np.testing.assert_array_equal(jnp.isneginf(got), jnp.isneginf(want))
    assert bool(jnp.all(jnp.isinf(ours[0])))  # the premise: every row of dA meets an inf


def test_an_overflowing_bf16_gradient_is_inf_as_jnps():
    """bf16 x bf16 -> f32 whose gradient overflows f32: jax's product gives inf; the high
    part's product overflowed to inf and the low part's, of the other sign, to -inf: nan."""
    a = jnp.array([[3e38]], jnp.bfloat16)
    b = jnp.array([[1.0]], jnp.bfloat16)
    ct = jnp.array([[1e30]], jnp.float32)
    ours, theirs = _f32_product_vjp(jax_hopper.matmul, a, b, ct), _f32_product_vjp(jnp.matmul, a, b, ct)
    assert bool(jnp.isposinf(theirs[1][0, 0]))  # the premise
    np.testing.assert_array_equal(np.asarray(ours[1], np.float32), np.asarray(theirs[1], np.float32))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("how", ["argument", "config"])
def test_an_explicit_precision_keeps_jaxs_f32_cotangent(dtype, how):
    """An f32 result at precision HIGHEST (an argument, or jax_default_matmul_precision):
    jax multiplies the f32 cotangent in f32. Ours rounded it to 16-bit parts on the
    kernel's path. f16: 1536 rows of 1 + 0.49 * 2^-10 summed to 1536 (jnp: 1537 in f16).
    bf16 (two parts, 16 bits): 1 + 2^-9 + 2^-20 against -(1 + 2^-9) summed to 0 (jnp:
    2^-20)."""
    if dtype == jnp.float16:
        ct = jnp.full((1536, 1), 1 + 0.49 * 2**-10, jnp.float32)  # f16(ct) == 1
    else:
        ct = jnp.array([[1 + 2**-9 + 2**-20], [-(1 + 2**-9)]], jnp.float32)
    a = jnp.ones((ct.shape[0], 1), dtype)
    b = jnp.ones((1, 1), dtype)
    kw = {"precision": "highest"} if how == "argument" else {}

    def db(dot):
        f = lambda a, b: dot(a, b, preferred_element_type=jnp.float32, **kw)  # noqa: E731
        return jax.jit(lambda a, b, c: jax.vjp(f, a, b)[1](c)[1])(a, b, ct)

    with jax.default_matmul_precision("highest") if how == "config" else jax_hopper.dispatch("kernel"):
        ours, theirs = db(jax_hopper.dot), db(jnp.dot)
    assert float(theirs[0, 0]) > float(jnp.sum(ct.astype(dtype).astype(jnp.float32)))  # the premise: jax keeps them
    np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(theirs, np.float32))


def test_a_finite_f32_cotangent_past_bf16s_range_gives_a_finite_gradient():
    """A finite f32 cotangent entry above bf16's largest value (3.39e38) rounded to inf in
    the high part (and put nothing in the low one): dA was inf where jnp's is 2.55e38."""
    a = jnp.full((2, 4), 0.25, jnp.bfloat16)
    b = jnp.full((4, 3), 0.25, jnp.bfloat16)
    ct = jnp.full((2, 3), 3.4e38, jnp.float32)
    ct = ct.at[1, 1].set(-3.4e38)

    ours, theirs = _f32_product_vjp(jax_hopper.matmul, a, b, ct), _f32_product_vjp(jnp.matmul, a, b, ct)
    for got, want in zip(ours, theirs):
        assert bool(jnp.all(jnp.isfinite(want.astype(jnp.float32))))  # the premise
        assert got.dtype == want.dtype == jnp.bfloat16
        # jax's product on the GPU rounds ct to TF32 (10 bits, still finite at 3.4e38):
        # the two may then round to neighbouring bf16 values
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2**-7)


def test_f32_results_of_f16_products_differentiate_twice_like_jnp():
    """The scaled rounding of an f32 cotangent is a computation on that cotangent; its
    own derivatives (a Hessian-vector product, a gradient penalty) are jax's rule's, not
    the rounding's with the scale chosen for another magnitude (which overflowed f16 in
    the HVP and flushed a gradient penalty of 1e-9 to zero). Against jnp's, on the same
    f16 data: within two f16 roundings of each result (2^-9 of the largest)."""
    kx, ky, kv = jax.random.split(jax.random.key(8), 3)
    x = (1e-2 * jax.random.normal(kx, (8, 16), jnp.float32)).astype(jnp.float16)
    y = jax.random.normal(ky, (16, 32), jnp.float32).astype(jnp.float16)
    v = jax.random.normal(kv, (8, 16), jnp.float32).astype(jnp.float16)

    def hvp(matmul):
        loss = lambda x: jnp.sum(matmul(x, y, preferred_element_type=jnp.float32) ** 2) / 2  # noqa: E731
        return jax.jit(lambda x, v: jax.jvp(jax.grad(loss), (x,), (v,)))(x, v)

    def penalty(matmul, scale):
        small = (jax.random.normal(ky, (64, 16), jnp.float32) / 8).astype(jnp.float16)
        loss = lambda x: scale * jnp.sum(matmul(x, small, preferred_element_type=jnp.float32) ** 2)  # noqa: E731
        outer = lambda x: jnp.sum(3e4 * jax.grad(loss)(x).astype(jnp.float32))  # noqa: E731
        return (jax.jit(jax.grad(outer))(jax.random.normal(kx, (16, 64), jnp.float32).astype(jnp.float16)),)

    cases = [("hvp", hvp)] + [(f"penalty {scale:g}", functools.partial(penalty, scale=scale)) for scale in (1e-6, 1e-9)]
    for name, fn in cases:
        for ours, theirs in zip(fn(jax_hopper.matmul), fn(jnp.matmul)):
            ours, theirs = ours.astype(jnp.float32), theirs.astype(jnp.float32)
            assert bool(jnp.all(jnp.isfinite(theirs))) and float(jnp.max(jnp.abs(theirs))) > 0, name  # the premise
            err = float(jnp.max(jnp.abs(ours - theirs)) / jnp.max(jnp.abs(theirs)))
            assert err <= 2**-9, f"{name}: {err:.3e}"


def test_an_empty_f32_result_of_f16_operands_has_empty_gradients():
    a, b = jnp.ones((0, 16), jnp.float16), jnp.ones((16, 8), jnp.float16)
    loss = lambda a, b: jnp.sum(jax_hopper.matmul(a, b, preferred_element_type=jnp.float32))  # noqa: E731
    da, db = jax.jit(jax.grad(loss, argnums=(0, 1)))(a, b)
    assert da.shape == (0, 16) and db.shape == (16, 8) and da.dtype == db.dtype == jnp.float16
    assert not bool(jnp.any(db))


def test_an_f16_cotangent_spanning_f16s_range_keeps_every_row():
    """One cotangent with rows past 65504 (2^17) and rows of 2^-10, 2^27 apart, whose dA
    rows (2^12 and 2^-15 .. 2^-12 with y ~ 2^-6) are all normal f16 values: one power of
    two for the whole cotangent must keep the small rows' 11 bits, not only avoid inf.
    Each row of dA against the f32 reference: the cotangent's rounding and the row's own,
    each at most 2^-11 per element (norm-wise, 2^-10 together, doubled for the sums'
    cancellation)."""
    kx, ky, kw = jax.random.split(jax.random.key(5), 3)
    rows, inner, cols = 16, 24, 32
    x = jax.random.normal(kx, (rows, inner), jnp.float32).astype(jnp.float16)
    y = (2.0**-6 * jax.random.normal(ky, (inner, cols), jnp.float32)).astype(jnp.float16)
    row_scale = jnp.where(jnp.arange(rows) % 2 == 0, 2.0**17, 2.0**-10)[:, None]
    w = row_scale * jax.random.normal(kw, (rows, cols), jnp.float32)
    loss = lambda a, b: jnp.sum(jax_hopper.matmul(a, b, preferred_element_type=jnp.float32) * w)  # noqa: E731
    dx = jax.jit(jax.grad(loss))(x, y).astype(jnp.float32)
    exact = jnp.dot(w, y.astype(jnp.float32).T, precision="highest")
    assert float(jnp.min(jnp.max(jnp.abs(exact), axis=1))) > 2.0**-14  # the premise: normal f16 rows
    assert float(jnp.max(jnp.abs(exact))) < 65504
    err = jnp.linalg.norm(dx - exact, axis=1) / jnp.linalg.norm(exact, axis=1)
    assert float(jnp.max(err)) <= 2**-9, err


@pytest.mark.parametrize("layer", ["dense", "mlp"])
def test_remat_policies_can_save_the_fused_layers_products_by_name(layer):
    """dense's and mlp's forward launches (the derivative kind here: tanh-GELU) name what
    their backward pass keeps, so a names policy saves it instead of launching the
    forward kernel again; with nothing saveable it is launched twice (the premise)."""
    x, w = jnp.ones((16, 32), jnp.bfloat16), jnp.ones((32, 24), jnp.bfloat16)
    b = jnp.ones((24,), jnp.bfloat16)
    if layer == "dense":
        f = lambda x, w, b: jax_hopper.dense(x, w, b, activation="gelu_tanh")  # noqa: E731
    else:
        f = lambda x, w, b: jax_hopper.mlp(x, w, b, w.T, None, activation="gelu_tanh")  # noqa: E731
    loss = lambda x, w, b: jnp.sum(f(x, w, b).astype(jnp.float32))  # noqa: E731

    def forward_launches(policy):
        g = loss if policy is None else jax.checkpoint(loss, policy=policy)
        return str(jax.make_jaxpr(jax.grad(g, argnums=(0, 1, 2)))(x, w, b)).count("jax_hopper_dense_with_derivative")

    names = jax.checkpoint_policies.save_only_these_names(jax_hopper.PRODUCT_NAME)
    assert forward_launches(None) == 1
    assert forward_launches(jax.checkpoint_policies.nothing_saveable) == 2
    assert forward_launches(names) == 1


def test_jvp_and_linearize_match_jnp():
    a_shape, b_shape, dims = LAYOUTS["NT"]
    a, b, _ = _data(jax.random.key(7), (a_shape, b_shape), jnp.float16)
    da, db, _ = _data(jax.random.key(8), (a_shape, b_shape), jnp.float16)
    f_ours = lambda x, y: jax_hopper.dot_general(x, y, dims)  # noqa: E731
    f_theirs = lambda x, y: lax.dot_general(x, y, dims)  # noqa: E731
    _, t_ours = jax.jvp(f_ours, (a, b), (da, db))
    _, t_theirs = jax.jvp(f_theirs, (a, b), (da, db))
    exact = lax.dot_general(da.astype(jnp.float32), b.astype(jnp.float32), dims, precision="highest") + \
        lax.dot_general(a.astype(jnp.float32), db.astype(jnp.float32), dims, precision="highest")
    # Tangent = two rounded products summed: allow both roundings.
    assert relative_error(t_ours, exact) <= 2 * ERROR_FACTOR * relative_error(t_theirs, exact)
    _, lin = jax.linearize(f_ours, a, b)
    assert relative_error(lin(da, db), exact) <= 2 * ERROR_FACTOR * relative_error(t_theirs, exact)


@pytest.mark.parametrize("weights", ["shared", "per-example"])
def test_vmapped_dense_keeps_its_remat_name(weights, capsys):
    """The fused dense's output is named in its JVP; a vmap over per-example weights takes
    the reference arithmetic (no primitive, no JVP rule) and names its output itself, so
    a names-only policy still saves the layer's output instead of recomputing it."""
    x = jnp.ones((3, 16, 32), jnp.float16)
    w = jnp.ones((3, 32, 16) if weights == "per-example" else (32, 16), jnp.float16)
    b = jnp.ones((16,), jnp.float16)
    in_axes = (0, 0 if weights == "per-example" else None)
    layer = jax.vmap(lambda xi, wi: jax_hopper.dense(xi, wi, b), in_axes=in_axes)
    policy = jax.checkpoint_policies.save_only_these_names(jax_hopper.PRODUCT_NAME)
    loss = jax.checkpoint(lambda x, w: jnp.sum(jnp.sin(layer(x, w)).astype(jnp.float32)), policy=policy)
    with jax_hopper.dispatch("kernel"):
        jax.ad_checkpoint.print_saved_residuals(loss, x, w)
    saved = capsys.readouterr().out
    assert f"f16[3,16,16] named '{jax_hopper.PRODUCT_NAME}'" in saved, saved


def test_remat_policies_can_save_our_products_by_name():
    """jax's dot policies match lax.dot_general only; our products carry PRODUCT_NAME so
    a policy can save them (else the backward pass recomputes every product)."""
    x, w = jnp.ones((16, 32), jnp.float16), jnp.ones((32, 8), jnp.float16)

    def products_in_grad(policy):
        f = jax.checkpoint(lambda x, w: jnp.sum(jnp.sin(jax_hopper.matmul(x, w)).astype(jnp.float32)), policy=policy)
        return str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w)).count("jax_hopper_gemm")

    names = jax.checkpoint_policies.save_only_these_names(jax_hopper.PRODUCT_NAME)
    assert products_in_grad(names) == 3  # forward + two backward products, nothing recomputed
    assert products_in_grad(jax.checkpoint_policies.nothing_saveable) == 4
    both = jax.checkpoint_policies.save_from_both_policies(jax.checkpoint_policies.dots_saveable, names)
    assert products_in_grad(both) == 3


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_linear_transpose_of_our_product(dtype):
    """The name is given only where the product is differentiated (jax cannot transpose a
    name): linear_transpose in either operand, grad through it and lax.custom_linear_solve's
    transposed solve (which transposes the matvec) run our products and match jnp's."""
    kx, kw, kc = jax.random.split(jax.random.key(21), 3)
    x = jax.random.normal(kx, (129, 72), jnp.float32).astype(dtype)  # unaligned: our kernel under "auto" too
    w = jax.random.normal(kw, (72, 257), jnp.float32).astype(dtype)
    ct = jax.random.normal(kc, (129, 257), jnp.float32).astype(dtype)
    f32 = lambda v: v.astype(jnp.float32)  # noqa: E731
    exact_x = jnp.dot(f32(ct), f32(w).T, precision="highest")
    exact_w = jnp.dot(f32(x).T, f32(ct), precision="highest")
    with jax_hopper.dispatch("kernel"):
        jaxpr = str(jax.make_jaxpr(lambda c: jax.linear_transpose(lambda v: jax_hopper.matmul(v, w), x)(c))(ct))
        assert "jax_hopper_gemm" in jaxpr and "dot_general" not in jaxpr, jaxpr
        (tx,) = jax.jit(lambda c: jax.linear_transpose(lambda v: jax_hopper.matmul(v, w), x)(c))(ct)
        (tw,) = jax.jit(lambda c: jax.linear_transpose(lambda v: jax_hopper.matmul(x, v), w)(c))(ct)
        # One rounded product each (K = 257 and 129 here): jnp's error bound, with its factor.
        (jx,) = jax.linear_transpose(lambda v: jnp.matmul(v, w), x)(ct)
        (jw,) = jax.linear_transpose(lambda v: jnp.matmul(x, v), w)(ct)
        assert tx.dtype == tw.dtype == dtype
        assert relative_error(tx, exact_x) <= ERROR_FACTOR * max(relative_error(jx, exact_x), 2.0**-11)
        assert relative_error(tw, exact_w) <= ERROR_FACTOR * max(relative_error(jw, exact_w), 2.0**-11)

        # grad of a loss of the transposed map: the transpose of the transpose is our product again.
        def loss(c, product):
            (y,) = jax.linear_transpose(lambda v: product(v, w), x)(c)
            return jnp.sum(jnp.sin(y.astype(jnp.float32)))
        g = jax.grad(loss)(ct, jax_hopper.matmul)
        g_jnp = jax.grad(loss)(ct, jnp.matmul)
        g_exact = jnp.dot(jnp.cos(exact_x), f32(w), precision="highest")
        assert relative_error(g, g_exact) <= 2 * ERROR_FACTOR * max(relative_error(g_jnp, g_exact), 2.0**-11)

        # custom_linear_solve's transposed solve (reverse mode in its right-hand side) uses
        # the matvec's linear_transpose. A diagonal solve keeps the answer exact to check.
        a = jnp.eye(72, dtype=dtype) * 2
        b = f32(ct[:72, :8])

        def solve(b):
            matvec = lambda v: jax_hopper.matmul(a, v.astype(dtype)).astype(jnp.float32)  # noqa: E731
            diag = lambda _, r: r / 2  # noqa: E731
            return lax.custom_linear_solve(matvec, b, solve=diag, transpose_solve=diag)
        gb = jax.grad(lambda b: jnp.sum(solve(b) * b))(b)
        np.testing.assert_allclose(np.asarray(gb), np.asarray(b), rtol=2.0**-8)


def _lm_head_loss(dot, labels):
    """Mean cross-entropy of f32 logits h W (an LM head, as mixed-precision models write it)."""
    def loss(h, w):
        logits = dot(h, w, preferred_element_type=jnp.float32)
        picked = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)
    return loss


def _dot_operand_types(text):
    """The operand types of each dot_general in StableHLO text."""
    return [re.search(r": \((tensor<[^>]*>), (tensor<[^>]*>)\)", line).groups()
            for line in text.splitlines() if "stablehlo.dot_general" in line]


def test_f32_logits_left_to_xla_take_the_rounded_backward(monkeypatch):
    """Under "auto" an f32 result of f16 operands that the dispatcher leaves to XLA is
    jnp's product, differentiated by our rule: the backward products multiply the
    cotangent rounded to f16 (scaled), not jax's mixed f32 x f16 dot (TF32 on the GPU).
    Off a Hopper the same path is taken with the GPU's presence simulated. Gradients
    against an f32 reference: within the 16-bit product bound of jnp's own error,
    doubled, as in test_grads_match_jnp, for the cotangent's rounding."""
    if not hopper_devices():
        monkeypatch.setattr(jax_hopper._ffi, "hopper_gpus_visible", lambda: True)
        monkeypatch.setattr(jax_hopper._ffi, "kernel_unavailable_reason", lambda: None)
    tokens, d_model, vocab = (256, 512, 1000) if BIG else (32, 48, 40)
    kh, kw, kl = jax.random.split(jax.random.key(11), 3)
    h = jax.random.normal(kh, (tokens, d_model), jnp.float32).astype(jnp.float16)
    w = (jax.random.normal(kw, (d_model, vocab), jnp.float32) / d_model**0.5).astype(jnp.float16)
    labels = jax.random.randint(kl, (tokens,), 0, vocab)
    with jax_hopper.dispatch("auto"):
        assert jax_hopper.dispatch_path(h, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)[0] == \
            "xla"
        grad = jax.jit(jax.grad(_lm_head_loss(jax_hopper.dot, labels), argnums=(0, 1)))
        types = _dot_operand_types(grad.lower(h, w).as_text())
        ours = grad(h, w)
    jnp_grad = jax.jit(jax.grad(_lm_head_loss(jnp.dot, labels), argnums=(0, 1)))
    assert any("xf32>" in t for pair in _dot_operand_types(jnp_grad.lower(h, w).as_text()) for t in pair)  # premise
    assert len(types) == 3 and all(t.endswith("xf16>") for pair in types for t in pair), types
    theirs = jnp_grad(h, w)
    exact = jax.jit(jax.grad(_lm_head_loss(functools.partial(jnp.dot, precision="highest"), labels),
                             argnums=(0, 1)))(h.astype(jnp.float32), w.astype(jnp.float32))
    for g_ours, g_theirs, g_exact, name in zip(ours, theirs, exact, "hw"):
        assert g_ours.dtype == jnp.float16
        err, err_jnp = relative_error(g_ours, g_exact), relative_error(g_theirs, g_exact)
        assert err <= 2 * ERROR_FACTOR * err_jnp, f"d{name}: {err:.3e} vs jnp {err_jnp:.3e}"


def test_f32_logits_left_to_xla_are_jnps_product_to_other_transforms(monkeypatch):
    """That path's product is jnp's own (only its reverse-mode rule is ours): a remat dot
    policy saves it as jnp's, jvp gives jnp's tangent exactly, linear_transpose works
    (the previous binding of our primitive broke both of the former)."""
    if not hopper_devices():
        monkeypatch.setattr(jax_hopper._ffi, "hopper_gpus_visible", lambda: True)
        monkeypatch.setattr(jax_hopper._ffi, "kernel_unavailable_reason", lambda: None)
    kh, kw = jax.random.split(jax.random.key(12))
    h = jax.random.normal(kh, (32, 48), jnp.float32).astype(jnp.float16)
    w = jax.random.normal(kw, (48, 40), jnp.float32).astype(jnp.float16)
    with jax_hopper.dispatch("auto"):
        def products(dot):
            loss = lambda h, w: jnp.sum(jnp.tanh(dot(h, w, preferred_element_type=jnp.float32)))  # noqa: E731
            saved = jax.checkpoint(loss, policy=jax.checkpoint_policies.dots_saveable)
            jaxpr = str(jax.make_jaxpr(jax.grad(saved, argnums=(0, 1)))(h, w))
            return jaxpr.count("dot_general[") + jaxpr.count("jax_hopper_gemm[")

        assert products(jax_hopper.dot) == products(jnp.dot) == 3  # nothing recomputed
        f32_dot = functools.partial(jax_hopper.dot, preferred_element_type=jnp.float32)
        _, t_ours = jax.jvp(f32_dot, (h, w), (h, w))
        _, t_jnp = jax.jvp(functools.partial(jnp.dot, preferred_element_type=jnp.float32), (h, w), (h, w))
        np.testing.assert_array_equal(np.asarray(t_ours), np.asarray(t_jnp))
        ct = jnp.ones((32, 40), jnp.float32)
        (lt,) = jax.linear_transpose(lambda x: f32_dot(x, w), h)(ct)
        (lt_jnp,) = jax.linear_transpose(lambda x: jnp.dot(x, w, preferred_element_type=jnp.float32), h)(ct)
        assert lt.dtype == lt_jnp.dtype == jnp.float16
        assert relative_error(lt, lt_jnp) <= 2**-10


def test_off_the_gpu_f32_logits_keep_jaxs_rule():
    """Without a Hopper GPU (jax's f32 dot keeps 24 bits there), or under an explicit
    precision, "auto" leaves an f32 result of f16 operands entirely to jax."""
    h, w = jnp.ones((8, 16), jnp.float16), jnp.ones((16, 24), jnp.float16)
    labels = jnp.zeros((8,), jnp.int32)
    cases = [jax_hopper.dot] if not hopper_devices() else []
    cases.append(functools.partial(jax_hopper.dot, precision="highest"))
    with jax_hopper.dispatch("auto"):
        for dot in cases:
            jaxpr = str(jax.make_jaxpr(jax.grad(_lm_head_loss(dot, labels), argnums=(0, 1)))(h, w))
            assert "jax_hopper_gemm" not in jaxpr, jaxpr
