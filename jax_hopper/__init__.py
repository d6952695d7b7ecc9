"""jax_hopper: a warp-specialized Hopper (sm_90a) GEMM for JAX, as an XLA FFI custom call.

``jax_hopper.matmul(a, b)`` lowers to the ``jax_hopper_gemm`` custom call on CUDA and
to XLA's dot on every other platform (the fallback), so the same program runs anywhere.
"""

from jax_hopper import _ffi
from jax_hopper._ffi import GEMM_TARGET, kernel_available
from jax_hopper.ops import matmul

__version__ = "0.1.0"
__all__ = ["GEMM_TARGET", "kernel_available", "matmul"]

_ffi.register()
