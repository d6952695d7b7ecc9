"""How a dot_general maps onto the kernel's batched [B...,] M x K times K x N product.

The kernel reads A as [M, K] or [K, M] and B as [K, N] or [N, K] in place, so any
dimension numbers whose batch dims lead (in order) and whose free and contracting dims
each form one contiguous block reshape for free into one of those four layouts. The
batch dims stay as they are (the FFI handler folds them into one on each device), so a
sharded inner one -- attention's heads in [batch, heads, S, D] -- keeps its sharding. Other
dimension orders are first transposed into the [batch, free, contract] form (a copy
XLA makes; rare in practice). An lhs [..., M, K] with no batch dims (jnp's N-D x @ W)
keeps its free dims: the primitive folds them into M on each device, so a sharded
inner one (a sequence dim) is not gathered first.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class GemmPlan:
    lhs_perm: tuple[int, ...] | None  # transpose before the reshape, None if not needed
    lhs_shape: tuple[int, ...]  # ([B...,] M, K) or ([B...,] K, M), or (free dims..., K)
    transpose_a: bool
    rhs_perm: tuple[int, ...] | None
    rhs_shape: tuple[int, ...]  # ([B...,] K, N) or ([B...,] N, K)
    transpose_b: bool
    out_shape: tuple[int, ...]  # dot_general's: batch + lhs free + rhs free

    @property
    def keeps_lhs_free_dims(self) -> bool:
        return len(self.lhs_shape) > len(self.rhs_shape)


def plan_dot_general(lhs_shape, rhs_shape, dimension_numbers) -> GemmPlan:
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = tuple(lc), tuple(rc), tuple(lb), tuple(rb)
    nb = len(lb)
    lhs_free = [d for d in range(len(lhs_shape)) if d not in lc and d not in lb]
    rhs_free = [d for d in range(len(rhs_shape)) if d not in rc and d not in rb]
    # K is flattened in the lhs's memory order; the rhs must pair its dims the same way.
    pair_order = sorted(range(len(lc)), key=lambda i: lc[i])
    lhs_k = [lc[i] for i in pair_order]
    rhs_k = [rc[i] for i in pair_order]

    batch = tuple(lhs_shape[d] for d in lb)
    m = math.prod(lhs_shape[d] for d in lhs_free)
    n = math.prod(rhs_shape[d] for d in rhs_free)
    k = math.prod(lhs_shape[d] for d in lc)
    lead = batch

    lhs_rest = list(range(nb, len(lhs_shape)))
    lhs_perm, transpose_a = None, False
    if lb == tuple(range(nb)) and lhs_rest == lhs_free + lhs_k:
        pass  # [batch, M..., K...]: K-major A
    elif lb == tuple(range(nb)) and lhs_rest == lhs_k + lhs_free:
        transpose_a = True  # [batch, K..., M...]: M-major A
    else:
        lhs_perm = lb + tuple(lhs_free) + tuple(lhs_k)

    rhs_rest = list(range(nb, len(rhs_shape)))
    rhs_perm, transpose_b = None, False
    if rb == tuple(range(nb)) and rhs_rest == rhs_k + rhs_free:
        pass  # [batch, K..., N...]: N-major B (jnp.dot's)
    elif rb == tuple(range(nb)) and rhs_rest == rhs_free + rhs_k:
        transpose_b = True  # [batch, N..., K...]: K-major B
    else:
        rhs_perm = rb + tuple(rhs_k) + tuple(rhs_free)

    a_shape = lead + ((k, m) if transpose_a else (m, k))
    if not nb and lhs_perm is None and not transpose_a and len(lhs_free) > 1:
        a_shape = tuple(lhs_shape[d] for d in lhs_free) + (k,)
    return GemmPlan(
        lhs_perm=lhs_perm,
        lhs_shape=a_shape,
        transpose_a=transpose_a,
        rhs_perm=rhs_perm,
        rhs_shape=lead + ((n, k) if transpose_b else (k, n)),
        transpose_b=transpose_b,
        out_shape=batch + tuple(lhs_shape[d] for d in lhs_free) + tuple(rhs_shape[d] for d in rhs_free),
    )
