"""Helpers shared by the test modules (importable: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def hopper_devices():
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return []
    return [d for d in devices if str(getattr(d, "compute_capability", "")).startswith("9")]


def seed_normal(key, shape, dtype, k):
    """Standard normal scaled by K^-1/4 (the seed's data): C has unit variance."""
    return (jax.random.normal(key, shape, jnp.float32) / k**0.25).astype(dtype)


def f32_reference(a, b):
    """C in f32 from the same (rounded) inputs, with true f32 products on the GPU."""
    return jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def relative_error(c, ref) -> float:
    """||C - C_ref||_F / ||C_ref||_F, computed in f32 on the device."""
    diff = c.astype(jnp.float32) - ref
    return float(jnp.linalg.norm(diff) / jnp.linalg.norm(ref))


def run_into_poison(fn, out_shape, dtype, *args):
    """Runs jit(fn)(*args) with its output buffer pre-filled with NaN.

    The NaN buffer is donated to a jit whose only output has the same type, so XLA
    aliases it to the output: any element the kernel fails to write stays NaN. Returns
    (output, whether the output really is the poisoned buffer).
    """
    poison = jnp.full(out_shape, jnp.nan, dtype)
    ptr = poison.unsafe_buffer_pointer()
    # keep_unused: otherwise jit prunes the unused poison argument and nothing is aliased.
    out = jax.jit(lambda p, *xs: fn(*xs), donate_argnums=0, keep_unused=True)(poison, *args)
    jax.block_until_ready(out)
    return out, out.unsafe_buffer_pointer() == ptr


# One unit in the last place, relative, of each output type: two correct results that
# round (nearly) the same f32 sum can differ by this much.
ULP = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23}
F32_UNIT_ROUNDOFF = 2.0**-24


def assert_same_product(out, expected, lhs, rhs, dimension_numbers):
    """out and expected are two f32-accumulated roundings of the same dot_general.

    Per element they may differ by one ulp of the output type plus twice the worst-case
    f32 summation error (K * u * sum|a||b|, for each of the two accumulation orders).
    Anything beyond that is a wrong element, not rounding.
    """
    import numpy as np
    from jax import lax

    assert out.shape == expected.shape and out.dtype == expected.dtype, (out.shape, out.dtype, expected.shape,
                                                                        expected.dtype)
    abs_bound = lax.dot_general(jnp.abs(lhs.astype(jnp.float32)), jnp.abs(rhs.astype(jnp.float32)),
                                dimension_numbers, precision=lax.Precision.HIGHEST)
    (contract, _), _ = dimension_numbers
    k = 1
    for d in contract:
        k *= lhs.shape[d]
    o = np.asarray(out.astype(jnp.float32), np.float64)
    e = np.asarray(expected.astype(jnp.float32), np.float64)
    bound = ULP[jnp.dtype(out.dtype).name] * np.abs(e) + 2 * k * F32_UNIT_ROUNDOFF * np.asarray(abs_bound, np.float64)
    assert not np.isnan(o).any()
    bad = np.abs(o - e) > bound
    assert not bad.any(), f"{bad.sum()} of {bad.size} elements differ by more than rounding; worst " \
                          f"{np.max(np.abs(o - e) - bound):.3e}"
