"""The fallback: the same product through XLA's own dot, exactly as jnp.dot computes it.

Used on every platform other than CUDA, on CUDA GPUs that are not Hopper, and where the
kernel was not built. It is also the default lowering of the primitive, so one program
runs anywhere.
"""

from __future__ import annotations

from jax import lax


def gemm_reference(a, b, *, transpose_a: bool, transpose_b: bool, out_dtype):
    """C = op(A) @ op(B) per batch entry (leading dim when rank 3), like jnp.dot."""
    nb = a.ndim - 2
    a_contract = nb + (0 if transpose_a else 1)
    b_contract = nb + (1 if transpose_b else 0)
    batch = tuple(range(nb))
    preferred = None if out_dtype == a.dtype else out_dtype
    return lax.dot_general(a, b, (((a_contract,), (b_contract,)), (batch, batch)), preferred_element_type=preferred)
