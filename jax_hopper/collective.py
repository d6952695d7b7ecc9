"""Tensor-parallel products whose communication runs under the GEMMs, for use inside
``jax.shard_map`` over a mesh axis of P devices:

  all_gather_matmul(x, w, axis)      x's rows sharded, w's columns sharded:
                                     all_gather(x) @ w, each device's [M, N / P]
  matmul_reduce_scatter(h, w, axis)  the contraction sharded (h's columns, w's rows):
                                     (h @ w) summed over the devices, each device
                                     keeping its block of rows, [M / P, N]
  sequence_parallel_mlp(...)         both around a bias, an activation and a residual:
                                     the tensor-parallel MLP block with its tokens
                                     sharded (sequence parallelism)

Each is a ring of P steps: at every step a device multiplies the block it holds while
`lax.ppermute` passes a block on to its neighbour; the transfer of step s + 1 does not
depend on the product of step s, so XLA's scheduler may run it under the product (its
asynchronous collective-permutes). `chunks` splits each device's block further (smaller
transfers, more products). The products are `jax_hopper.dot_general`'s, so the
dispatcher picks our kernel or XLA's dot for each chunk's shape. The gradient of an
all-gather-matmul is a matmul-reduce-scatter (d x) and a ring contracting the gathered
rows (d w), and the reverse. Sums across devices are f32, rounded once.

Which chunk counts and kinds are fastest is not yet measured (it needs several GPUs):
`chunks` defaults to 1.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_hopper._reference import ACTIVATION_FNS, dense_epilogue
from jax_hopper.ops import dot_general

F32 = jnp.dtype(jnp.float32)
_MATMUL = (((1,), (0,)), ((), ()))


def _bounds(size: int, chunks: int) -> list[tuple[int, int]]:
    """[start, end) of `chunks` nearly equal pieces of `size` (the first ones a row
    longer where it does not divide)."""
    if chunks < 1:
        raise ValueError(f"chunks must be at least 1, got {chunks}")
    chunks = min(chunks, max(size, 1))
    base, extra = divmod(size, chunks)
    starts = [i * base + min(i, extra) for i in range(chunks + 1)]
    return list(zip(starts[:-1], starts[1:]))


def _ring(axis_name, shift):
    """ppermute pairs passing each device's block to the device `shift` places on."""
    size = lax.axis_size(axis_name)
    return [(i, (i + shift) % size) for i in range(size)]


def _check(name, a, b, a_ndim=2):
    if a.ndim != a_ndim or b.ndim != 2:
        raise ValueError(f"{name} takes a [rows, k] and b [k, n] (each device's shards), got {a.shape} and {b.shape}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{name}: contracting sizes differ: {a.shape} and {b.shape}")


def _chunked(block, w, pieces, out_dtype):
    """block @ w, a product per piece of the block's rows."""
    parts = [dot_general(block[a:b], w, _MATMUL, preferred_element_type=out_dtype) for a, b in pieces]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)


def _rows_of(x, block, rows):
    return lax.dynamic_slice_in_dim(x, block * rows, rows, axis=0)


def _passed_around(x, axis_name):
    """The ring's steps (step, the block): at step s this device holds the block of device
    index + s, received from the next device. Each block's transfer onward is issued
    before the block is handed out, so it may run under the step's product."""
    size = lax.axis_size(axis_name)
    held = x
    for step in range(size):
        incoming = lax.ppermute(held, axis_name, _ring(axis_name, -1)) if step + 1 < size else None
        yield step, held
        held = incoming


def _gather_product(x, w, axis_name, chunks, out_dtype):
    """The all-gather-matmul ring: step s multiplies the rows of device index + s."""
    size, index = lax.axis_size(axis_name), lax.axis_index(axis_name)
    pieces = _bounds(x.shape[0], chunks)
    blocks = [_chunked(held, w, pieces, out_dtype) for _, held in _passed_around(x, axis_name)]
    # blocks[s] holds device (index + s)'s rows: rotated into device order.
    stacked = jnp.roll(jnp.stack(blocks), index, axis=0)
    return stacked.reshape((size * x.shape[0],) + stacked.shape[2:])


def _scatter_product(h, w, axis_name, chunks, out_dtype):
    """The matmul-reduce-scatter ring: step s adds this device's f32 part of row block
    index - s - 1 to the sum received from the previous device and passes it on; after P
    steps each device holds its own block, rounded once."""
    size, index = lax.axis_size(axis_name), lax.axis_index(axis_name)
    rows = h.shape[0] // size
    pieces = _bounds(rows, chunks)
    acc = None
    for step in range(size):
        part = _chunked(_rows_of(h, (index - step - 1) % size, rows), w, pieces, F32)
        acc = part if acc is None else acc + part
        if step + 1 < size:
            acc = lax.ppermute(acc, axis_name, _ring(axis_name, 1))
    return acc.astype(out_dtype)


