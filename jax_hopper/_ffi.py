"""Loading the compiled extension and registering its XLA FFI targets with jax.

Kept apart from the op definitions: everything here is about the shared library, and
nothing else in the package imports the extension directly.
"""

from __future__ import annotations

import functools
import warnings

import jax

GEMM_TARGET = "jax_hopper_gemm"
GEMM_FUSED_TARGET = "jax_hopper_gemm_fused"  # C = act(A @ B + bias) + residual
GEMM_FUSED_GRAD_TARGET = "jax_hopper_gemm_fused_grad"  # (A @ B) * act'(z), and its column sums
GEMM_FUSED_DERIVATIVE_TARGET = "jax_hopper_gemm_fused_derivative"  # act(A @ B + bias), act'(A @ B + bias)

try:
    from jax_hopper import _jax_hopper  # the nanobind extension built by CMake
except ImportError as err:  # built without nvcc, or not built at all
    _jax_hopper = None
    _IMPORT_ERROR: ImportError | None = err
else:
    _IMPORT_ERROR = None


def kernel_available() -> bool:
    """True when the CUDA kernel was compiled into this installation."""
    return _jax_hopper is not None


@functools.cache
def register() -> bool:
    """Registers the FFI targets for the CUDA platform once; returns kernel_available().

    Registering on a CPU-only jaxlib is accepted (queued until a CUDA plugin loads), so
    this is safe to call at import everywhere.
    """
    if _jax_hopper is None:
        return False
    for name, capsule in _jax_hopper.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    return True


@functools.cache
def warn_no_kernel_once(reason: str) -> None:
    warnings.warn(f"jax_hopper: {reason}; computing through XLA's dot instead.", RuntimeWarning, stacklevel=3)


def missing_kernel_reason() -> str:
    return f"the CUDA kernel is not built into this installation ({_IMPORT_ERROR})"


@functools.cache
def local_gpus_are_hopper() -> bool:
    """True unless this process sees a CUDA GPU that is not a Hopper (sm_90) one."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return True  # lowering for CUDA from a machine without one: target Hopper
    return all(str(getattr(d, "compute_capability", "9.0")).startswith("9") for d in devices)


def hopper_gpus_visible() -> bool:
    """Whether this process sees CUDA GPUs, all of them Hoppers (not merely a machine
    lowering for CUDA without one)."""
    try:
        return bool(jax.devices("cuda")) and local_gpus_are_hopper()
    except RuntimeError:
        return False


def kernel_unavailable_reason() -> str | None:
    """Why a product sent to the kernel computes through XLA's dot here instead (not
    built, or a CUDA GPU that is not a Hopper), or None where the kernel runs."""
    if not register():
        return missing_kernel_reason()
    if not local_gpus_are_hopper():
        return "this CUDA GPU is not a Hopper (sm_90) GPU"
    return None
