"""The compiled extension: loading it, registering its XLA FFI targets, and whether the
kernel can run here. Nothing else in the package imports the extension."""

from __future__ import annotations

import functools
import warnings

import jax

from jax_hopper import _kernels

try:
    from jax_hopper import _jax_hopper  # built by CMake
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
    A CPU-only jaxlib accepts the registration (queued until a CUDA plugin loads)."""
    if _jax_hopper is None:
        return False
    for name, capsule in _jax_hopper.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    return True


@functools.cache
def compiled_instances() -> frozenset[_kernels.Instance]:
    """The (kind name, Instance) pairs this installation compiled (empty without the kernel)."""
    if _jax_hopper is None:
        return frozenset()
    return frozenset((kind, _kernels.Instance(dtype, a, b, stages))
                     for kind, dtype, a, b, stages in _jax_hopper.compiled_instances())


def kind_compiled(kind: str) -> bool:
    """Whether any instance of this kernel kind is compiled here."""
    return any(name == kind for name, _ in compiled_instances())


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
    """Whether this process sees CUDA GPUs, all of them Hoppers."""
    try:
        return bool(jax.devices("cuda")) and local_gpus_are_hopper()
    except RuntimeError:
        return False


def kernel_unavailable_reason() -> str | None:
    """Why a product sent to the kernel computes through XLA's dot here (not built, or a
    CUDA GPU that is not a Hopper), or None where the kernel runs."""
    if not register():
        return missing_kernel_reason()
    if not local_gpus_are_hopper():
        return "this CUDA GPU is not a Hopper (sm_90) GPU"
    return None
