"""The fallback: the same product through XLA's own dot, exactly as jnp.dot computes it.

Used on every platform other than CUDA, on CUDA GPUs that are not Hopper, and where the
kernel was not built. It is also the default lowering of the primitive, so one program
runs anywhere.
"""

from __future__ import annotations

from jax import lax


def gemm_reference(a, b, *, transpose_a: bool, transpose_b: bool):
    """C = op(A) @ op(B) in the operands' dtype, like jnp.dot(a, b)."""
    a_contract = 0 if transpose_a else 1
    b_contract = 1 if transpose_b else 0
    return lax.dot_general(a, b, (((a_contract,), (b_contract,)), ((), ())), preferred_element_type=a.dtype)
