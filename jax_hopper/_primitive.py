"""The GEMM primitive: abstract evaluation and its lowerings.

`gemm_p` computes C = op(A) @ op(B) for f16/bf16 operands of one dtype, with A stored
[M, K] (or [K, M] with transpose_a) and B stored [K, N] (or [N, K] with transpose_b),
optionally with the same leading batch dims on both (each its own dim, so a sharded
one -- attention's heads -- keeps its sharding; the FFI handler folds them into one), or
with leading dims on A alone (A [..., M, K] against a rank-2 B: jnp's x @ W, folded into
M on each device, so a sharded leading dim keeps its sharding). C is [(batch | ...,) M, N] in
`out_dtype`: the operands' type, or f32 straight from the f32 accumulator. On CUDA it
lowers to the `jax_hopper_gemm` FFI custom call; everywhere else to XLA's dot (see
_fallback.py). Autodiff and vmap rules live in _autodiff.py and _batching.py.
"""

from __future__ import annotations

import functools

import jax
import jax._src.dispatch
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jax_hopper import _ffi
from jax_hopper._fallback import gemm_reference
from jax_hopper._sharding import lowering as sharded_lowering
from jax_hopper._sharding import output_sharding

KERNEL_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
# Kernel kinds, as the FFI handler numbers them (cuda/gemm/gemm.h: KernelKind): the
# seed's V5 (one CTA per tile); the persistent kernel (one CTA per SM, 2-CTA clusters
# multicasting B, TMA-store epilogue staged and stored under the next tile's first MMAs,
# setmaxnreg, tiles by ticket in the order clusters finish), the default; its
# ablations, each without one technique ("persistent_static": a grid-stride tile order;
# "persistent_immediate": also the epilogue between tiles), and the experimental
# stream-K tail (f16, jnp.dot's layout only).
# The opt-in f16-accumulating kind (256x256 tiles, four consumer warpgroups; f16 only)
# is reached through accumulation="f16" on the public ops.
# 5 is the fused kind, reached through jax_hopper.dense only. "small_m" is for decode-
# sized M (64x128 tiles, every tile's K range split into pieces, one CTA each, two CTAs
# per SM, a tile's pieces summed within a cluster where that pays; f16/bf16, jnp.dot's
# layout), and for products with an odd K whose 64x128 tiles fill one wave (up to 2048
# rows: _dispatch.kernel_for).
KERNELS = {"v5": 0, "persistent": 1, "persistent_basic": 2, "persistent_tma": 3, "persistent_wait0": 4,
           "persistent_streamk": 6, "persistent_f16acc": 7, "small_m": 8, "persistent_pingpong": 9,
           "persistent_immediate": 10, "persistent_static": 11}
DEFAULT_KERNEL = "persistent"
# Not one of ours: the primitive lowered to XLA's dot (as off CUDA). The tangent of a
# product the dispatcher leaves to XLA whose derivative should still follow _autodiff's
# rules (ops: an f32 result of f16 operands: the cotangent rounded, the backward products
# at the 16-bit rate).
XLA_KERNEL = "xla"
F16_ACCUMULATION_KERNEL = "persistent_f16acc"
SMALL_M_KERNEL = "small_m"
PINGPONG_KERNEL = "persistent_pingpong"  # experimental, never dispatched
DEFAULT_STAGES = 4
# Kinds compiled with another ring depth (instances.def): 64 KB stages leave room for 3,
# the (experimental) ping-pong kind's 32 KB ones for 6.
KERNEL_STAGES = {F16_ACCUMULATION_KERNEL: 3, PINGPONG_KERNEL: 6}


def stages_of(kernel: str) -> int:
    """The ring depth a kernel kind is compiled with by default."""
    return KERNEL_STAGES.get(kernel, DEFAULT_STAGES)
# TMA needs 16-byte global row strides: a stored row of 16-bit elements must hold a
# multiple of 8 of them. Shorter rows are padded on the way into the custom call.
TMA_ROW_MULTIPLE = 8

gemm_p = Primitive("jax_hopper_gemm")
# The name our kernels' products carry for jax.checkpoint policies (the plain products,
# the fused dense layers' outputs and the values their derivatives keep): jax's dot
# policies (dots_saveable, ...) match lax.dot_general only, so a remat that should save
# products names them: save_only_these_names(PRODUCT_NAME), or save_from_both_policies(
# dots_saveable, save_only_these_names(PRODUCT_NAME)) for jnp's dots and ours alike.
PRODUCT_NAME = "jax_hopper_product"


def _mnk(a_shape, b_shape, transpose_a, transpose_b):
    m, k = (a_shape[-1], a_shape[-2]) if transpose_a else a_shape[-2:]
    k_b, n = (b_shape[-1], b_shape[-2]) if transpose_b else b_shape[-2:]
    return m, n, k, k_b


