"""dot_general / dot / matmul as drop-ins: property-based comparison with jax.

On CPU this exercises the dimension-number planning, the primitive's rules and the
fallback; on a Hopper GPU (same tests, larger sizes) it compares our kernel with
lax.dot_general (cuBLAS) on the same inputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ULP, assert_same_product, cuda_text, hopper_devices, relative_error, weak
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax

import jax_hopper

ON_HOPPER = bool(hopper_devices())
MAX_DIM = 300 if ON_HOPPER else 6
KERNEL_DTYPES = [jnp.float16, jnp.bfloat16]


@st.composite
def dot_general_cases(draw):
    """Random operand shapes, dimension numbers and dimension orders."""
    nb = draw(st.integers(0, 2))
    nc = draw(st.integers(0, 2))
    nl = draw(st.integers(0, 2))
    nr = draw(st.integers(0, 2))
    size = st.integers(0, MAX_DIM) if draw(st.booleans()) else st.integers(1, MAX_DIM)
    small = st.integers(1, 3)  # keep batch and multi-dim products small
    batch = [draw(small) for _ in range(nb)]
    contract = [draw(size if nc == 1 else small) for _ in range(nc)]
    lfree = [draw(size if nl == 1 else small) for _ in range(nl)]
    rfree = [draw(size if nr == 1 else small) for _ in range(nr)]
    # Place each group of dims at random positions of each operand.
    lhs_roles = [("b", i) for i in range(nb)] + [("c", i) for i in range(nc)] + [("f", i) for i in range(nl)]
    rhs_roles = [("b", i) for i in range(nb)] + [("c", i) for i in range(nc)] + [("f", i) for i in range(nr)]
    if draw(st.booleans()):  # common layouts often, arbitrary orders too
        lhs_roles = draw(st.permutations(lhs_roles))
        rhs_roles = draw(st.permutations(rhs_roles))
    lhs_shape = [(batch if r == "b" else contract if r == "c" else lfree)[i] for r, i in lhs_roles]
    rhs_shape = [(batch if r == "b" else contract if r == "c" else rfree)[i] for r, i in rhs_roles]
    lc = tuple(lhs_roles.index(("c", i)) for i in range(nc))
    rc = tuple(rhs_roles.index(("c", i)) for i in range(nc))
    lb = tuple(lhs_roles.index(("b", i)) for i in range(nb))
    rb = tuple(rhs_roles.index(("b", i)) for i in range(nb))
    dtype = draw(st.sampled_from(KERNEL_DTYPES))
    preferred = draw(st.sampled_from([None, None, jnp.float32]))
    return tuple(lhs_shape), tuple(rhs_shape), ((lc, rc), (lb, rb)), dtype, preferred


def _random(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _check_dot_general(case, seed):
    lhs_shape, rhs_shape, dims, dtype, preferred = case
    ka, kb = jax.random.split(jax.random.key(seed))
    lhs, rhs = _random(ka, lhs_shape, dtype), _random(kb, rhs_shape, dtype)
    ours = jax.jit(lambda x, y: jax_hopper.dot_general(x, y, dims, preferred_element_type=preferred))(lhs, rhs)
    try:
        theirs = lax.dot_general(lhs, rhs, dims, preferred_element_type=preferred)
    except jax.errors.JaxRuntimeError as e:
        # XLA:CPU's dot lacks some bf16 x bf16 -> f32 layouts (lhs [4, 2], rhs [4, 3, 3],
        # contracting dim 0 of both). The same product of the same values widened to f32
        # first is exact in its inputs, so it stands in for jax's own.
        if "Unsupported element type" not in str(e):
            raise
        theirs = lax.dot_general(lhs.astype(jnp.float32), rhs.astype(jnp.float32), dims).astype(preferred or dtype)
    assert_same_product(ours, theirs, lhs, rhs, dims)


@settings(max_examples=25 if ON_HOPPER else 30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=dot_general_cases(), seed=st.integers(0, 2**31 - 1))
def test_dot_general_matches_lax(case, seed):
    _check_dot_general(case, seed)


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=dot_general_cases(), seed=st.integers(0, 2**31 - 1))
def test_dot_general_matches_lax_on_many_more_draws(case, seed):
    _check_dot_general(case, seed)


@pytest.mark.parametrize("a_shape,b_shape", [
    ((5, 7), (7, 3)), ((7,), (7, 3)), ((5, 7), (7,)), ((7,), (7,)), ((2, 5, 7), (7, 3)), ((2, 3, 5, 7), (7, 4)),
    ((2, 5, 7), (2, 7, 3)), ((1, 5, 7), (4, 7, 3)), ((5, 7), (4, 7, 3)), ((4, 1, 5, 7), (3, 7, 2)),
])
@pytest.mark.parametrize("fn", ["dot", "matmul"])
def test_dot_and_matmul_follow_jnp(a_shape, b_shape, fn):
    ka, kb = jax.random.split(jax.random.key(len(a_shape) * 10 + len(b_shape)))
    a, b = _random(ka, a_shape, jnp.float16), _random(kb, b_shape, jnp.float16)
    ours = jax.jit(getattr(jax_hopper, fn))(a, b)
    theirs = getattr(jnp, fn)(a, b)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(theirs, np.float32), rtol=2**-9, atol=2**-9)


@pytest.mark.parametrize("dtypes,preferred", [
    ((jnp.float32, jnp.float32), None), ((jnp.int32, jnp.int32), None), ((jnp.float16, jnp.bfloat16), None),
    ((jnp.float16, jnp.float32), None), ((jnp.int8, jnp.int8), jnp.int32), ((jnp.float16, jnp.float16), jnp.int32),
])
def test_other_dtypes_are_computed_by_jax(dtypes, preferred):
    a = (jnp.arange(12).reshape(3, 4) % 5).astype(dtypes[0])
    b = (jnp.arange(20).reshape(4, 5) % 3).astype(dtypes[1])
    for ours_fn, ref_fn in [(jax_hopper.dot, jnp.dot), (jax_hopper.matmul, jnp.matmul)]:
        ours = jax.jit(lambda x, y: ours_fn(x, y, preferred_element_type=preferred))(a, b)
        ref = ref_fn(a, b, preferred_element_type=preferred)
        assert ours.dtype == ref.dtype
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))


@pytest.mark.parametrize("preferred", [None, jnp.float32])
def test_mixed_16_bit_and_integer_promotes_like_jnp_and_runs_the_kernel(preferred):
    """int8 converts exactly to f16 (and to an f32 result type, lax's conversion), so the
    product is ours either way."""
    a = jnp.ones((16, 32), jnp.float16)
    b = jnp.ones((32, 8), jnp.int8)
    fn = functools.partial(jax_hopper.dot, preferred_element_type=preferred)
    text = jax.jit(fn).trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @jax_hopper_gemm" in text
    assert fn(a, b).dtype == jnp.dot(a, b, preferred_element_type=preferred).dtype == (preferred or jnp.float16)


@pytest.mark.parametrize("x,w,preferred", [
    (jnp.ones((2, 4), jnp.bfloat16), jnp.full((4, 3), 257, jnp.int16), jnp.float32),  # 257 is not a bf16
    (jnp.ones((2, 4), jnp.float16), jnp.full((4, 3), 100000, jnp.int32), jnp.float32),  # past f16's range
    (jnp.full((2, 4), 1.7, jnp.float16), jnp.full((4, 3), 1.7, jnp.float32), jnp.int32),  # lax truncates first
    (jnp.full((2, 4), 1.7, jnp.float16), jnp.full((4, 3), 1.7, jnp.float32), None),
    (jnp.full((2, 4), 1.7, jnp.float16), jnp.full((4, 3), 1.5, jnp.float8_e4m3fn), jnp.float32),  # no promotion
    (jnp.full((2, 4), -3, jnp.int8), jnp.full((4, 3), 300, jnp.uint16), jnp.float16),  # int32 pair, f16 result
    (jnp.full((2, 4), -3, jnp.int16), jnp.full((4, 3), 300, jnp.uint16), jnp.bfloat16),
], ids=["bf16-int16", "f16-int32", "int-result", "f16-f32", "f16-f8", "int8-uint16-f16", "int16-uint16-bf16"])
def test_mixed_operands_are_multiplied_as_jnp_does(x, w, preferred):
    # jnp.dot / matmul hand mixed operands to lax.dot_general as they are. Converting
    # both to the promoted type first (int16 -> bf16, int32 -> f16) changed values, and
    # an integer result truncates the operands before the product in lax, not after.
    # Pairs that jax does not promote (f16 x float8) are fine for jnp when the result
    # type is given, and an integer pair widened to int32 could not be accumulated into
    # an f16 result: both raised here.
    for ours_fn, ref_fn in [(jax_hopper.dot, jnp.dot), (jax_hopper.matmul, jnp.matmul)]:
        ours = jax.jit(lambda a, b: ours_fn(a, b, preferred_element_type=preferred))(x, w)
        ref = ref_fn(x, w, preferred_element_type=preferred)
        assert ours.dtype == ref.dtype
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))


def test_strict_promotion_with_a_result_type_works_like_jnp():
    x = jnp.full((2, 4), 1.7, jnp.float16)
    w = jnp.full((4, 3), 1.3, jnp.float32)
    with jax.numpy_dtype_promotion("strict"):
        for ours_fn, ref_fn in [(jax_hopper.dot, jnp.dot), (jax_hopper.matmul, jnp.matmul)]:
            ours = jax.jit(lambda a, b: ours_fn(a, b, preferred_element_type=jnp.float32))(x, w)
            ref = ref_fn(x, w, preferred_element_type=jnp.float32)
            assert ours.dtype == ref.dtype
            np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))


def test_accepts_out_sharding_keyword_like_lax():
    a = jnp.ones((4, 8), jnp.bfloat16)
    b = jnp.ones((8, 2), jnp.bfloat16)
    out = jax_hopper.dot_general(a, b, (((1,), (0,)), ((), ())), out_sharding=None)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.full((4, 2), 8.0, np.float32))


def test_zero_size_dimensions_match_jnp():
    for a_shape, b_shape in [((0, 8), (8, 4)), ((4, 0), (0, 4)), ((4, 8), (8, 0)), ((0, 4, 8), (0, 8, 2)),
                             ((2, 3, 0), (0, 4)), ((2, 0, 5), (5, 4)), ((0, 3, 5), (5, 4))]:
        a, b = jnp.ones(a_shape, jnp.float16), jnp.ones(b_shape, jnp.float16)
        ours, ref = jax.jit(jax_hopper.matmul)(a, b), jnp.matmul(a, b)
        assert ours.shape == ref.shape
        np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(ref, np.float32))
        # Their gradients (x [..., K] @ W contracts the leading dims in dW) and vmap over W.
        loss = lambda x, y: jnp.sum(jax_hopper.matmul(x, y).astype(jnp.float32))  # noqa: E731
        grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(a, b)
        assert [g.shape for g in grads] == [a.shape, b.shape]
        stacked = jnp.stack([b, b])
        assert jax.vmap(lambda y: jax_hopper.matmul(a, y))(stacked).shape == (2,) + ref.shape


def _weak_f32(shape):
    return jnp.full(shape, 0.02)  # a Python float fill: f32, weakly typed


def test_a_weak_operand_does_not_widen_the_result_nor_lose_its_bits():
    """jnp types the pair jointly: bf16 x a weak f32 array is bf16 (promoting each operand
    on its own widened it to f32). But jnp multiplies the weak f32 values as they are:
    rounding them to bf16 for our kernel changed the product (1.001 -> 1.0 below), so
    such a pair is jnp's own product. A weak 16-bit operand (exact in the pair's type)
    still runs the kernel."""
    x = jnp.ones((16, 32), jnp.bfloat16)
    w = _weak_f32((32, 8)) * 1.001
    assert w.weak_type
    for ours_fn, ref_fn in [(jax_hopper.dot, jnp.dot), (jax_hopper.matmul, jnp.matmul)]:
        ours, ref = ours_fn(x, w), ref_fn(x, w)
        assert (ours.dtype, ours.weak_type) == (ref.dtype, ref.weak_type) == (jnp.bfloat16, False)
        ours32, ref32 = (f(x, w, preferred_element_type=jnp.float32) for f in (ours_fn, ref_fn))
        np.testing.assert_array_equal(np.asarray(ours32), np.asarray(ref32))
        with jax_hopper.dispatch("kernel"):
            assert TARGET_CALL in cuda_text(lambda a, b: ours_fn(a, b), x, weak(w, jnp.bfloat16))
        # A weak vector operand too.
        assert ours_fn(x, _weak_f32((32,))).dtype == ref_fn(x, _weak_f32((32,))).dtype


def test_weakly_typed_results_stay_weak_like_jax():
    w = _weak_f32((8, 8))
    for ours_fn, ref_fn in [(jax_hopper.dot, jnp.dot), (jax_hopper.matmul, jnp.matmul)]:
        ours, ref = ours_fn(w, w), ref_fn(w, w)
        assert (ours.dtype, ours.weak_type) == (ref.dtype, ref.weak_type)
    # Two weak 16-bit operands of dot_general (only jax internals make them): jax's weak
    # result, not the primitive's strong one.
    h = weak(w, jnp.bfloat16)
    assert h.weak_type
    dn = (((1,), (0,)), ((), ()))
    with jax_hopper.dispatch("kernel"):
        ours, ref = jax_hopper.dot_general(h, h, dn), jax.lax.dot_general(h, h, dn)
        assert (ours.dtype, ours.weak_type) == (ref.dtype, ref.weak_type) == (jnp.bfloat16, True)


@pytest.mark.parametrize("preset", ["BF16_BF16_F32", "F16_F16_F32", "TF32_TF32_F32"])
def test_algorithm_preset_names_are_left_to_jax(preset):
    """An algorithm named by string is an explicit algorithm, not a precision level:
    jax itself computes it (or refuses it on this platform), never our kernel."""
    a = jnp.ones((16, 32), jnp.float16)
    b = jnp.ones((32, 8), jnp.float16)
    with jax_hopper.dispatch("kernel"):
        assert jax_hopper.dispatch_path(a, b, (((1,), (0,)), ((), ())), precision=preset)[0] == "jax"
        text = cuda_text(lambda x, y: jax_hopper.dot(x, y, precision=preset, preferred_element_type=jnp.float32),
                         a, b)
        assert TARGET_CALL not in text
    # Precision levels spelled as strings still run the kernel.
    with jax_hopper.dispatch("kernel"):
        assert TARGET_CALL in cuda_text(lambda x, y: jax_hopper.dot(x, y, precision="highest"), a, b)


@pytest.mark.parametrize("config", ["BF16_BF16_F32", "ANY_F8_ANY_F8_F32"])
def test_an_algorithm_as_the_default_matmul_precision_is_left_to_jax(config):
    """jax_default_matmul_precision applies where no precision is given: naming an
    algorithm there (jax rounds f16 operands to bf16 for BF16_BF16_F32, and refuses them
    for an f8 one) leaves products and layers to jax, as an explicit one does."""
    a = jnp.ones((16, 32), jnp.float16)
    b = jnp.ones((32, 8), jnp.float16)
    bias = jnp.ones((8,), jnp.float16)
    with jax_hopper.dispatch("kernel"):
        for level in (None, "highest", "tensorfloat32"):  # levels: still our kernel
            with jax.default_matmul_precision(level):
                assert TARGET_CALL in cuda_text(jax_hopper.dot, a, b)
        with jax.default_matmul_precision(config):
            assert jax_hopper.dispatch_path(a, b, (((1,), (0,)), ((), ())))[0] == "jax"
            for f in (jax_hopper.dot, lambda x, w: jax_hopper.dense(x, w, bias, activation="relu"),
                      lambda x, w: jax_hopper.mlp(x, w, None, w.T, None, activation="relu")):
                try:
                    text = cuda_text(f, a, b)
                except ValueError as err:  # jax's own refusal (an f8 algorithm with f16 operands)
                    assert "float8" in str(err) or "f8" in str(err).lower(), err
                    continue
                assert "jax_hopper" not in text


@pytest.mark.parametrize("fn", ["dot_general", "dispatch_path"])
def test_integer_dimension_numbers_are_accepted_like_lax(fn):
    """lax.dot_general takes an int for a one-dim entry of its dimension numbers."""
    a = seed_normal_like((4, 8))
    b = seed_normal_like((8, 3))
    for dn in [((1, 0), ((), ())), ((1, (0,)), ((), ())), (((1,), 0), ((), ()))]:
        with jax_hopper.dispatch("kernel"):
            if fn == "dispatch_path":
                assert jax_hopper.dispatch_path(a, b, dn)[0] in ("kernel", "xla")
                continue
            assert TARGET_CALL in cuda_text(lambda x, y: jax_hopper.dot_general(x, y, dn), a, b)
            ours = jax.jit(lambda x, y: jax_hopper.dot_general(x, y, dn))(a, b)
        assert_same_product(ours, lax.dot_general(a, b, dn), a, b, (((1,), (0,)), ((), ())))
    batched_a, batched_b = seed_normal_like((2, 4, 8)), seed_normal_like((2, 8, 3))
    with jax_hopper.dispatch("kernel"):
        ours = jax.jit(lambda x, y: jax_hopper.dot_general(x, y, ((2, 1), (0, 0))))(batched_a, batched_b)
    assert_same_product(ours, lax.dot_general(batched_a, batched_b, ((2, 1), (0, 0))), batched_a, batched_b,
                        (((2,), (1,)), ((0,), (0,))))


def seed_normal_like(shape):
    return jax.random.normal(jax.random.key(sum(shape)), shape, jnp.float32).astype(jnp.float16)


def test_matmul_with_a_scalar_raises_jnp_error():
    x = jnp.ones((4, 4), jnp.float16)
    for scalar in (2.0, np.float32(2)):
        with pytest.raises(ValueError):
            jnp.matmul(x, scalar)
        with pytest.raises(ValueError, match="jax_hopper.matmul"):
            jax_hopper.matmul(x, scalar)


@pytest.mark.parametrize("a_shape,b_shape", [((16, 24), (1024, 24, 8)), ((1024, 16, 24), (24, 8)),
                                             ((1, 16, 24), (1024, 24, 8)), ((24,), (1024, 24, 8)),
                                             ((256, 1, 16, 24), (1, 16, 24, 8)), ((1024, 16, 24), (1, 24, 8))])
@pytest.mark.parametrize("policy", ["kernel", pytest.param("auto", marks=pytest.mark.slow)])
def test_matmul_gradients_over_a_broadcast_batch_stay_rounding_level(a_shape, b_shape, policy):
    """matmul(W, x [B, K, N]): W is broadcast over B, and its gradient is one contraction
    over B and N, summed in f32 and rounded once, as jnp's. Where only x has B
    (x [B, M, K] @ W [1, K, N]), B folds into M as in jnp. The bound allows jnp's error
    twice: a different f32 summation order may move a rounding."""
    ka, kb, kc = jax.random.split(jax.random.key(17), 3)
    a, b = _random(ka, a_shape, jnp.float16), _random(kb, b_shape, jnp.float16)
    ct = _random(kc, jnp.matmul(a, b).shape, jnp.float16)

    def grads(fn, x, y):
        return jax.vjp(jax.jit(fn), x, y)[1](ct.astype(x.dtype))

    with jax_hopper.dispatch(policy):
        ours = grads(jax_hopper.matmul, a, b)
        assert jax.jit(jax_hopper.matmul)(a, b).shape == jnp.matmul(a, b).shape
    theirs = grads(jnp.matmul, a, b)
    exact = grads(lambda x, y: jnp.matmul(x, y, precision="highest"), a.astype(jnp.float32), b.astype(jnp.float32))
    for g_ours, g_theirs, g_exact in zip(ours, theirs, exact):
        assert g_ours.shape == g_theirs.shape and g_ours.dtype == g_theirs.dtype
        assert relative_error(g_ours, g_exact) <= 2 * relative_error(g_theirs, g_exact)


@pytest.mark.parametrize("scale,expected", [(-0.5, 6e4), (-1.0, 0.0)])
@pytest.mark.parametrize("policy,out_dtype", [("kernel", None), ("auto", jnp.float32)])
def test_broadcast_gradient_sums_once_in_f32(scale, expected, policy, out_dtype):
    """a [2, 4] @ b [2, 4, 4]: each batch entry's gradient of `a` is 1.2e5 (past f16's
    65504), their sum 6e4 or 0. Rounding each entry to f16 before the sum gave inf or nan;
    one contraction over the batch gives jnp's finite answer, exactly (every sum here is
    exact in f32). The tangent (forward mode) is jnp's too."""
    a = jnp.ones((2, 4), jnp.float16)
    b = jnp.stack([jnp.ones((4, 4)), scale * jnp.ones((4, 4))]).astype(jnp.float16)
    out_type = jnp.float16 if out_dtype is None else out_dtype
    ct = jnp.full((2, 2, 4), 3e4, out_type)

    def ours(x, y):
        return jax_hopper.matmul(x, y, preferred_element_type=out_dtype)

    def theirs(x, y):
        return jnp.matmul(x, y, preferred_element_type=out_dtype)

    with jax_hopper.dispatch(policy):
        grads = jax.jit(lambda x, y, c: jax.vjp(ours, x, y)[1](c))(a, b, ct)
        tangent = jax.jit(lambda x, y: jax.jvp(ours, (x, y), (x, y))[1])(a, b)
    expected_grads = jax.vjp(theirs, a, b)[1](ct)
    np.testing.assert_array_equal(np.asarray(grads[0], np.float32), np.full((2, 4), expected, np.float32))
    for g, g_jnp in zip(grads, expected_grads):
        assert g.dtype == g_jnp.dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(g_jnp, np.float32))
    np.testing.assert_array_equal(np.asarray(tangent, np.float32),
                                  np.asarray(jax.jvp(theirs, (a, b), (a, b))[1], np.float32))


