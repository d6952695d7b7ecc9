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
    out = jax.jit(lambda p, *xs: fn(*xs), donate_argnums=0)(poison, *args)
    jax.block_until_ready(out)
    return out, out.unsafe_buffer_pointer() == ptr