def _abstract_eval(a, b, *, transpose_a, transpose_b, out_dtype, kernel, stages, rules=False):
    del kernel, stages, rules
    batched = a.ndim == b.ndim >= 3 and a.shape[:-2] == b.shape[:-2]
    if not (batched or (b.ndim == 2 and (a.ndim == 2 or (a.ndim > 2 and not transpose_a)))):
        raise ValueError(f"jax_hopper_gemm takes two 2-D operands, two operands with the same batch dims, or A "
                         f"[..., M, K] against a 2-D B; got {a.shape} and {b.shape} (transpose_a={transpose_a})")
    if a.dtype != b.dtype or a.dtype not in KERNEL_DTYPES:
        raise TypeError(f"jax_hopper_gemm takes two f16 or two bf16 operands, got {a.dtype} and {b.dtype}")
    if out_dtype not in (a.dtype, jnp.dtype(jnp.float32)):
        raise TypeError(f"jax_hopper_gemm computes {a.dtype} or float32 results, not {out_dtype}")
    m, n, k, k_b = _mnk(a.shape, b.shape, transpose_a, transpose_b)
    if k != k_b:
        raise ValueError(f"jax_hopper_gemm: contracting sizes differ: {a.shape} and {b.shape} "
                         f"(transpose_a={transpose_a}, transpose_b={transpose_b})")
    # `a` and `b` vary over the same shard_map manual axes (gemm() sees to it); the result
    # inherits them, and whatever else the aval carries, from `a`; its sharding (explicit
    # mesh axes) follows jnp.dot's rule.
    sharding = output_sharding(a, b, transpose_a, transpose_b)
    extra = {} if sharding is None else {"sharding": sharding}
    return a.update(shape=a.shape[:-2] + (m, n), dtype=out_dtype, weak_type=False, **extra)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _pad_axis(x, axis: int, size: int):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def _pad_for_tma(a, b, transpose_a, transpose_b):
    """Pads stored rows to a multiple of 8 elements. A K-major operand's K is padded with
    zeros (zeros add nothing to the sum); an operand whose K is its outer dimension keeps
    its K rows, and the kernel reads zeros past them (TMA's out-of-bounds fill), so
    jnp.dot's B [K, N] with an odd K is not copied. A padded M or N row tail is never read."""
    m, n, k, _ = _mnk(a.shape, b.shape, transpose_a, transpose_b)
    # Only each stored row (the last axis) is padded; A may have more leading dims than B.
    a = _pad_axis(a, -1, _round_up(m if transpose_a else k, TMA_ROW_MULTIPLE))
    b = _pad_axis(b, -1, _round_up(k if transpose_b else n, TMA_ROW_MULTIPLE))
    return a, b


def _reference(a, b, *, transpose_a, transpose_b, out_dtype):
    """XLA's dot standing in for the kernel. Under explicit mesh axes a contraction over a
    sharded dimension needs the result's sharding spelled out (the derivative's
    A^T dC contracts a sharded M): the primitive's own, jnp.dot's rule."""
    sharding = output_sharding(jax.typeof(a), jax.typeof(b), transpose_a, transpose_b)
    return gemm_reference(a, b, transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=out_dtype,
                          out_sharding=sharding)


def _cuda_impl(a, b, *, transpose_a, transpose_b, out_dtype, kernel, stages, rules=False):
    from jax_hopper._dispatch import fits_kernel, kind_for_shapes  # _dispatch imports this module

    reason = _ffi.kernel_unavailable_reason()
    if reason is not None:
        _ffi.warn_no_kernel_once(reason)
        return _reference(a, b, transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=out_dtype)
    if rules:
        # Under sharding this runs on each device's shards (_sharding.py), smaller than the
        # product the rules picked the kind for: they pick again for the shards, so one
        # outside what they measured goes to XLA's dot or another kind (an odd-K
        # 2048x1024x4095 runs the small-M kind; its 512-row shards would be the default
        # kernel's 16 tiles, a loss). Unsharded, the same shapes give the same kind. A
        # kind asked for by name (small_m included: its shards are still one product in
        # jnp.dot's layout) or by policy "kernel" runs as asked.
        picked = kind_for_shapes(kernel, rules, a.shape, b.shape, a.dtype, out_dtype, transpose_a, transpose_b)
        if picked == XLA_KERNEL:
            return _reference(a, b, transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=out_dtype)
        if picked != kernel:
            kernel, stages = picked, stages_of(picked)
    if not fits_kernel(a.shape, b.shape, transpose_a, transpose_b):  # a kind forced past the kernel's int32 limits
        return _reference(a, b, transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=out_dtype)
    m, n, _, _ = _mnk(a.shape, b.shape, transpose_a, transpose_b)
    # A [..., M, K] against a 2-D B keeps its leading dims: the FFI handler folds them into
    # M (contiguous rows), as a reshape here could not under explicit mesh axes.
    a, b = _pad_for_tma(a, b, transpose_a, transpose_b)
    call = jax.ffi.ffi_call(_ffi.GEMM_TARGET, jax.ShapeDtypeStruct(a.shape[:-2] + (m, n), out_dtype))
    return call(a, b, transpose_a=np.int32(transpose_a), transpose_b=np.int32(transpose_b),
                kernel=np.int32(KERNELS[kernel]), stages=np.int32(stages))


