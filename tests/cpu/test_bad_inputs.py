"""What users get wrong, and what they get back: each mistake is answered at trace time
by a TypeError/ValueError naming both operands' dtypes and shapes (jax's own check,
re-raised with the operands named), or computed by the fallback where jax accepts it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_hopper

F16 = jnp.float16
DN = (((1,), (0,)), ((), ()))

BAD = [  # (function, lhs, rhs, kwargs, error type(s), message fragment)
    ("matmul", jnp.ones((), F16), jnp.ones((8, 4), F16), {}, ValueError, r"float16\[\], float16\[8, 4\]"),
    ("matmul", jnp.ones((4, 8), F16), jnp.ones((9, 4), F16), {}, (TypeError, ValueError),
     r"float16\[4, 8\], float16\[9, 4\]"),
    ("matmul", jnp.ones((2, 4, 8), F16), jnp.ones((3, 8, 4), F16), {}, (TypeError, ValueError),
     r"float16\[2, 4, 8\], float16\[3, 8, 4\]"),
    ("dot", jnp.ones((4, 8), F16), jnp.ones((9, 4), F16), {}, (TypeError, ValueError), r"float16\[4, 8\]"),
    ("dot_general", jnp.ones((4, 8), F16), jnp.ones((9, 4), F16), {"dimension_numbers": DN}, TypeError,
     r"float16\[4, 8\], float16\[9, 4\]"),
    ("dot_general", jnp.ones((2, 4, 8), F16), jnp.ones((3, 8, 4), F16),
     {"dimension_numbers": (((2,), (1,)), ((0,), (0,)))}, TypeError, r"float16\[2, 4, 8\]"),
    ("dot_general", jnp.ones((4, 8), F16), jnp.ones((8, 4), F16), {"dimension_numbers": (((5,), (0,)), ((), ()))},
     (TypeError, ValueError), r"float16\[4, 8\]"),
    ("dot_general", jnp.ones((4, 8), F16), jnp.ones((8, 4), F16), {"dimension_numbers": (((1, 1), (0, 0)), ((), ()))},
     (TypeError, ValueError), r"float16\[4, 8\]"),
    ("dot_general", jnp.ones((4, 8), F16), jnp.ones((8, 4), F16), {"dimension_numbers": (((1,), (0,)), ((0,), ()))},
     (TypeError, ValueError), r"float16\[4, 8\]"),
]
# (A preferred_element_type that cannot hold the result, e.g. int8 for f16 inputs, is
# accepted by lax.dot_general; jax_hopper leaves such calls to jax, see test_drop_in.py.)


@pytest.mark.parametrize("fn,lhs,rhs,kwargs,error,match", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_mistakes_raise_at_trace_time_naming_the_operands(fn, lhs, rhs, kwargs, error, match):
    f = getattr(jax_hopper, fn)
    with pytest.raises(error, match=match):
        jax.jit(lambda x, y: f(x, y, **kwargs)).trace(lhs, rhs)


DROP_INS = {"dot_general": (jax_hopper.dot_general, lambda x, y: jax.lax.dot_general(x, y, DN),
                            {"dimension_numbers": DN}),
            "dot": (jax_hopper.dot, jnp.dot, {}), "matmul": (jax_hopper.matmul, jnp.matmul, {})}
NON_ARRAYS = {"list": [[1.0] * 4] * 8, "tuple": ((1.0,) * 4,) * 8, "str": "not an array", "None": None,
              "object": object(), "ShapeDtypeStruct": jax.ShapeDtypeStruct((8, 4), F16)}


def _raised(fn, *args, **kwargs):
    with pytest.raises(Exception) as info:
        fn(*args, **kwargs)
    return info.value


@pytest.mark.parametrize("position", [0, 1])
@pytest.mark.parametrize("operand", sorted(NON_ARRAYS))
@pytest.mark.parametrize("fn", sorted(DROP_INS))
def test_non_arrays_raise_jaxs_own_error(fn, operand, position):
    """An operand jax does not take as an array (a list, a string, a ShapeDtypeStruct...)
    gets jax's own error, its type and message, named as ours; not one from inside our
    planning."""
    ours, theirs, kwargs = DROP_INS[fn]
    x = jnp.ones((4, 8), F16)
    args = (x, NON_ARRAYS[operand]) if position == 1 else (NON_ARRAYS[operand], x.T)
    mine, jaxs = _raised(ours, *args, **kwargs), _raised(theirs, *args)
    assert type(mine) is type(jaxs)
    assert str(mine).startswith(f"jax_hopper.{fn}(") and str(jaxs).split("\n")[0] in str(mine)


def test_python_scalars_are_computed_like_jnp():
    """jnp.dot multiplies by a Python scalar; so do we."""
    x = jnp.ones((2, 2), F16)
    np.testing.assert_array_equal(np.asarray(jax_hopper.dot(2.0, x)), np.asarray(jnp.dot(2.0, x)))


@pytest.mark.parametrize("shapes", [((8, 4), (4, 6)), ((4,), (4, 6)), ((8, 4), (4,)), ((4,), (4,))])
def test_dimension_numbers_none_as_jax_infers_them(shapes):
    """lax.dot_general(x, y, None) contracts x's last dim with y's first for operands of
    rank 1 or 2; other ranks get jax's error."""
    # Small integers: every sum is exact, so any summation order gives jax's answer.
    x, y = (jax.random.randint(jax.random.key(i), s, -4, 5).astype(F16) for i, s in enumerate(shapes))
    with jax_hopper.dispatch("kernel"):
        ours = jax.jit(lambda a, b: jax_hopper.dot_general(a, b, None))(x, y)
        assert jax_hopper.dispatch_path(x, y, None)[0] in ("kernel", "xla")
    np.testing.assert_array_equal(np.asarray(ours, np.float32),
                                  np.asarray(jax.lax.dot_general(x, y, None), np.float32))


def test_dimension_numbers_none_beyond_rank_2_raises_jaxs_error():
    x, y = jnp.ones((2, 8, 4), F16), jnp.ones((4, 6), F16)
    with pytest.raises(type(_raised(jax.lax.dot_general, x, y, None)), match="dimension_numbers must be specified"):
        jax_hopper.dot_general(x, y, None)


def test_numpy_inputs_work_like_jnp():
    a = np.arange(12, dtype=np.float16).reshape(3, 4)
    b = np.arange(8, dtype=np.float16).reshape(4, 2)
    np.testing.assert_array_equal(np.asarray(jax_hopper.matmul(a, b)), np.asarray(jnp.matmul(a, b)))
