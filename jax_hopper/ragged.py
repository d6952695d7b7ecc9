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

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from jax_hopper import _dispatch
from jax_hopper import _partitioning as part
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
    rows_reference,
    shard_sizes,
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


# ---- rows sharded on explicit mesh axes ----------------------------------------------------
def _row_axes(x):
    """The explicit mesh axes that shard x's first dim and nothing else of it, or None."""
    spec = part.value_spec(x)
    if spec is None or not spec[0] or any(spec[1:]):
        return None
    return (spec[0],) if isinstance(spec[0], str) else tuple(spec[0])


def _replicated(x) -> bool:
    spec = part.value_spec(x)
    return spec is None or not any(spec)


def _sharded_rows_axes(op, lhs, rhs, group_sizes):
    """The explicit axes sharding the rows the groups split, where only they are sharded
    (ragged rows: lhs's rows; the contraction: both operands' rows alike); else None."""
    axes = _row_axes(lhs)
    if axes is None or not _replicated(group_sizes):
        return None
    if op == "ragged_rows":
        return axes if _replicated(rhs) else None
    return axes if _row_axes(rhs) == axes else None


def _local_sizes(group_sizes, rows_per_shard, axes):
    """This shard's group sizes: the global groups' rows clipped to its row range."""
    return shard_sizes(group_sizes, lax.axis_index(axes) * rows_per_shard, rows_per_shard)


def _sharded_rows(op, on_kernel, lhs, rhs, group_sizes, dims, transpose, out_dtype, axes):
    """Each shard's rows with its own group sizes, in a shard_map over the row axes: the
    ragged rows' shards are the result's; the contraction's partial sums are added (psum
    in f32, then rounded once). On the kernel or, per shard, jax's computation (jax's own
    ragged_dot has no rule for explicit sharding)."""
    mesh = part.explicit_mesh(jax.typeof(lhs))
    rows_spec = PartitionSpec(axes, *([None] * (lhs.ndim - 1)))

    def per_device(x, w, s):
        local = _local_sizes(s, x.shape[0], axes)
        if op == "ragged_rows":
            if on_kernel:
                return ragged_rows(x, w, local, transpose_rhs=transpose, out_dtype=out_dtype)
            return lax.ragged_dot_general(x, w, local, dims, preferred_element_type=out_dtype)
        if on_kernel:
            partial = ragged_contract(x, w, local, out_dtype=F32)
        else:
            partial = lax.ragged_dot_general(x, w, local, dims, preferred_element_type=F32)
        return lax.psum(partial, axes).astype(out_dtype)

    out_spec = rows_spec if op == "ragged_rows" else PartitionSpec()
    rhs_spec = PartitionSpec(*([None] * rhs.ndim)) if op == "ragged_rows" else rows_spec
    return jax.shard_map(per_device, mesh=mesh, in_specs=(rows_spec, rhs_spec, PartitionSpec(None)),
                         out_specs=out_spec)(lhs, rhs, group_sizes)


def ragged_dot_general(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, precision=None,
                       preferred_element_type=None, group_offset=None):
    """``jax.lax.ragged_dot_general``: the ragged-rows and ragged-contraction forms on the
    grouped kernel where the dispatcher sends them, everything else jax's. With the rows
    sharded on explicit mesh axes (and nothing else sharded), each shard computes its rows
    with its own group sizes."""
    form = _form(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, precision, preferred_element_type,
                 group_offset)
    if form is not None:
        op, transpose, out_dtype = form
        decision = _dispatch.decide(_problem(op, lhs, rhs, group_sizes, transpose, out_dtype))
        on_kernel = decision.path == "kernel"
        axes = _sharded_rows_axes(op, lhs, rhs, group_sizes)
        if axes is not None:
            return _sharded_rows(op, on_kernel, lhs, rhs, group_sizes, ragged_dot_dimension_numbers, transpose,
                                 out_dtype, axes)
        if on_kernel:
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



# ---- expert parallelism (a shard_map recipe) ----------------------------------------------
def ragged_dot_expert_parallel(lhs, rhs, group_sizes, axis_name, capacity=None):
    """ragged_dot with the experts sharded over `axis_name`, inside a ``shard_map`` over it.

    On each of the D devices: lhs [M, K] are this device's routed rows sorted by expert,
    group_sizes [G] their count per expert (all G experts), rhs [G / D, K, N] this
    device's experts (expert g lives on device g // (G / D)). Returns [M, N]: each row
    times its expert's matrix, wherever that expert lives. The rows travel to their
    experts' device and back with two ``all_to_all``s of `capacity` rows per pair of
    devices (default M: nothing is dropped; with less, each device's rows past the
    capacity for one destination give zeros, as capacity-limited routers drop them).
    Each device multiplies what it received in one grouped product: every source's rows,
    sorted by local expert, then a gap group (rows the source did not fill). Gradients
    flow back through the same exchanges.
    """
    rows, k = lhs.shape
    local_experts = rhs.shape[0]
    devices = lax.axis_size(axis_name) if hasattr(lax, "axis_size") else lax.psum(1, axis_name)
    capacity = rows if capacity is None else capacity
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    # Where this device's rows go: rows for destination j are contiguous (sorted by expert).
    per_dest = sizes.reshape(devices, local_experts).sum(1)
    dest_start = jnp.cumsum(per_dest) - per_dest
    slot = jnp.arange(capacity)
    take = dest_start[:, None] + slot[None, :]  # [D, C]: the rows sent to each destination
    sent = slot[None, :] < jnp.minimum(per_dest, capacity)[:, None]
    send = jnp.where(sent[..., None], lhs[jnp.clip(take, 0, rows - 1)], 0)
    recv = lax.all_to_all(send, axis_name, 0, 0, tiled=False)  # [D, C, K]: from each source
    # Each source's counts for this device's experts, cut at the capacity, then the gap.
    me = lax.axis_index(axis_name)
    theirs = lax.dynamic_slice_in_dim(lax.all_gather(sizes, axis_name), me * local_experts, local_experts, axis=1)
    ends = jnp.minimum(jnp.cumsum(theirs, axis=1), capacity)
    counts = jnp.diff(ends, axis=1, prepend=0)
    recv_sizes = jnp.concatenate([counts, capacity - ends[:, -1:]], axis=1).reshape(-1)
    period = local_experts + 1
    problem = Problem(devices * period, devices * capacity, rhs.shape[2], k, np.dtype(lhs.dtype).itemsize,
                      np.dtype(lhs.dtype).itemsize, False, False, op="ragged_rows")
    flat = recv.reshape(-1, k)
    if _dispatch.decide(problem).path == "kernel":
        out = ragged_rows(flat, rhs, recv_sizes, period=period)
    else:
        out = rows_reference(flat, rhs, recv_sizes, transpose_rhs=False, out_dtype=lhs.dtype, period=period)
    back = lax.all_to_all(out.reshape(recv.shape[0], capacity, -1), axis_name, 0, 0, tiled=False)  # [D, C, N]
    # Each row's result from its destination's slot (zeros past the capacity).
    row = jnp.arange(rows)
    dest = jnp.clip(jnp.searchsorted(jnp.cumsum(per_dest), row, side="right"), 0, per_dest.shape[0] - 1)
    pos = row - dest_start[dest]
    kept = (pos < capacity) & (row < per_dest.sum())
    return jnp.where(kept[:, None], back[dest, jnp.clip(pos, 0, capacity - 1)], 0).astype(lhs.dtype)