def _default_impl(a, b, *, transpose_a, transpose_b, out_dtype, kernel, stages, rules=False):
    del kernel, stages, rules
    return _reference(a, b, transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=out_dtype)


def eager_impl(primitive):
    """A primitive's impl rule for eager calls: jax's own for its primitives, which compiles
    the primitive alone (one executable per params, cached) and does so under
    jax.disable_jit too (a jit of the bind recursed there: the bind called the impl again)."""
    return functools.partial(jax._src.dispatch.apply_primitive, primitive)


gemm_p.def_impl(eager_impl(gemm_p))
gemm_p.def_abstract_eval(_abstract_eval)
# Both lowerings are partitioned as jnp.dot's would be (see _sharding.py); unsharded
# products lower to the local product. XLA's dot (_default_impl) also serves partly
# manual shard_map bodies.


def _lowering(local_impl):
    """gemm_p's lowering: local_impl partitioned by our rules (_sharding.py), or for
    kernel XLA_KERNEL XLA's own dot, which XLA partitions itself: that product is jnp's
    in the compiled program, only its derivative rule is ours."""
    ours = sharded_lowering(local_impl, _default_impl)
    xla = mlir.lower_fun(_default_impl, multiple_results=False)

    def rule(ctx, a, b, **params):
        return (xla if params["kernel"] == XLA_KERNEL else ours)(ctx, a, b, **params)

    return rule


mlir.register_lowering(gemm_p, _lowering(_default_impl))
mlir.register_lowering(gemm_p, _lowering(_cuda_impl), platform="cuda")


def require_devices_at_lowering(primitive) -> None:
    """custom_partitioning needs the device assignment while lowering, and jax (0.11)
    lowers multi-device programs without one unless a primitive in the jaxpr asks for it;
    ours bind custom_partitioning only inside their lowering rules, so they must ask, as
    jax's own cuDNN primitives built the same way do."""
    registry = getattr(jax._src.dispatch, "prim_requires_devices_during_lowering", None)
    if registry is not None:
        registry.add(primitive)


require_devices_at_lowering(gemm_p)


def _varying_axes(x) -> frozenset:
    """shard_map manual axes x varies over (the attribute moved between jax releases:
    `aval.vma`, later `aval.mat.varying`); empty outside shard_map. x may be a value being
    transposed (an UndefinedPrimal: its aval only)."""
    try:
        aval = x.aval if hasattr(x, "aval") else jax.typeof(x)
    except (AttributeError, TypeError):  # a jax without typeof, or not a jax value
        return frozenset()
    mat = getattr(aval, "mat", None)
    return frozenset(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())


def _match_varying_axes(*xs):
    """Inside shard_map, makes all operands vary over the union of their manual axes, as
    jax does for its own binary primitives (a replicated weight times a sharded input)."""
    axes = [_varying_axes(x) for x in xs]
    union = frozenset().union(*axes)
    if all(a == union for a in axes):
        return xs

    def vary(x, missing):
        if not missing:
            return x
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(x, tuple(sorted(missing)), to="varying")
        return jax.lax.pvary(x, tuple(sorted(missing)))  # its name in earlier releases

    return tuple(vary(x, union - a) for x, a in zip(xs, axes))


def gemm(a, b, *, transpose_a: bool = False, transpose_b: bool = False, out_dtype=None,
         kernel: str = DEFAULT_KERNEL, stages: int | None = None, rules: bool = False):
    """Binds the primitive (operands already validated by the public ops).

    `kernel` and `stages` pick a compiled instance (cuda/gemm/instances.def); the V5
    kernel exists for f16/bf16 in jnp.dot's layout only (its 2- and 3-stage depths for
    f16 only), the persistent one in every layout with 4 stages, the f16-accumulating
    one for f16 in every layout with 3. `stages=None` takes the kernel's own depth.
    XLA_KERNEL lowers to XLA's dot. `rules`: the dispatcher's rules picked `kernel` (policy
    "auto"), so vmap asks them again for the batched shape (_batching.py) and each device
    for its shards (_cuda_impl); a kind asked for by name, or by policy "kernel", is kept.
    """
    if kernel not in KERNELS and kernel != XLA_KERNEL:
        raise ValueError(f"kernel must be one of {sorted(KERNELS)} or {XLA_KERNEL!r}, got {kernel!r}")
    if stages is None:
        stages = stages_of(kernel)
    out_dtype = jnp.dtype(a.dtype if out_dtype is None else out_dtype)
    a, b = _match_varying_axes(a, b)
    return gemm_p.bind(a, b, transpose_a=bool(transpose_a), transpose_b=bool(transpose_b), out_dtype=out_dtype,
                       kernel=kernel, stages=int(stages), rules=bool(rules))
