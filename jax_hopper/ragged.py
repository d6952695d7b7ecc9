"""Grouped products for mixtures of experts: drop-ins for ``jax.lax.ragged_dot`` and
``jax.lax.ragged_dot_general``.

The forms that expert layers use go through the dispatcher to the grouped kernel
(primitives/ragged_dot.py):
  - ragged rows: lhs [M, K] with its rows in groups (group_sizes [G], in order) against
    rhs [G, K, N] (``ragged_dot``), or rhs [G, N, K] (contracting rhs's last dim);
  - ragged contraction: lhs [R, A] and rhs [R, B], contracting their rows per group, to
    [G, A, B] (a weight gradient).
Everything else, a ``group_offset``, or a precision other than the default goes to jax's
own function unchanged, as the drop-ins for dot do.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_hopper import _dispatch
from jax_hopper._dispatch import Decision
from jax_hopper._problem import Problem
from jax_hopper.ops import is_array, plain_precision
from jax_hopper.primitives.ragged_dot import (
    CONTRACT_DIMS,
    KERNEL_DTYPES,
    ROWS_DIMS,
    ROWS_DIMS_TRANSPOSED,
    ragged_contract,
    ragged_rows,
)

F32 = jnp.dtype(jnp.float32)


def _dims_key(dims):
    (contracting, batch) = dims.dot_dimension_numbers
    return (tuple(map(tuple, contracting)), tuple(map(tuple, batch)), tuple(dims.lhs_ragged_dimensions),
            tuple(dims.rhs_group_dimensions))


_ROWS_KEY = _dims_key(ROWS_DIMS)
_ROWS_TRANSPOSED_KEY = _dims_key(ROWS_DIMS_TRANSPOSED)
_CONTRACT_KEY = _dims_key(CONTRACT_DIMS)


def _form(lhs, rhs, group_sizes, dims, precision, preferred_element_type, group_offset, abstract_ok=False):
    """(op, transpose_rhs, out_dtype) where the kernel's forms apply, else None."""
    if group_offset is not None or not all(is_array(x, abstract_ok) for x in (lhs, rhs, group_sizes)):
        return None
    if not plain_precision(precision) or lhs.dtype != rhs.dtype or lhs.dtype not in KERNEL_DTYPES:
        return None
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        return None
    out_dtype = jnp.dtype(lhs.dtype if preferred_element_type is None else preferred_element_type)
    if out_dtype not in (lhs.dtype, F32):
        return None
    try:
        key = _dims_key(dims)
    except (TypeError, ValueError, AttributeError):
        return None
    groups = group_sizes.shape[0]
    if key in (_ROWS_KEY, _ROWS_TRANSPOSED_KEY) and lhs.ndim == 2 and rhs.ndim == 3 and rhs.shape[0] == groups:
        transpose = key == _ROWS_TRANSPOSED_KEY
        if lhs.shape[1] == rhs.shape[2 if transpose else 1]:
            return "ragged_rows", transpose, out_dtype
    if key == _CONTRACT_KEY and lhs.ndim == 2 and rhs.ndim == 2 and lhs.shape[0] == rhs.shape[0]:
        return "ragged_contract", False, out_dtype
    return None


def _problem(op, lhs, rhs, group_sizes, transpose, out_dtype) -> Problem:
    itemsize, out_itemsize = np.dtype(lhs.dtype).itemsize, np.dtype(out_dtype).itemsize
    groups = int(group_sizes.shape[0])
    if op == "ragged_rows":
        m, k = lhs.shape
        n = rhs.shape[1] if transpose else rhs.shape[2]
        return Problem(groups, int(m), int(n), int(k), itemsize, out_itemsize, False, bool(transpose), op=op)
    rows, a = lhs.shape
    return Problem(groups, int(a), int(rhs.shape[1]), int(rows), itemsize, out_itemsize, True, False, op=op)


def ragged_dot_path(lhs, rhs, group_sizes, ragged_dot_dimension_numbers=ROWS_DIMS, precision=None,
                    preferred_element_type=None, group_offset=None) -> Decision:
    """Which path ragged_dot_general(...) with these arguments (arrays or
    jax.ShapeDtypeStructs) takes, and why."""
    form = _form(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, precision, preferred_element_type,
                 group_offset, abstract_ok=True)
    if form is None:
        return Decision("xla", "not-a-kernel-form", None)
    op, transpose, out_dtype = form
    return _dispatch.decide(_problem(op, lhs, rhs, group_sizes, transpose, out_dtype))


def ragged_dot_general(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, precision=None,
                       preferred_element_type=None, group_offset=None):
    """``jax.lax.ragged_dot_general``: the ragged-rows and ragged-contraction forms on the
    grouped kernel where the dispatcher sends them, everything else jax's."""
    form = _form(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, precision, preferred_element_type,
                 group_offset)
    if form is not None:
        op, transpose, out_dtype = form
        decision = _dispatch.decide(_problem(op, lhs, rhs, group_sizes, transpose, out_dtype))
        if decision.path == "kernel":
            if op == "ragged_rows":
                return ragged_rows(lhs, rhs, group_sizes, transpose_rhs=transpose, out_dtype=out_dtype)
            return ragged_contract(lhs, rhs, group_sizes, out_dtype=out_dtype)
    return lax.ragged_dot_general(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, precision=precision,
                                  preferred_element_type=preferred_element_type, group_offset=group_offset)


def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None):
    """``jax.lax.ragged_dot``: lhs [M, K] in groups of rows (group_sizes [G]) times rhs
    [G, K, N], each group by its own matrix; rows past sum(group_sizes) are zeros."""
    return ragged_dot_general(lhs, rhs, group_sizes, ROWS_DIMS, precision=precision,
                              preferred_element_type=preferred_element_type, group_offset=group_offset)

