"""jax_hopper: a warp-specialized Hopper (sm_90a) GEMM for JAX, as an XLA FFI custom call.

``dense`` is a dense layer (bias, activation and residual fused into the kernel's
epilogue); ``mlp`` a two-layer block whose backward pass also fuses the activation's
derivative. ``dot_general``, ``dot`` and ``matmul`` are drop-ins for ``lax.dot_general``,
``jnp.dot`` and ``jnp.matmul``. For f16/bf16 operands they lower to the
``jax_hopper_gemm`` custom call on Hopper GPUs and to XLA's dot on every other platform
(the fallback), so the same program runs anywhere; other dtypes are computed by jax.

Which eligible products run our kernel is the dispatcher's call (``dispatch_path``
says which and why): by default ("auto") a table of rules measured on the H200 sends
each shape to the faster of our kernel and XLA's dot; ``dispatch("kernel")`` (scoped)
or ``set_dispatch("kernel")`` always runs ours (where the kernel can take the shape:
every dimension below 2^31).
"""

from jax_hopper import _ffi
from jax_hopper._dispatch import dispatch, set_dispatch
from jax_hopper._ffi import GEMM_TARGET, kernel_available
from jax_hopper.ops import PRODUCT_NAME, dense, dispatch_path, dot, dot_general, matmul, mlp

__version__ = "0.1.0"
__all__ = ["GEMM_TARGET", "PRODUCT_NAME", "dense", "dispatch", "dispatch_path", "dot", "dot_general",
           "kernel_available", "matmul", "mlp", "set_dispatch"]

_ffi.register()