@pytest.mark.parametrize("a_shape,b_shape", [((16, 24), (8, 24, 32)), ((24,), (8, 24, 32)),
                                             ((1, 16, 24), (3, 8, 24, 32))])
def test_a_broadcast_matmul_left_to_xla_lowers_as_jnps(a_shape, b_shape):
    """matmul(a, b) where b alone has batch dims, on the XLA path: jnp.matmul's own
    program (b's batch dims beside N), not a broadcast copy of a into a batched dot."""
    a, b = jax.ShapeDtypeStruct(a_shape, jnp.float16), jax.ShapeDtypeStruct(b_shape, jnp.float16)

    def matmul(x, y):
        with jax_hopper.dispatch("xla"):
            return jax_hopper.matmul(x, y)

    assert cuda_text(matmul, a, b) == cuda_text(jnp.matmul, a, b)


@pytest.mark.parametrize("policy,out_dtype", [("kernel", None), ("auto", jnp.float32)])
def test_a_broadcast_matmul_on_our_primitive_keeps_its_batched_launch(policy, out_dtype):
    """The other side of the test above: where the batched product runs our kernel (policy
    "kernel"), or an f32 result of f16 operands takes our derivative rule, the broadcast
    form (one batched launch) stays."""
    if not jax_hopper.kernel_available():
        pytest.skip("without the built kernel every product lowers to XLA's dot")
    a, b = jax.ShapeDtypeStruct((16, 24), jnp.float16), jax.ShapeDtypeStruct((8, 24, 32), jnp.float16)

    def matmul(x, y):
        with jax_hopper.dispatch(policy):
            return jax_hopper.matmul(x, y, preferred_element_type=out_dtype)

    text = cuda_text(matmul, a, b)
    assert "broadcast_in_dim" in text and "8x16x24" in text, text


