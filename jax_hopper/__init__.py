"""jax_hopper: a warp-specialized Hopper (sm_90a) GEMM for JAX, as an XLA FFI custom call.

``dot_general``, ``dot`` and ``matmul`` are drop-ins for ``lax.dot_general``, ``jnp.dot``
and ``jnp.matmul``, ``ragged_dot`` and ``ragged_dot_general`` for ``jax.lax``'s grouped
products (mixtures of experts); ``dense`` is a dense layer with its bias, activation and residual
fused into the kernel's epilogue, and ``mlp`` a two-layer block whose backward pass also
fuses the activation's derivative. ``all_gather_matmul`` and ``matmul_reduce_scatter``
(``collective``) are tensor-parallel products for shard_map whose transfers run beside
the products. f16/bf16 products lower to the ``jax_hopper_gemm``
custom call on Hopper GPUs and to XLA's dot on every other platform, so one program runs
anywhere; other dtypes are jax's.

Which eligible products run our kernel is the dispatcher's call (``dispatch_path`` says
which and why): by default ("auto") rules measured on the H200 send each shape to the
faster of our kernel and XLA's dot; ``dispatch("kernel")`` (scoped) or
``set_dispatch("kernel")`` always runs ours where the kernel can take the shape.
"""

from jax_hopper import _ffi
from jax_hopper._dispatch import dispatch, set_dispatch
from jax_hopper._ffi import kernel_available
from jax_hopper._kernels import GEMM as GEMM_TARGET
from jax_hopper.collective import all_gather_matmul, matmul_reduce_scatter
from jax_hopper.layers import dense, mlp
from jax_hopper.ops import dispatch_path, dot, dot_general, matmul
from jax_hopper.primitives.gemm import PRODUCT_NAME
from jax_hopper.ragged import ragged_dot, ragged_dot_general, ragged_dot_path

__version__ = "0.1.0"
__all__ = ["GEMM_TARGET", "PRODUCT_NAME", "all_gather_matmul", "dense", "dispatch", "dispatch_path", "dot",
           "dot_general", "kernel_available", "matmul", "matmul_reduce_scatter", "mlp", "ragged_dot",
           "ragged_dot_general", "ragged_dot_path", "set_dispatch"]

_ffi.register()
