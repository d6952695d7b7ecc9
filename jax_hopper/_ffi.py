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
    """True where products sent to the kernel run on it: it was compiled into this
    installation, and neither the NVIDIA driver nor a visible GPU rules it out (where it
    is False, they compute through XLA's dot, and the first one warns why)."""
    return kernel_unavailable_reason() is None


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


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


@functools.cache
def driver_reason() -> str | None:
    """Why the installed NVIDIA driver cannot run this build's kernel, or None. The
    extension links its CUDA runtime statically, which needs a driver of at least its
    major version (with an older one every call would fail). None without a driver:
    then no CUDA GPU is visible, and lowering for one from here targets Hopper."""
    if _jax_hopper is None:
        return None
    driver, runtime = _jax_hopper.cuda_versions()
    if driver == 0 or driver // 1000 >= runtime // 1000:
        return None
    return (f"the NVIDIA driver supports CUDA {_cuda_version(driver)}, older than the CUDA "
            f"{_cuda_version(runtime)} runtime this build of jax_hopper links (it needs a driver for CUDA "
            f"{runtime // 1000}.0 or newer; or rebuild it with a CUDA {driver // 1000} toolkit)")


def kernel_unavailable_reason() -> str | None:
    """Why a product sent to the kernel computes through XLA's dot here (not built, a
    driver too old for it, or a CUDA GPU that is not a Hopper), or None where it runs."""
    if not register():
        return missing_kernel_reason()
    if (reason := driver_reason()) is not None:
        return reason
    if not local_gpus_are_hopper():
        return "this CUDA GPU is not a Hopper (sm_90) GPU"
    return None


# ---- the workspace -------------------------------------------------------------------------
# Every FFI call's last result: bytes that XLA plans like any buffer (never returned to
# the user), holding the dynamic order's ticket counter and a split's partial sums. Sized
# for the lowering's GPU, or, lowering for CUDA from a machine without one, for an H100
# or H200 (132 SMs); on another GPU the kernel fits its split into what it is given.
DEFAULT_SMS = 132


@functools.cache
def lowering_sms() -> int:
    """SMs of the GPUs this process lowers for (the largest of them), or DEFAULT_SMS."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return DEFAULT_SMS
    return max((getattr(d, "core_count", 0) or DEFAULT_SMS for d in devices), default=DEFAULT_SMS)


def workspace(kind: str, dtype: str, major_a: str, major_b: str, stages: int, batch: int, m: int, n: int,
              k: int) -> jax.ShapeDtypeStruct:
    """The workspace result of a call of `kind` on a problem of (batch, M, N, K) with
    operands of `dtype` ("f16" or "bf16") in these majors ("K" or "MN")."""
    size = _workspace_bytes(kind, dtype, major_a, major_b, stages, batch, m, n, k, lowering_sms())
    return jax.ShapeDtypeStruct((size,), "uint8")


@functools.lru_cache(maxsize=1024)
def _workspace_bytes(kind, dtype, major_a, major_b, stages, batch, m, n, k, sms) -> int:
    return _jax_hopper.workspace_bytes(_kernels.KIND_BY_NAME[kind].id, dtype, major_a, major_b, stages, batch, m, n,
                                       k, sms)
