"""The drop-ins check and plan a product once per operand types, static arguments and
trace context (tools/trace_cost.py measures what that saves); what the context changes
is computed again."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_hopper

F16, BF16 = jnp.float16, jnp.bfloat16
DIMS = (((1,), (0,)), ((), ()))
DROP_INS = {"dot_general": lambda a, b: jax_hopper.dot_general(a, b, DIMS), "dot": jax_hopper.dot,
            "matmul": jax_hopper.matmul}


@pytest.mark.parametrize("fn", sorted(DROP_INS))
def test_a_repeated_product_is_checked_once(fn, monkeypatch):
    calls = []
    eval_shape = jax.eval_shape
    monkeypatch.setattr(jax, "eval_shape", lambda *args, **kwargs: calls.append(1) or eval_shape(*args, **kwargs))
    product = DROP_INS[fn]
    a = jax.ShapeDtypeStruct((24, 40), F16)  # a shape no other test here traces

    def chain(x, w):
        for _ in range(20):
            x = product(x, w)
        return x

    jax.make_jaxpr(chain)(a, jax.ShapeDtypeStruct((40, 40), F16))
    assert len(calls) <= 1


def _outcome(fn, *args):
    try:
        return jax.eval_shape(fn, *args).dtype
    except (TypeError, ValueError) as err:  # strict promotion's TypePromotionError is a ValueError
        return type(err)


def test_the_promotion_mode_is_part_of_the_key():
    """f16 @ bf16 under standard promotion and under strict promotion (jnp's TypePromotionError),
    each as jax answers it, also after the same product was traced in the other mode."""
    a, b = jnp.ones((8, 16), F16), jnp.ones((16, 8), BF16)
    theirs = {"dot_general": lambda a, b: jax.lax.dot_general(a, b, DIMS), "dot": jnp.dot, "matmul": jnp.matmul}
    for name, fn in DROP_INS.items():
        for mode in ("standard", "strict", "standard"):
            with jax.numpy_dtype_promotion(mode):
                assert _outcome(fn, a, b) == _outcome(theirs[name], a, b), (name, mode)
    with jax.numpy_dtype_promotion("strict"):
        assert _outcome(jax_hopper.matmul, a, b) is not jnp.float32  # the case above is not vacuous


def test_the_policy_and_precision_are_part_of_the_key():
    a = jax.ShapeDtypeStruct((32, 48), F16)
    b = jax.ShapeDtypeStruct((48, 16), F16)
    with jax_hopper.dispatch("kernel"):
        assert jax_hopper.dispatch_path(a, b, DIMS)[0] == "kernel"
    with jax_hopper.dispatch("xla"):
        assert jax_hopper.dispatch_path(a, b, DIMS)[0] == "xla"
    with jax_hopper.dispatch("kernel"):
        assert jax_hopper.dispatch_path(a, b, DIMS, precision="highest")[0] == "kernel"
        with jax.default_matmul_precision("F16_F16_F32"):  # an algorithm: jax's own product
            assert jax_hopper.dispatch_path(a, b, DIMS)[0] == "jax"
        assert jax_hopper.dispatch_path(a, b, DIMS)[0] == "kernel"


def test_results_after_a_cache_hit_are_the_products_of_the_new_operands():
    """The cache holds types, never values: the same shapes with other values give their
    own product."""
    product = jax.jit(jax_hopper.matmul)
    for seed in range(3):
        kx, kw = jax.random.split(jax.random.key(seed))
        x = jax.random.randint(kx, (16, 32), -4, 5).astype(F16)
        w = jax.random.randint(kw, (32, 8), -4, 5).astype(F16)
        with jax_hopper.dispatch("kernel"):
            ours = jax_hopper.matmul(x, w)
        np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(jnp.matmul(x, w), np.float32))
        np.testing.assert_array_equal(np.asarray(product(x, w), np.float32),
                                      np.asarray(jnp.matmul(x, w), np.float32))