def test_mixed_operands_with_a_narrower_result_type_round_like_jnp():
    """bf16 x against f32 (master) weights with a bf16 result: lax converts both operands
    to bf16 before the product; converting both to f32 (their promoted type) multiplied
    the unrounded weights (values up to 0.25 apart)."""
    kx, kw = jax.random.split(jax.random.key(18))
    x = _random(kx, (64, 256), jnp.bfloat16)
    w = jax.random.normal(kw, (256, 64), jnp.float32)
    for policy in ("auto", "kernel"):
        with jax_hopper.dispatch(policy):
            for ours_fn, ref_fn in [(jax_hopper.dot, jnp.dot), (jax_hopper.matmul, jnp.matmul)]:
                ours = jax.jit(lambda a, b: ours_fn(a, b, preferred_element_type=jnp.bfloat16))(x, w)
                ref = jax.jit(lambda a, b: ref_fn(a, b, preferred_element_type=jnp.bfloat16))(x, w)
                assert ours.dtype == ref.dtype
                np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(ref, np.float32))


TARGET_CALL = "custom_call @jax_hopper_gemm"


VMAP_LAYOUTS = {  # name: (lhs shape, rhs shape, dimension numbers), per example
    "NN": ((8, 24), (24, 16), (((1,), (0,)), ((), ()))),
    "NT": ((8, 24), (16, 24), (((1,), (1,)), ((), ()))),
    "TN": ((24, 8), (24, 16), (((0,), (0,)), ((), ()))),
    "TT": ((24, 8), (16, 24), (((0,), (1,)), ((), ()))),
    "leading dims": ((3, 8, 24), (24, 16), (((2,), (0,)), ((), ()))),
    "batched": ((3, 8, 24), (3, 24, 16), (((2,), (1,)), ((0,), (0,)))),
    "batched NT": ((3, 8, 24), (3, 16, 24), (((2,), (2,)), ((0,), (0,)))),
    "batched TN": ((3, 24, 8), (3, 24, 16), (((1,), (1,)), ((0,), (0,)))),
}


