"""vmap rule for the GEMM primitive: every vmapped product is one batched launch.

Where the memory layout allows, a vmapped operand against an unbatched one is folded
into M (A stored [M, K]) or N (B stored [N, K]): one plain GEMM, no copy. Otherwise the
vmapped axis becomes the primitive's leading batch dimension (an unbatched operand is
broadcast), merging with a batch dimension the primitive already had.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.interpreters import batching

from jax_hopper._primitive import gemm_p

NOT_MAPPED = None


def _to_front(x, dim, size):
    if dim is NOT_MAPPED:
        return jnp.broadcast_to(x, (size,) + x.shape)
    return jnp.moveaxis(x, dim, 0)


def _batch_rule(args, dims, **params):
    a, b = args
    da, db = dims
    ta, tb = params["transpose_a"], params["transpose_b"]
    if db is NOT_MAPPED and a.ndim == 3 and not ta:  # [v, M, K] against [K, N]: fold v into M
        a = jnp.moveaxis(a, da, 0)
        v, m, k = a.shape
        out = gemm_p.bind(a.reshape(v * m, k), b, **params)
        return out.reshape(v, m, out.shape[-1]), 0
    if da is NOT_MAPPED and b.ndim == 3 and tb:  # [M, K] against [v, N, K]: fold v into N
        b = jnp.moveaxis(b, db, 0)
        v, n, k = b.shape
        out = gemm_p.bind(a, b.reshape(v * n, k), **params)
        return out.reshape(out.shape[0], v, n), 1
    size = a.shape[da] if da is not NOT_MAPPED else b.shape[db]
    a, b = _to_front(a, da, size), _to_front(b, db, size)
    if a.ndim == 3:
        return gemm_p.bind(a, b, **params), 0
    # The primitive was batched already: merge the vmapped axis with its batch axis.
    v, nb = a.shape[:2]
    out = gemm_p.bind(a.reshape((v * nb,) + a.shape[2:]), b.reshape((v * nb,) + b.shape[2:]), **params)
    return out.reshape((v, nb) + out.shape[1:]), 0


batching.primitive_batchers[gemm_p] = _batch_rule
