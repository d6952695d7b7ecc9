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


@pytest.mark.parametrize("fn", ["matmul", "dot"])
def test_non_arrays_are_rejected_or_computed_like_jnp(fn):
    f, ref = getattr(jax_hopper, fn), getattr(jnp, fn)
    with pytest.raises(TypeError):
        f("not an array", jnp.ones((2, 2), F16))
    if fn == "dot":  # jnp.dot multiplies by a Python scalar; so do we
        np.testing.assert_array_equal(np.asarray(f(2.0, jnp.ones((2, 2), F16))),
                                      np.asarray(ref(2.0, jnp.ones((2, 2), F16))))


def test_numpy_inputs_work_like_jnp():
    a = np.arange(12, dtype=np.float16).reshape(3, 4)
    b = np.arange(8, dtype=np.float16).reshape(4, 2)
    np.testing.assert_array_equal(np.asarray(jax_hopper.matmul(a, b)), np.asarray(jnp.matmul(a, b)))
