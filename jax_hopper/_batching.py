"""vmap rules for the GEMM primitive (every vmapped product is one batched launch) and the
fused dense primitives.

Where the memory layout allows, a vmapped operand against an unbatched one joins A's
leading dims (A stored [..., M, K] against a rank-2 B: folded into M on each device) or
is folded into N (B stored [N, K]: one plain GEMM, no copy; B stored [K, N]: after one
copy of B, where broadcasting A would copy A once per example). Otherwise the vmapped axis
becomes a leading batch dimension of the primitive (an unbatched operand is broadcast),
next to the batch dims it already had (kept, not merged: a sharded one keeps its
sharding). (One exception: per-example
weights against an x whose inner leading dim is sharded on explicit mesh axes go to
XLA's dot, since folding that dim is not allowed.) A symbolic vmapped size (jax.export's
shape polymorphism) takes the reference arithmetic, batched by jax.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.interpreters import batching

from jax_hopper import _dispatch
from jax_hopper._fallback import (
    activation_grad_with_bias_grad_reference,
    dense_reference,
    dense_with_derivative_reference,
    gemm_reference,
    row_sum,
)
from jax_hopper._fused import dense_derivative_p, dense_grad_p, dense_p
from jax_hopper._primitive import PRODUCT_NAME, gemm_p, stages_of
from jax_hopper._sharding import merge_drops_explicit_sharding

NOT_MAPPED = None


def _to_front(x, dim, size):
    if dim is NOT_MAPPED:
        return jnp.broadcast_to(x, (size,) + x.shape)
    return jnp.moveaxis(x, dim, 0)


def _bind(a, b, params):
    """Binds the batched product. Its path and kind were picked for the unbatched shape,
    and vmap grows M or adds a batch dim. Where the dispatcher's rules picked them
    (params["rules"]: policy "auto" when the product was traced), the rules are asked
    again for the shape bound here: a product they took to our kernel for its own shape
    goes to XLA's dot (the primitive's XLA kind, still marked, so an outer vmap asks
    again) where they would not take the batched one (an odd-K product of 100 x 2048 x
    8191 runs the small-M kind; over two per-example weights it would be a batched
    default kernel on 16 blocks of B's columns, which lost). A kind asked for by policy
    "kernel" or by name (the internal gemm(kernel=...)) is kept, but for the small-M kind,
    compiled for one product in jnp.dot's layout: it is picked again (_dispatch.kernel_for)."""
    kernel = _dispatch.kind_for_shapes(params["kernel"], params.get("rules", False), a.shape, b.shape, a.dtype,
                                       params["out_dtype"], params["transpose_a"], params["transpose_b"])
    if kernel != params["kernel"]:
        params = dict(params, kernel=kernel, stages=stages_of(kernel))
    return gemm_p.bind(a, b, **params)


def _batch_rule(args, dims, **params):
    a, b = args
    da, db = dims
    if not _dispatch.numeric(a.shape[da] if da is not NOT_MAPPED else b.shape[db]):
        reference = functools.partial(gemm_reference, transpose_a=params["transpose_a"],
                                      transpose_b=params["transpose_b"], out_dtype=params["out_dtype"])
        return jax.vmap(reference, in_axes=(da, db))(a, b), 0
    ta, tb = params["transpose_a"], params["transpose_b"]
    if db is NOT_MAPPED and b.ndim == 2 and not ta:  # [v, ..., M, K] against [K, N]: a leading dim
        return _bind(jnp.moveaxis(a, da, 0), b, params), 0
    if da is NOT_MAPPED and b.ndim == 3 and tb:  # [..., M, K] against [v, N, K]: fold v into N
        b = jnp.moveaxis(b, db, 0)
        v, n, k = b.shape
        out = _bind(a, b.reshape(v * n, k), params)
        return out.reshape(out.shape[:-1] + (v, n)), out.ndim - 1
    if da is NOT_MAPPED and b.ndim == 3:  # [..., M, K] against [v, K, N]: v folded into N too
        b = jnp.moveaxis(b, db, 1)  # [K, v, N]: a copy of B (broadcasting A instead would copy A v times)
        if not merge_drops_explicit_sharding(jax.typeof(b), 1, 2):
            k, v, n = b.shape
            out = _bind(a, b.reshape(k, v * n), params)
            return out.reshape(out.shape[:-1] + (v, n)), out.ndim - 1
        db = 1
    nb = b.ndim - 2  # the primitive's batch dims, where both operands have them
    if db is NOT_MAPPED and b.ndim >= 3 and a.ndim == b.ndim + 1 and not ta:  # [v, B..., M, K] against [B..., K, N]
        a = jnp.moveaxis(a, da, nb)  # [B..., v, M, K]: v folded into M (a copy of A, not of B per example)
        if not merge_drops_explicit_sharding(jax.typeof(a), nb, nb + 1):
            v, m, k = a.shape[nb:]
            out = _bind(a.reshape(a.shape[:nb] + (v * m, k)), b, params)
            return out.reshape(a.shape[:nb] + (v, m, out.shape[-1])), nb
        da = nb
    nb = a.ndim - 2
    if da is NOT_MAPPED and a.ndim >= 3 and b.ndim == a.ndim + 1:  # [B..., M, K] against [v, B..., K, N] (or N, K)
        first = nb if tb else nb + 1  # v folded into N: [B..., v, N, K] or [B..., K, v, N]
        b = jnp.moveaxis(b, db, first)
        if not merge_drops_explicit_sharding(jax.typeof(b), first, first + 1):
            v, n = b.shape[first:first + 2]
            out = _bind(a, b.reshape(b.shape[:first] + (v * n,) + b.shape[first + 2:]), params)
            return out.reshape(out.shape[:-1] + (v, n)), out.ndim - 1
        db = first
    if da is not NOT_MAPPED and da == db and a.ndim == b.ndim and da <= a.ndim - 3:
        # v already sits among (or just after) the batch dims of both: one more batch dim
        # where it is, no transpose (moving it to the front of two batch dims fed XLA:CPU's
        # simplifier a pattern it aborts on).
        return _bind(a, b, params), da
    size = a.shape[da] if da is not NOT_MAPPED else b.shape[db]
    b_rank = b.ndim - (db is not NOT_MAPPED)  # the primitive's own ranks
    a_rank = a.ndim - (da is not NOT_MAPPED)
    a, b = _to_front(a, da, size), _to_front(b, db, size)
    if a_rank > b_rank:  # A's leading dims against a batched B: fold them into M first
        if merge_drops_explicit_sharding(jax.typeof(a), 1, a.ndim - 2):
            # ...unless the fold would merge a dim sharded on explicit mesh axes into the
            # one before it (x [B, S@x, K] against per-example weights), which jax refuses:
            # then XLA's dot, batched over the vmapped axis.
            dn = (((a.ndim - 1,), (2 if params["transpose_b"] else 1,)), ((0,), (0,)))
            return jax.lax.dot_general(a, b, dn, preferred_element_type=params["out_dtype"]), 0
        out = _bind(a.reshape((size, math.prod(a.shape[1:-1]), a.shape[-1])), b, params)
        return out.reshape(a.shape[:-1] + out.shape[-1:]), 0
    return _bind(a, b, params), 0  # the vmapped axis leads the primitive's batch dims (if any)


batching.primitive_batchers[gemm_p] = _batch_rule


def _dense_batch_rule(args, dims, *, activation, has_bias, has_residual, rules=False):
    """vmap over the fused dense primitive: a vmapped x (and residual) against shared
    weights and bias becomes a leading dim of x -- one fused launch (where the rules
    picked the fused kind, `rules`, they are asked again for the batched layer, which is
    jnp's where they would not fuse it). Anything else (per-example weights) is computed
    as the reference arithmetic, vmapped by jax."""
    x, w, bias, residual = args
    dx, dw, dbias, dres = dims
    # With `rules`, the lowering asks the rules again for the batched layer (_fused._cuda_impl).
    params = dict(activation=activation, has_bias=has_bias, has_residual=has_residual, rules=rules)
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not NOT_MAPPED)
    if dw is NOT_MAPPED and dbias is NOT_MAPPED and _dispatch.numeric(size):
        x = _to_front(x, dx, size)
        if has_residual:
            residual = _to_front(residual, dres, size)
        return dense_p.bind(x, w, bias, residual, **params), 0
    def reference(x, w, b, r):
        return dense_reference(x, w, b if has_bias else None, r if has_residual else None, activation=activation)

    # Named as the primitive's JVP names its output (a remat policy's handle): here no
    # dense_p is bound for that rule to run on.
    out = jax.vmap(reference)(*[_to_front(a, d, size) for a, d in zip(args, dims)])
    return checkpoint_name(out, PRODUCT_NAME), 0


