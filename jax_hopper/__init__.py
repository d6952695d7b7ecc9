"""jax_hopper: a warp-specialized Hopper (sm_90a) GEMM for JAX, as an XLA FFI custom call.

``dot_general``, ``dot`` and ``matmul`` are drop-ins for ``lax.dot_general``,
``jnp.dot`` and ``jnp.matmul``. For f16/bf16 operands they lower to the
``jax_hopper_gemm`` custom call on Hopper GPUs and to XLA's dot on every other platform
(the fallback), so the same program runs anywhere; other dtypes are computed by jax.
"""

from jax_hopper import _ffi
from jax_hopper._ffi import GEMM_TARGET, kernel_available
from jax_hopper.ops import dot, dot_general, matmul

__version__ = "0.1.0"
__all__ = ["GEMM_TARGET", "dot", "dot_general", "kernel_available", "matmul"]

_ffi.register()