@pytest.mark.parametrize("in_axes", [0, 1, 2, (2, None), (None, 2)])
def test_vmap_over_a_product_with_two_batch_dims_matches_jnp(in_axes):
    """The vmapped dim among (or after) a product's two batch dims becomes one more batch
    dim where it is (moving it to the front made XLA:CPU abort in its simplifier)."""
    q = seed_normal_like((2, 3, 2, 3, 5))
    k = seed_normal_like((2, 3, 2, 5, 4))
    axes = in_axes if isinstance(in_axes, tuple) else (in_axes, in_axes)
    q, k = (v[(slice(None),) * 2 + (0,)] if a is None else v for v, a in zip((q, k), axes))
    with jax_hopper.dispatch("kernel"):
        ours = jax.jit(jax.vmap(jax_hopper.matmul, in_axes=axes))(q, k)
    ref = jax.vmap(jnp.matmul, in_axes=axes)(q, k)
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    f32 = lambda v: v.astype(jnp.float32)  # noqa: E731
    exact = jax.vmap(lambda a, b: jnp.matmul(a, b, precision="highest"), in_axes=axes)(f32(q), f32(k))
    assert relative_error(ours, exact) <= 1.5 * relative_error(exact.astype(ours.dtype), exact) + 1e-6


@pytest.mark.parametrize("layout", [name if name in ("NN", "leading dims", "batched") else
                                    pytest.param(name, marks=pytest.mark.slow) for name in VMAP_LAYOUTS])
