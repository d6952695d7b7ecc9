"""The f16-accumulation model the f16-accumulating kernel is held to.

The kernel adds one wgmma's 16 products at a time into an f16 accumulator. Emulated
here step by step -- the 16-product partial sum in f32, added to the f16 accumulator and
rounded to nearest f16 -- this model matched the relative error measured on the H200
with the benchmark's data to within 1%, while rounding toward zero would give 10-30x
more. So:
  - every element lies within twice 2^-10 * sum over steps of |partial sum| of the f32
    reference (one f16 unit roundoff per accumulator update, whichever the rounding;
    twice for the perturbed partial sums and the unspecified in-step sum);
  - the relative error is at most 1.25x the emulation's (room for its double rounding
    in f32 then f16, not for a lost K step, which adds ~sqrt(16 / K) relative);
  - from K = 512 on, it is at least half the emulation's: the sums really are f16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from helpers import relative_error, seed_normal

F16_UNIT_ROUNDOFF_ANY_ROUNDING = 2.0**-10
F16_ULP = 2.0**-10  # relative: one rounding of an f32 sum to f16 is within half of it
MMA_K = 16
BOUND_SLACK = 2.0
MODEL_FACTOR = 1.25
MANY_STEPS_K = 512
ABS_FLOOR = 1e-6  # f32 noise of the reference itself


def inputs(a_shape, b_shape, k, seed):
    ka, kb = jax.random.split(jax.random.key(seed))
    return seed_normal(ka, a_shape, jnp.float16, k), seed_normal(kb, b_shape, jnp.float16, k)


def canonical(a, b, dims):
    """a as [..., M, K] and b as [..., K, N] (batch dims, if any, lead in both)."""
    (ca, cb), (ba, _) = dims
    if not ba and ca[0] == 0:
        a = a.T
    if not ba and cb[0] == 1:
        b = b.T
    return a, b


@jax.jit
def emulate_steps(a, b):
    """Scan over K in steps of MMA_K: the exact f32 sum, the f16-accumulated one and the
    sum over steps of |exact partial sum| (a zero-padded last step adds the same as a
    shorter one)."""
    k = a.shape[-1]
    steps = -(-k // MMA_K)
    pad = steps * MMA_K - k
    a = jnp.pad(a.astype(jnp.float32), [(0, 0)] * (a.ndim - 1) + [(0, pad)])
    b = jnp.pad(b.astype(jnp.float32), [(0, 0)] * (b.ndim - 2) + [(0, pad), (0, 0)])
    a_steps = jnp.moveaxis(a.reshape(a.shape[:-1] + (steps, MMA_K)), -2, 0)  # [S, ..., M, 16]
    b_steps = jnp.moveaxis(b.reshape(b.shape[:-2] + (steps, MMA_K, b.shape[-1])), -3, 0)  # [S, ..., 16, N]
    out_shape = a.shape[:-1] + (b.shape[-1],)

    def step(carry, ab):
        exact, emulated, total = carry
        partial = jnp.matmul(ab[0], ab[1], precision="highest")
        exact = exact + partial
        emulated = (emulated.astype(jnp.float32) + partial).astype(jnp.float16)
        return (exact, emulated, total + jnp.abs(exact)), None

    zeros = jnp.zeros(out_shape, jnp.float32)
    (_, emulated, total), _ = jax.lax.scan(step, (zeros, zeros.astype(jnp.float16), zeros), (a_steps, b_steps))
    return emulated, total


def f16_accumulation_model(a, b, dims):
    """(emulated f16-accumulated C, per-element bound 2^-10 * sum_steps |partial sum|)."""
    emulated, total = emulate_steps(*canonical(a, b, dims))
    return emulated, F16_UNIT_ROUNDOFF_ANY_ROUNDING * total


def check_f16_accumulated(out, a, b, dims):
    ref = jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dims, precision="highest")
    emulated, bound = f16_accumulation_model(a, b, dims)
    excess = jnp.abs(out.astype(jnp.float32) - ref) - BOUND_SLACK * bound
    assert float(excess.max()) <= ABS_FLOOR, f"{int((excess > ABS_FLOOR).sum())} elements past the bound"
    err, err_model = relative_error(out, ref), relative_error(emulated, ref)
    assert err <= MODEL_FACTOR * err_model + ABS_FLOOR, f"{err:.3e} vs the f16-accumulation model's {err_model:.3e}"
    if a.shape[dims[0][0][0]] >= MANY_STEPS_K:
        assert err >= err_model / 2, f"{err:.3e}: too accurate for f16 sums (model {err_model:.3e})"


LAYOUTS = {  # stored A, stored B, dimension numbers
    "NN": (lambda m, n, k: ((m, k), (k, n)), (((1,), (0,)), ((), ()))),
    "NT": (lambda m, n, k: ((m, k), (n, k)), (((1,), (1,)), ((), ()))),
    "TN": (lambda m, n, k: ((k, m), (k, n)), (((0,), (0,)), ((), ()))),
    "TT": (lambda m, n, k: ((k, m), (n, k)), (((0,), (1,)), ((), ()))),
}


