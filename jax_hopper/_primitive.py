"""The GEMM primitive: abstract evaluation and its lowerings.

`gemm_p` computes C[M, N] = op(A) @ op(B) for 2-D f16/bf16 operands of one dtype, with
A stored [M, K] (or [K, M] with transpose_a) and B stored [K, N] (or [N, K] with
transpose_b). On CUDA it lowers to the `jax_hopper_gemm` FFI custom call; everywhere
else to XLA's dot (see _fallback.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

try:
    from jax.core import ShapedArray
except ImportError:  # moved in some jax releases
    from jax._src.core import ShapedArray

from jax_hopper import _ffi
from jax_hopper._fallback import gemm_reference

KERNEL_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
DEFAULT_STAGES = 4
# TMA needs 16-byte global row strides: a stored row of 16-bit elements must hold a
# multiple of 8 of them. Shorter rows are padded on the way into the custom call.
TMA_ROW_MULTIPLE = 8

gemm_p = Primitive("jax_hopper_gemm")


def _mnk(a_shape, b_shape, transpose_a, transpose_b):
    m, k = (a_shape[1], a_shape[0]) if transpose_a else a_shape
    k_b, n = (b_shape[1], b_shape[0]) if transpose_b else b_shape
    return m, n, k, k_b


def _abstract_eval(a, b, *, transpose_a, transpose_b, stages):
    del stages
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"jax_hopper_gemm takes 2-D operands, got {a.shape} and {b.shape}")
    if a.dtype != b.dtype or a.dtype not in KERNEL_DTYPES:
        raise TypeError(f"jax_hopper_gemm takes two f16 or two bf16 operands, got {a.dtype} and {b.dtype}")
    m, n, k, k_b = _mnk(a.shape, b.shape, transpose_a, transpose_b)
    if k != k_b:
        raise ValueError(f"jax_hopper_gemm: contracting sizes differ: {a.shape} and {b.shape} "
                         f"(transpose_a={transpose_a}, transpose_b={transpose_b})")
    return ShapedArray((m, n), a.dtype)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _pad_axis(x, axis: int, size: int):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def _pad_for_tma(a, b, transpose_a, transpose_b):
    """Pads stored rows to a multiple of 8 elements. K is padded with zeros on both
    operands (zeros add nothing to the sum); a padded M or N row tail is never read."""
    m, n, k, _ = _mnk(a.shape, b.shape, transpose_a, transpose_b)
    k_major_a, k_major_b = not transpose_a, transpose_b
    k_pad = _round_up(k, TMA_ROW_MULTIPLE) if (k_major_a or k_major_b) else k
    a = _pad_axis(a, 0 if transpose_a else 1, k_pad)
    b = _pad_axis(b, 1 if transpose_b else 0, k_pad)
    if transpose_a:
        a = _pad_axis(a, 1, _round_up(m, TMA_ROW_MULTIPLE))
    if not transpose_b:
        b = _pad_axis(b, 1, _round_up(n, TMA_ROW_MULTIPLE))
    return a, b


@functools.cache
def _local_gpus_are_hopper() -> bool:
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return True  # lowering for CUDA from a machine without one: target Hopper
    return all(str(getattr(d, "compute_capability", "9.0")).startswith("9") for d in devices)


def _cuda_impl(a, b, *, transpose_a, transpose_b, stages):
    if not _ffi.register():
        _ffi.warn_no_kernel_once(_ffi.missing_kernel_reason())
        return gemm_reference(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
    if not _local_gpus_are_hopper():
        _ffi.warn_no_kernel_once("this CUDA GPU is not a Hopper (sm_90) GPU")
        return gemm_reference(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
    m, n, _, _ = _mnk(a.shape, b.shape, transpose_a, transpose_b)
    a, b = _pad_for_tma(a, b, transpose_a, transpose_b)
    call = jax.ffi.ffi_call(_ffi.GEMM_TARGET, jax.ShapeDtypeStruct((m, n), a.dtype))
    return call(a, b, transpose_a=np.int32(transpose_a), transpose_b=np.int32(transpose_b), stages=np.int32(stages))


def _default_impl(a, b, *, transpose_a, transpose_b, stages):
    del stages
    return gemm_reference(a, b, transpose_a=transpose_a, transpose_b=transpose_b)


@functools.cache
def _jitted_bind(transpose_a, transpose_b, stages):
    return jax.jit(functools.partial(gemm_p.bind, transpose_a=transpose_a, transpose_b=transpose_b, stages=stages))


def _eager_impl(a, b, *, transpose_a, transpose_b, stages):
    return _jitted_bind(transpose_a, transpose_b, stages)(a, b)


gemm_p.def_impl(_eager_impl)
gemm_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(gemm_p, mlir.lower_fun(_default_impl, multiple_results=False))
mlir.register_lowering(gemm_p, mlir.lower_fun(_cuda_impl, multiple_results=False), platform="cuda")


def gemm(a, b, *, transpose_a: bool = False, transpose_b: bool = False, stages: int = DEFAULT_STAGES):
    """Binds the primitive (operands already validated by the public ops)."""
    return gemm_p.bind(a, b, transpose_a=bool(transpose_a), transpose_b=bool(transpose_b), stages=int(stages))
