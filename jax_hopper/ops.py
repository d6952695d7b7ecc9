"""Public operations. They validate at trace time and bind the GEMM primitive for the
operand types the kernel computes (two f16 or two bf16 arrays); anything else goes to
jnp with identical semantics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_hopper._primitive import KERNEL_DTYPES, gemm


def _check_array(name: str, x) -> None:
    if not isinstance(x, (jax.Array, np.ndarray)):
        raise TypeError(f"jax_hopper.matmul: {name} must be a jax or numpy array, got {type(x).__name__}")


def matmul(a, b):
    """C = A @ B for 2-D A [M, K] and B [K, N], like ``jnp.matmul(a, b)``.

    For two f16 or two bf16 operands this runs the Hopper kernel on CUDA (f32
    accumulation, output rounded to the input type) and XLA's dot elsewhere; other dtypes
    are computed by ``jnp.matmul`` itself.
    """
    _check_array("a", a)
    _check_array("b", b)
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"jax_hopper.matmul takes 2-D operands, got shapes {a.shape} and {b.shape}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(
            f"jax_hopper.matmul: contracting dimensions differ: a{a.shape} @ b{b.shape} needs "
            f"a.shape[1] == b.shape[0]"
        )
    if a.dtype == b.dtype and a.dtype in KERNEL_DTYPES:
        return gemm(a, b)
    return jnp.matmul(a, b)