batching.primitive_batchers[dense_p] = _dense_batch_rule


def _dense_grad_batch_rule(args, dims, *, activation, bias_grad):
    """vmap over the backward form: a vmapped g and z against a shared w join their
    leading dims (one launch; the bias gradient, per example, is then XLA's f32 sum of
    the rounded dz); per-example weights take the reference arithmetic."""
    g, w, z = args
    dg, dw, dz = dims
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not NOT_MAPPED)
    if dw is NOT_MAPPED and _dispatch.numeric(size):
        out, _ = dense_grad_p.bind(_to_front(g, dg, size), w, _to_front(z, dz, size), activation=activation,
                                   bias_grad=False)
        if not bias_grad:
            return [out, jnp.zeros((size, 0), out.dtype)], [0, 0]
        return [out, jax.vmap(lambda t: row_sum(t, t.dtype))(out)], [0, 0]

    def reference(g, w, z):
        return activation_grad_with_bias_grad_reference(g, w, z, activation=activation, bias_grad=bias_grad)

    return list(jax.vmap(reference)(*[_to_front(a, d, size) for a, d in zip(args, dims)])), [0, 0]


batching.primitive_batchers[dense_grad_p] = _dense_grad_batch_rule


def _dense_derivative_batch_rule(args, dims, *, activation, has_bias):
    """vmap over the derivative form: a vmapped x against a shared w and bias joins its
    leading dims (one launch); per-example weights take the reference arithmetic."""
    x, w, bias = args
    dx, dw, db = dims
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not NOT_MAPPED)
    if dw is NOT_MAPPED and db is NOT_MAPPED and _dispatch.numeric(size):
        outs = dense_derivative_p.bind(_to_front(x, dx, size), w, bias, activation=activation, has_bias=has_bias)
        return outs, [0, 0]

    def reference(x, w, b):
        return dense_with_derivative_reference(x, w, b if has_bias else None, activation=activation)

    bias = bias if has_bias else jnp.zeros((0,), x.dtype)
    db = db if has_bias else NOT_MAPPED
    return list(jax.vmap(reference)(*[_to_front(a, d, size) for a, d in zip((x, w, bias), (dx, dw, db))])), [0, 0]


batching.primitive_batchers[dense_derivative_p] = _dense_derivative_batch_rule