def test_vmap_over_either_operand_matches_jnp(layout):
    """vmap over the lhs, the rhs or both, at axis 0 or 1, 16-bit and f32 results: the
    batching rule's folds (v into M or N) and broadcasts give jnp's product."""
    a_shape, b_shape, dims = VMAP_LAYOUTS[layout]
    v = 5
    ka, kb = jax.random.split(jax.random.key(len(layout)))
    for which in ("lhs", "rhs", "both"):
        for axis in (0, 1):
            in_axes = (axis if which != "rhs" else None, axis if which != "lhs" else None)
            a_full = a_shape[:axis] + (v,) + a_shape[axis:] if in_axes[0] is not None else a_shape
            b_full = b_shape[:axis] + (v,) + b_shape[axis:] if in_axes[1] is not None else b_shape
            a = jax.random.normal(ka, a_full, jnp.float32).astype(jnp.float16)
            b = jax.random.normal(kb, b_full, jnp.float32).astype(jnp.float16)
            for out in (None, jnp.float32):
                ours = jax.jit(jax.vmap(lambda x, y: jax_hopper.dot_general(x, y, dims, preferred_element_type=out),
                                        in_axes))(a, b)
                ref = jax.jit(jax.vmap(lambda x, y: lax.dot_general(x, y, dims, preferred_element_type=out),
                                       in_axes))(a, b)
                assert ours.shape == ref.shape and ours.dtype == ref.dtype, (which, axis, out)
                # Same f32 sums, one rounding each (16-bit results): within two roundings.
                err = float(jnp.max(jnp.abs(ours.astype(jnp.float32) - ref.astype(jnp.float32))) /
                            jnp.max(jnp.abs(ref.astype(jnp.float32))))
                assert err <= 2**-9, (which, axis, out, err)