def _gather_contraction(held, full, axis_name, held_first):
    """all_gather(held)^T @ full (held_first) or full^T @ all_gather(held), over the rows,
    in f32: each step contracts the block passed around ([m, a]) with the rows of `full`
    ([P * m, b]) that its source device owns."""
    index = lax.axis_index(axis_name)
    dims = (((0,), (0,)), ((), ()))
    acc = None
    for step, block in _passed_around(held, axis_name):
        other = _rows_of(full, (index + step) % lax.axis_size(axis_name), held.shape[0])
        a, b = (block, other) if held_first else (other, block)
        part = dot_general(a, b, dims, preferred_element_type=F32)
        acc = part if acc is None else acc + part
    return acc


def _out_dtype(a, b, preferred):
    return jnp.dtype(preferred or jnp.result_type(a.dtype, b.dtype))


def _agm_bwd(axis_name, chunks, out_dtype, saved, ct):
    """d x: ct [P * m, n] against w^T, reduced over the devices' columns and scattered to
    x's rows (a matmul-reduce-scatter); d w: all_gather(x)^T ct over the ring."""
    x, w = saved
    dx = _scatter_product(ct, w.T, axis_name, chunks, x.dtype)
    dw = _gather_contraction(x, ct, axis_name, held_first=True).astype(w.dtype)
    return dx, dw


def _mrs_bwd(axis_name, chunks, out_dtype, saved, ct):
    """d h: all_gather(ct) @ w^T (an all-gather-matmul); d w: h^T all_gather(ct) over
    the ring."""
    h, w = saved
    dh = _gather_product(ct.astype(h.dtype), w.T, axis_name, chunks, h.dtype)
    dw = _gather_contraction(ct.astype(h.dtype), h, axis_name, held_first=False).astype(w.dtype)
    return dh, dw


def _with_gradient(forward, backward):
    """forward(a, b, axis_name, chunks, out_dtype) with the backward ring above, saving
    its two operands."""
    f = jax.custom_vjp(forward, nondiff_argnums=(2, 3, 4))
    f.defvjp(lambda a, b, *static: (forward(a, b, *static), (a, b)), backward)
    return f


_all_gather_matmul = _with_gradient(_gather_product, _agm_bwd)
_matmul_reduce_scatter = _with_gradient(_scatter_product, _mrs_bwd)


def all_gather_matmul(x, w, axis_name, *, chunks: int = 1, preferred_element_type=None):
    """all_gather(x, axis_name, tiled=True) @ w without waiting for the gather: x [m, K]
    (this device's rows), w [K, n] -> [P * m, n], rows in device order along the axis."""
    _check("all_gather_matmul", x, w)
    _bounds(x.shape[0], chunks)
    return _all_gather_matmul(x, w, axis_name, chunks, _out_dtype(x, w, preferred_element_type))


def matmul_reduce_scatter(h, w, axis_name, *, chunks: int = 1, preferred_element_type=None):
    """psum_scatter(h @ w, axis_name, tiled=True) without a separate reduction: h [M, k]
    and w [k, N] (this device's part of the contraction) -> [M / P, N], this device's
    block of the rows of the sum over the devices (M must divide by P), summed in f32 and
    rounded once."""
    _check("matmul_reduce_scatter", h, w)
    size = lax.axis_size(axis_name)
    if h.shape[0] % size:
        raise ValueError(f"matmul_reduce_scatter: {h.shape[0]} rows do not split over {size} devices")
    _bounds(h.shape[0] // size, chunks)
    return _matmul_reduce_scatter(h, w, axis_name, chunks, _out_dtype(h, w, preferred_element_type))


def sequence_parallel_mlp(x, w1, b1, w2, b2, axis_name, *, activation="gelu_tanh", residual=True,
                          chunks: int = 1, mesh=None):
    """The tensor-parallel MLP block with its tokens sharded:
    y = act(all_gather(x) @ w1 + b1) @ w2 + b2 (+ x), with w1's columns, b1 and w2's rows
    sharded over `axis_name`, and x's rows (tokens). Inside a shard_map, x [t, d] -> y
    [t, d], this device's tokens. With `mesh`, the whole arrays under jit instead: the
    block runs in a shard_map over that mesh axis (operands resharded to it where they
    are not), y sharded like x's tokens. The hidden activations stay sharded by column;
    the second product's sum is reduced and scattered back to the tokens' devices. f32
    products and epilogues, each rounded once to x's type (the fused kernel's arithmetic)."""
    if activation not in ACTIVATION_FNS:
        raise ValueError(f"activation must be one of {sorted(a for a in ACTIVATION_FNS if a)} or None, "
                         f"got {activation!r}")
    if mesh is not None:
        body = functools.partial(sequence_parallel_mlp, axis_name=axis_name, activation=activation,
                                 residual=residual, chunks=chunks)
        specs = (P(axis_name, None), P(None, axis_name), P(axis_name), P(axis_name, None), P())
        return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(axis_name, None))(x, w1, b1, w2, b2)
    hidden = all_gather_matmul(x, w1, axis_name, chunks=chunks, preferred_element_type=F32)
    hidden = dense_epilogue(hidden, b1, None, activation=activation, dtype=x.dtype)
    out = matmul_reduce_scatter(hidden, w2, axis_name, chunks=chunks, preferred_element_type=F32)
    return dense_epilogue(out, b2, x if residual else None, activation=None, dtype=x.dtype)