@pytest.mark.parametrize("policy", ["auto", "kernel"])
def test_ops_compute_under_disable_jit(policy):
    """jax.disable_jit runs our primitives eagerly, each compiled alone as jax's own are (a
    jit of the bind recursed there: the bind called the impl again), with the values and
    derivatives of the jitted program."""
    kx, kw, kb = jax.random.split(jax.random.key(70), 3)
    x = jax.random.normal(kx, (16, 32), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (32, 24), jnp.float32) / 6).astype(jnp.bfloat16)
    b = jax.random.normal(kb, (24,), jnp.float32).astype(jnp.bfloat16)

    def program(x, w, b):
        mlp = lambda x, w: jax_hopper.mlp(x, w, b, w.T, None, activation="silu", residual=x)  # noqa: E731
        return (jax_hopper.matmul(x, w), jax_hopper.dense(x, w, b, activation="gelu_exact"),
                jax.jvp(mlp, (x, w), (x, w)), jax.grad(lambda x: jnp.sum(mlp(x, w).astype(jnp.float32)))(x))

    with jax_hopper.dispatch(policy):
        jitted = jax.jit(program)(x, w, b)
        with jax.disable_jit():
            eager = program(x, w, b)
    for e, j in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        assert e.shape == j.shape and e.dtype == j.dtype
        assert relative_error(e, j.astype(jnp.float32)) < 2 * ULP["bfloat16"]
