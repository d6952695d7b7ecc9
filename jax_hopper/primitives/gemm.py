"""gemm_p: C = op(A) @ op(B) on the kernel, with every rule it needs.

Operands: f16/bf16 of one dtype, A stored [M, K] (or [K, M] with transpose_a), B stored
[K, N] (or [N, K] with transpose_b); either both with the same leading batch dims (each
kept as its own dim, so a sharded one keeps its sharding; the FFI handler folds them), or
A [..., M, K] against a 2-D B (jnp's x @ W; A's leading dims fold into M on each device).
C is [(batch | ...,) M, N] in the operands' type or f32. Params: `kernel` (a kind in
_kernels, or "xla": XLA's dot, whose derivative is still ours), `stages`, and `rules`
(decide() picked the kind, so vmap and each device's shards are decided again).

On CUDA it lowers to the jax_hopper_gemm custom call, elsewhere to XLA's dot; under
sharding it is partitioned by jnp.dot's rules (below); its JVP is bilinear, its
transposes are two more products that read the stored operands in place; vmap makes one
batched launch. `dot_general` maps a validated lax.dot_general onto it.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from jax_hopper import _compat, _ffi, _kernels
from jax_hopper import _partitioning as part
from jax_hopper._dispatch import Decision, current_policy, decide
from jax_hopper._plan import GemmPlan, plan_dot_general
from jax_hopper._problem import TMA_ROW_MULTIPLE, fits_kernel, mnk, numeric, problem_of, round_up
from jax_hopper._reference import gemm_reference

KERNEL_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
F16, F32 = jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)
XLA_KERNEL = "xla"  # the primitive lowered to XLA's dot (its derivative stays ours)
# The name our products carry for jax.checkpoint policies (jax's dot policies match
# lax.dot_general only): save_only_these_names(PRODUCT_NAME).
PRODUCT_NAME = "jax_hopper_product"

gemm_p = Primitive("jax_hopper_gemm")


# ---- abstract evaluation ----------------------------------------------------------------
def _abstract_eval(a, b, *, transpose_a, transpose_b, out_dtype, kernel, stages, rules=False):
    del kernel, stages, rules
    batched = a.ndim == b.ndim >= 3 and a.shape[:-2] == b.shape[:-2]
    if not (batched or (b.ndim == 2 and (a.ndim == 2 or (a.ndim > 2 and not transpose_a)))):
        raise ValueError(f"jax_hopper_gemm takes two 2-D operands, two operands with the same batch dims, or A "
                         f"[..., M, K] against a 2-D B; got {a.shape} and {b.shape} (transpose_a={transpose_a})")
    if a.dtype != b.dtype or a.dtype not in KERNEL_DTYPES:
        raise TypeError(f"jax_hopper_gemm takes two f16 or two bf16 operands, got {a.dtype} and {b.dtype}")
    if out_dtype not in (a.dtype, F32):
        raise TypeError(f"jax_hopper_gemm computes {a.dtype} or float32 results, not {out_dtype}")
    m, n, k, k_b = mnk(a.shape, b.shape, transpose_a, transpose_b)
    if k != k_b:
        raise ValueError(f"jax_hopper_gemm: contracting sizes differ: {a.shape} and {b.shape} "
                         f"(transpose_a={transpose_a}, transpose_b={transpose_b})")
    # The result inherits shard_map's varying axes from `a` (gemm() matched them); under
    # explicit mesh axes its sharding follows jnp.dot's rule.
    sharding = output_sharding(a, b, transpose_a, transpose_b)
    extra = {} if sharding is None else {"sharding": sharding}
    return a.update(shape=a.shape[:-2] + (m, n), dtype=out_dtype, weak_type=False, **extra)


def layer_aval(name, x, w, bias=None, residual=None):
    """The type of a layer's x [..., M, K] @ w [K, N] with an optional bias [N] and
    residual [..., M, N] of the same 16-bit type (what the fused layers return)."""
    n = w.shape[-1]
    out_shape = x.shape[:-1] + (n,)
    extras = [v for v in ((bias, (n,)), (residual, out_shape)) if v[0] is not None]
    if x.ndim < 2 or w.ndim != 2 or x.shape[-1] != w.shape[0] or any(v.shape != shape for v, shape in extras):
        described = ", ".join(f"{label}{list(v.shape)}" for label, v in
                              (("x", x), ("w", w), ("bias", bias), ("residual", residual)) if v is not None)
        raise ValueError(f"{name}: inconsistent shapes {described}")
    if any(v.dtype != x.dtype for v in [w] + [v for v, _ in extras]) or x.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name} takes operands of one type, f16 or bf16; got x {x.dtype}, w {w.dtype}")
    sharding = output_sharding(x, w, False, False)
    extra = {} if sharding is None else {"sharding": sharding}
    return x.update(shape=out_shape, dtype=x.dtype, weak_type=False, **extra)


# ---- local computations -----------------------------------------------------------------
def _pad_axis(x, axis: int, size: int):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def pad_for_tma(a, b, transpose_a, transpose_b):
    """Pads stored rows to a multiple of 8 elements. A K-major operand's K is padded with
    zeros; an operand whose K is its outer dimension keeps its K rows and the kernel
    reads zeros past them (TMA's out-of-bounds fill), so jnp.dot's B [K, N] with an odd K
    is not copied. A padded M or N row tail is never read."""
    m, n, k, _ = mnk(a.shape, b.shape, transpose_a, transpose_b)
    a = _pad_axis(a, -1, round_up(m if transpose_a else k, TMA_ROW_MULTIPLE))
    b = _pad_axis(b, -1, round_up(k if transpose_b else n, TMA_ROW_MULTIPLE))
    return a, b


def ffi_workspace(kind: str, a, b, transpose_a: bool, transpose_b: bool, stages: int | None = None):
    """The workspace result (_ffi.workspace) of a call of `kind` on these padded operands."""
    problem = problem_of(a.shape, b.shape, a.dtype, a.dtype, transpose_a, transpose_b)
    _, _, k_a, k_b = mnk(a.shape, b.shape, transpose_a, transpose_b)
    return _ffi.workspace(kind, "bf16" if a.dtype == jnp.bfloat16 else "f16", "MN" if transpose_a else "K",
                          "K" if transpose_b else "MN", _kernels.stages_of(kind) if stages is None else stages,
                          max(problem.batch, 1), problem.m, problem.n, max(k_a, k_b))


def _xla_impl(a, b, *, transpose_a, transpose_b, out_dtype, kernel=None, stages=None, rules=False):
    """XLA's dot standing in for the kernel, typed with the primitive's own result sharding
    (under explicit axes a contraction over a sharded dim needs it spelled out)."""
    del kernel, stages, rules
    sharding = output_sharding(jax.typeof(a), jax.typeof(b), transpose_a, transpose_b)
    return gemm_reference(a, b, transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=out_dtype,
                          out_sharding=sharding)


def kind_for_shapes(kernel: str, rules: bool, a_shape, b_shape, dtype, out_dtype, transpose_a, transpose_b) -> str:
    """The kind that computes a product bound with `kernel` once its operands have these
    shapes (vmap grows M or adds a batch dim; each device multiplies its shards). Where
    decide() picked the kind (`rules`), it decides again for these shapes (XLA_KERNEL where
    it would not take them); the small-M kind asked for by name is picked again (it is
    compiled for one product in jnp.dot's layout); any other is kept, as are shapes with a
    symbolic dim."""
    if not (rules or kernel == _kernels.SMALL_M_KIND) or not numeric(*a_shape, *b_shape):
        return kernel
    problem = problem_of(a_shape, b_shape, dtype, out_dtype, transpose_a, transpose_b,
                         f16_accumulation=kernel == _kernels.F16_ACCUMULATION_KIND)
    decision = decide(problem, "auto" if rules else "kernel")
    if rules:
        return XLA_KERNEL if decision.path == "xla" else decision.kind
    return decision.kind if decision.path == "kernel" else kernel


def _cuda_impl(a, b, *, transpose_a, transpose_b, out_dtype, kernel, stages, rules=False):
    reason = _ffi.kernel_unavailable_reason()
    if reason is not None:
        _ffi.warn_no_kernel_once(reason)
        return _xla_impl(a, b, transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=out_dtype)
    if rules:  # a device's shards are not the product the kind was picked for
        picked = kind_for_shapes(kernel, rules, a.shape, b.shape, a.dtype, out_dtype, transpose_a, transpose_b)
        if picked == XLA_KERNEL:
            return _xla_impl(a, b, transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=out_dtype)
        if picked != kernel:
            kernel, stages = picked, _kernels.stages_of(picked)
    if not fits_kernel(a.shape, b.shape, transpose_a, transpose_b):  # a kind forced past the int32 limits
        return _xla_impl(a, b, transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=out_dtype)
    m, n, _, _ = mnk(a.shape, b.shape, transpose_a, transpose_b)
    a, b = pad_for_tma(a, b, transpose_a, transpose_b)
    call = jax.ffi.ffi_call(_kernels.GEMM, (jax.ShapeDtypeStruct(a.shape[:-2] + (m, n), out_dtype),
                                            ffi_workspace(kernel, a, b, transpose_a, transpose_b, stages)))
    c, _ = call(a, b, transpose_a=np.int32(transpose_a), transpose_b=np.int32(transpose_b),
                kernel=np.int32(_kernels.KIND_BY_NAME[kernel].id), stages=np.int32(stages))
    return c


# ---- partitioning: jnp.dot's rules --------------------------------------------------------
#   batch / M / N sharded    -> each device multiplies its shards (several batch dims, and
#                               a's leading dims, each keep their own sharding)
#   K sharded alike on both  -> f32 partial sums per device, psum, one rounding (the
#                               single-device numerics; jnp.dot reduces 16-bit partials)
#   K sharded on one side    -> gathered, as jnp.dot does; an uneven split too
#   one mesh axis, two roles -> the later role (N after M, K after both) is replicated
def roles(a_ndim, b_ndim, transpose_a, transpose_b):
    """(a's leading dims that fold into M, positions of (batch dims, m, k) in a, of
    (batch dims, k, n) in b)."""
    lead = tuple(range(a_ndim - 2)) if b_ndim == 2 else ()
    batch = tuple(range(a_ndim - 2)) if a_ndim == b_ndim >= 3 else ()
    ra, ca, rb, cb = a_ndim - 2, a_ndim - 1, b_ndim - 2, b_ndim - 1
    a = (batch, ca, ra) if transpose_a else (batch, ra, ca)
    b = (batch, cb, rb) if transpose_b else (batch, rb, cb)
    return lead, a, b


class Plan(NamedTuple):
    """Mesh axes per role; one `batch` entry per batch dim, one `lead` entry per leading dim of a."""

    batch: tuple
    lead: tuple
    m: tuple
    n: tuple
    k: tuple


def _plan(a_sharding, b_sharding, a_shape, b_ndim, transpose_a, transpose_b, n_first=False) -> Plan:
    """Mesh axes for each role, each mesh axis used by at most one (M before N, unless n_first)."""
    ndim = len(a_shape)
    lead_dims, (ab, am, ak), (_, bk, bn) = roles(ndim, b_ndim, transpose_a, transpose_b)
    sa, sb = part.spec_of(a_sharding, ndim), part.spec_of(b_sharding, b_ndim)
    used: set[str] = set()

    def take(*candidates):
        for axes in candidates:
            if axes and not used.intersection(axes):
                used.update(axes)
                return axes
        return ()

    batch = tuple(take(sa[d], sb[d]) for d in ab)
    lead = tuple(take(sa[d]) for d in lead_dims)
    if n_first:
        n = take(sb[bn])
        m = take(sa[am])
    else:
        m = take(sa[am])
        n = take(sb[bn])
    # An uneven K split would sum the last shard's padding: gathered.
    k = take(sa[ak]) if sa[ak] == sb[bk] and part.divides(a_sharding, sa[ak], a_shape[ak]) else ()
    return Plan(batch, lead, m, n, k)


def _shardings(mesh, a_ndim, b_ndim, transpose_a, transpose_b, plan: Plan):
    lead_dims, (ab, am, ak), (_, bk, bn) = roles(a_ndim, b_ndim, transpose_a, transpose_b)
    a_dims, b_dims = [()] * a_ndim, [()] * b_ndim
    for d, axes in zip(ab, plan.batch):
        a_dims[d] = b_dims[d] = axes
    for d, axes in zip(lead_dims, plan.lead):
        a_dims[d] = axes
    a_dims[am], a_dims[ak] = plan.m, plan.k
    b_dims[bk], b_dims[bn] = plan.k, plan.n
    out_dims = list(plan.batch) + list(plan.lead) + [plan.m, plan.n]
    return tuple(NamedSharding(mesh, part.pspec(d)) for d in (a_dims, b_dims, out_dims))


def output_sharding(a, b, transpose_a, transpose_b):
    """The result's sharding in the avals' types (explicit mesh axes): batch, leading dims
    and M as `a` has them, N as `b` has it (jnp.dot's rule), N replicated where its axes
    already shard another dim (what _plan computes; only a backward product meets it, whose
    result the transpose rule reshards to the operand's type); None without explicit axes."""
    mesh = part.explicit_mesh(a, b)
    if mesh is None:
        return None
    lead_dims, (ab, am, _), (_, _, bn) = roles(a.ndim, b.ndim, transpose_a, transpose_b)
    spec_a, spec_b = part.explicit_spec(a), part.explicit_spec(b)
    entries = tuple(spec_a[d] for d in ab + lead_dims) + (spec_a[am],)
    used = {axis for e in entries for axis in part.axes(PartitionSpec(e), 1)[0]}
    n = spec_b[bn]
    if used.intersection(part.axes(PartitionSpec(n), 1)[0]):
        n = None
    return NamedSharding(mesh, PartitionSpec(*entries, n))


def operand_shardings(mesh, arg_shapes, transpose_a, transpose_b, result_shape=None):
    """(plan, (a, b, result shardings)). N's axes go before M's where the partitioner's
    result shards N and not M (Shardy gives a shared axis to the larger dim, as for
    jnp.dot; the plan follows rather than gathering the larger operand)."""
    a, b = arg_shapes[0], arg_shapes[1]
    a_sharding, b_sharding = part.on_mesh(a.sharding, mesh), part.on_mesh(b.sharding, mesh)
    n_first = False
    if result_shape is not None and getattr(result_shape, "sharding", None) is not None:
        out = part.spec_of(result_shape.sharding, len(result_shape.shape))
        n_first = bool(out[-1]) and not out[-2]
    plan = _plan(a_sharding, b_sharding, a.shape, len(b.shape), transpose_a, transpose_b, n_first)
    return plan, _shardings(mesh, len(a.shape), len(b.shape), transpose_a, transpose_b, plan)


def per_device_product(local_impl, k_axes, out_dtype, **params):
    """Each device's product, or (K split over k_axes) its f32 partial sums, psum'd and
    rounded once. local_impl decides its kind again for the shards (_cuda_impl)."""
    def product(a, b):
        if not k_axes:
            return local_impl(a, b, out_dtype=out_dtype, **params)
        partial_sums = local_impl(a, b, out_dtype=F32, **params)
        return jax.lax.psum(partial_sums, k_axes).astype(out_dtype)

    return product


def _infer(transpose_a, transpose_b, out_dtype, kernel, stages, rules, mesh, arg_shapes, result_shape):
    del out_dtype, kernel, stages, rules, result_shape
    return operand_shardings(mesh, arg_shapes, transpose_a, transpose_b)[1][2]


def _partition(local_impl, transpose_a, transpose_b, out_dtype, kernel, stages, rules, mesh, arg_shapes,
               result_shape):
    plan, (a_sharding, b_sharding, out_sharding) = operand_shardings(mesh, arg_shapes, transpose_a, transpose_b,
                                                                     result_shape)
    lower_fn = per_device_product(local_impl, plan.k, out_dtype, transpose_a=transpose_a, transpose_b=transpose_b,
                                  kernel=kernel, stages=stages, rules=rules)
    return mesh, part.without_context_mesh(lower_fn), out_sharding, (a_sharding, b_sharding)


def lead_factors(a_ndim, b_ndim):
    """Shardy factor names of (a's and the result's leading dims, b's)."""
    if a_ndim == b_ndim >= 3:
        batch = "".join(f"b{i} " for i in range(a_ndim - 2))
        return batch, batch
    return "".join(f"l{i} " for i in range(a_ndim - 2)), ""


def _sharding_rule(transpose_a, transpose_b, out_dtype, kernel, stages, rules, mesh, value_types, result_types):
    del out_dtype, kernel, stages, rules, mesh, result_types
    lead, b_lead = lead_factors(len(value_types[0].shape), len(value_types[1].shape))
    a = "k m" if transpose_a else "m k"
    b = "n k" if transpose_b else "k n"
    return f"{lead}{a}, {b_lead}{b} -> {lead}m n", {"reduction_factors": ("k",)}


def _partitioned(local_impl):
    """local_impl wrapped so XLA partitions it by the rules above (Auto axes)."""

    @functools.partial(custom_partitioning, static_argnums=(2, 3, 4, 5, 6, 7))
    def call(a, b, transpose_a, transpose_b, out_dtype, kernel, stages, rules):
        return local_impl(a, b, transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=out_dtype, kernel=kernel,
                          stages=stages, rules=rules)

    call.def_partition(partition=functools.partial(_partition, local_impl), infer_sharding_from_operands=_infer,
                       sharding_rule=_sharding_rule)

    def impl(a, b, *, transpose_a, transpose_b, out_dtype, kernel, stages, rules=False):
        return call(a, b, transpose_a, transpose_b, out_dtype, kernel, stages, rules)

    return impl


def _explicit(local_impl):
    """local_impl in a shard_map planned from the operands' explicit types."""
    def impl(a, b, *, transpose_a, transpose_b, out_dtype, kernel, stages, rules=False):
        types = (jax.typeof(a), jax.typeof(b))
        result = output_sharding(*types, transpose_a, transpose_b)
        m, n, k, _ = mnk(a.shape, b.shape, transpose_a, transpose_b)
        if k == 0:  # an empty sum (XLA refuses a shard_map whose operands are all empty)
            return jnp.zeros(a.shape[:-2] + (m, n), out_dtype, out_sharding=result)
        plan, shardings = operand_shardings(part.explicit_mesh(*types), types, transpose_a, transpose_b)
        per_device = per_device_product(local_impl, plan.k, out_dtype, transpose_a=transpose_a,
                                        transpose_b=transpose_b, kernel=kernel, stages=stages, rules=rules)
        return part.shard_mapped(per_device, shardings[:2], shardings[2], result, a, b)

    return impl


def _lowering(local_impl):
    """local_impl, partitioned; kernel XLA_KERNEL lowers to XLA's dot, which XLA partitions."""
    ours = part.lowering(local_impl, _partitioned(local_impl), _explicit(local_impl), _xla_impl)
    xla = mlir.lower_fun(_xla_impl, multiple_results=False)

    def rule(ctx, a, b, **params):
        return (xla if params["kernel"] == XLA_KERNEL else ours)(ctx, a, b, **params)

    return rule


gemm_p.def_impl(_compat.eager_impl(gemm_p))
gemm_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(gemm_p, _lowering(_xla_impl))
mlir.register_lowering(gemm_p, _lowering(_cuda_impl), platform="cuda")
_compat.require_devices_at_lowering(gemm_p)


def gemm(a, b, *, transpose_a: bool = False, transpose_b: bool = False, out_dtype=None,
         kernel: str = _kernels.DEFAULT_KIND, stages: int | None = None, rules: bool = False):
    """Binds the primitive on operands already validated. `kernel` and `stages` name a
    compiled instance (_kernels.KINDS; stages=None: the kind's own depth) or XLA_KERNEL."""
    if kernel not in _kernels.GEMM_KINDS and kernel != XLA_KERNEL:
        raise ValueError(f"kernel must be one of {sorted(_kernels.GEMM_KINDS)} or {XLA_KERNEL!r}, got {kernel!r}")
    if stages is None:
        stages = _kernels.stages_of(kernel) if kernel != XLA_KERNEL else _kernels.stages_of(_kernels.DEFAULT_KIND)
    out_dtype = jnp.dtype(a.dtype if out_dtype is None else out_dtype)
    a, b = _compat.match_varying_axes(a, b)
    return gemm_p.bind(a, b, transpose_a=bool(transpose_a), transpose_b=bool(transpose_b), out_dtype=out_dtype,
                       kernel=kernel, stages=int(stages), rules=bool(rules))


# ---- autodiff ----------------------------------------------------------------------------
# With op(X) = X^T when its flag is set, each transpose reads the stored operands in place:
#   dA = dC op(B)^T                    -> gemm(dC, B, ta=False, tb=not tb)   (A stored [M,K])
#   dA = (dC op(B)^T)^T = op(B) dC^T   -> gemm(B, dC, ta=tb, tb=True)       (A stored [K,M])
#   dB = op(A)^T dC                    -> gemm(A, dC, ta=not ta, tb=False)  (B stored [K,N])
#   dB = (op(A)^T dC)^T = dC^T op(A)   -> gemm(dC, A, ta=True, tb=ta)       (B stored [N,K])
# and each is decided like a product the user wrote. An f32 cotangent is rounded to the
# operands' 16-bit type first (docs/numerics.md): bf16 as hi + lo, two products; f16
# after a power-of-two scale that puts its largest magnitude in [2^14, 2^15).
F32_EXPONENT_BIAS = 127
F32_MANTISSA_BITS = 23
BF16_EXPONENT_BITS, BF16_MANTISSA_BITS = 8, 7
BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)
F16_SCALED_EXPONENT = 15
MAX_SCALE_EXPONENT = 126  # 2^-s stays a normal f32


def _pow2(e):
    """2.0^e in f32, exactly, for an integer e with -126 <= e <= 127."""
    return lax.bitcast_convert_type((e + F32_EXPONENT_BIAS).astype(jnp.int32) << F32_MANTISSA_BITS, jnp.float32)


def _scaled_to_f16(ct):
    """(ct * 2^s rounded to f16, 2^-s), its largest finite magnitude scaled into
    [2^14, 2^15); inf and nan entries stay and do not set the scale."""
    _, e = jnp.frexp(jnp.max(jnp.where(jnp.isfinite(ct), jnp.abs(ct), 0), initial=0.0))
    s = jnp.minimum(F16_SCALED_EXPONENT - e, MAX_SCALE_EXPONENT)
    return (ct * _pow2(s)).astype(jnp.float16), _pow2(-s)


def jvp_where_moving(f, primals, tangents, zero_type, like):
    """jax.jvp of f in the arguments whose tangent is not a symbolic zero (of `zero_type`):
    instantiating one would add a product of zeros. With none moving: f's value (`like`'s,
    if given) and a zero tangent."""
    moving = [i for i, t in enumerate(tangents) if not isinstance(t, zero_type)]
    if not moving:
        y = f(*primals) if like is None else like
        return y, jnp.zeros_like(y)

    def of_moving(*moved):
        args = list(primals)
        for i, v in zip(moving, moved):
            args[i] = v
        return f(*args)

    return jax.jvp(of_moving, [primals[i] for i in moving], [tangents[i] for i in moving])


def jvp_of_reference(primitive, reference):
    """A JVP rule for a multiple-result primitive: its kernel's values, and the tangents of
    `reference` (the same arithmetic through XLA, with the primitive's signature)."""
    def jvp(primals, tangents, **params):
        outs = primitive.bind(*primals, **params)
        tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
        _, douts = jax.jvp(functools.partial(reference, **params), tuple(primals), tangents)
        return outs, list(douts)

    return jvp


def _gradient(ct, other, product, dtype):
    """product(c, other, out_dtype) with the cotangent as the backward products use it: in
    the operands' type `dtype` as is; f32 of bf16 split into two bf16 parts; f32 of f16
    scaled, rounded and unscaled. Its own derivatives are those of jax's f32 rule."""
    if ct.dtype == dtype:
        return product(ct, other, dtype)

    def rounded(c, o):
        if dtype == jnp.bfloat16:
            # hi by reduce_precision, not a bf16 round trip, which XLA may drop on the GPU.
            hi = lax.reduce_precision(c, exponent_bits=BF16_EXPONENT_BITS, mantissa_bits=BF16_MANTISSA_BITS)
            hi = jnp.where(jnp.isinf(hi) & jnp.isfinite(c), jnp.sign(c) * BF16_MAX, hi)  # keep finite c finite
            lo = jnp.where(jnp.isfinite(hi), c - hi, 0)  # inf and nan entries are all in hi
            hi, lo = hi.astype(dtype), lo.astype(dtype)
            p_hi = product(hi, o, jnp.float32)
            total = p_hi + product(lo, o, jnp.float32)
            # A nan only the low part brought is not in jax's one f32 product.
            return jnp.where(jnp.isnan(total) & ~jnp.isnan(p_hi), p_hi, total).astype(dtype)
        c16, undo = _scaled_to_f16(c)
        return (product(c16, o, jnp.float32) * undo).astype(dtype)

    def exact(c, o):  # jax's rule: the mixed f32 x 16-bit product
        return product(c, o, jnp.float32).astype(dtype)

    def jvp(primals, tangents):
        y = rounded(*primals)
        return y, jvp_where_moving(exact, primals, tangents, SymbolicZero, y)[1]

    f = jax.custom_jvp(rounded)
    f.defjvp(jvp, symbolic_zeros=True)
    return f(ct, other)


def product(a, b, *, transpose_a=False, transpose_b=False, like=None, out_dtype=None):
    """A derivative's product, on our kernel or XLA's dot as decide() says. `like`: the
    operand whose gradient this is (its sharding types the result, as jax's transpose does)."""
    out_dtype = a.dtype if out_dtype is None else out_dtype
    decision = decide(problem_of(a.shape, b.shape, a.dtype, out_dtype, transpose_a, transpose_b))
    if a.dtype == b.dtype and decision.path == "kernel":  # (mixed: jax's rule, _gradient)
        return part.in_type_of(gemm(a, b, transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=out_dtype,
                                    kernel=decision.kind, rules=decision.by_rules), like)
    return gemm_reference(a, b, transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=out_dtype,
                          out_sharding=None if like is None else part.sharding_of(like))


def contracting_leading_dims(x, y, *, like, out_dtype=None):
    """x^T y over all leading dims and the rows of x [..., R, P] and y [..., R, Q]: [P, Q].
    On our kernel the contracted dims fold into one; on XLA's path, and where explicit
    axes shard an inner one, one dot_general contracts them all (as jnp)."""
    rows = tuple(range(x.ndim - 1))
    r, p, q = math.prod(x.shape[:-1]), x.shape[-1], y.shape[-1]
    foldable = r > 0 and not (part.merge_drops_explicit_sharding(part.aval(x), 0, x.ndim - 2) or
                              part.merge_drops_explicit_sharding(part.aval(y), 0, y.ndim - 2))
    out_dtype = x.dtype if out_dtype is None else out_dtype
    problem = problem_of((r, p), (r, q), x.dtype, out_dtype, True, False)
    if foldable and x.dtype == y.dtype and decide(problem).path == "kernel":
        return product(x.reshape(r, p), y.reshape(r, q), transpose_a=True, like=like, out_dtype=out_dtype)
    preferred = None if out_dtype == x.dtype else out_dtype
    return lax.dot_general(x, y, ((rows, rows), ((), ())), preferred_element_type=preferred,
                           out_sharding=part.sharding_of(like))


def _transpose_lhs(ct, a, b, *, transpose_a, transpose_b, out_dtype=None, kernel=None, stages=None, rules=False):
    del out_dtype, kernel, stages, rules

    def prod(c, b, out_dtype):
        if transpose_a:
            return product(b, c, transpose_a=transpose_b, transpose_b=True, like=a, out_dtype=out_dtype)
        return product(c, b, transpose_a=False, transpose_b=not transpose_b, like=a, out_dtype=out_dtype)

    return _gradient(ct, b, prod, b.dtype)


def _transpose_rhs(ct, a, b, *, transpose_a, transpose_b, out_dtype=None, kernel=None, stages=None, rules=False):
    del out_dtype, kernel, stages, rules

    def prod(c, a, out_dtype):
        if a.ndim > part.aval(b).ndim:  # A [..., M, K]: contract its leading dims and M
            x, y = (c, a) if transpose_b else (a, c)
            return contracting_leading_dims(x, y, like=b, out_dtype=out_dtype)
        if transpose_b:
            return product(c, a, transpose_a=True, transpose_b=transpose_a, like=b, out_dtype=out_dtype)
        return product(a, c, transpose_a=not transpose_a, transpose_b=False, like=b, out_dtype=out_dtype)

    return _gradient(ct, a, prod, a.dtype)


def _jvp(primals, tangents, **params):
    """Bilinear: dC = dA op(B) + op(A) dB, each term the same kind. The value is named (a
    remat policy's handle) here, where differentiated: jax has no transpose rule for a
    name, and an undifferentiated product must stay transposable (jax.linear_transpose)."""
    a, b = primals
    out = gemm_p.bind(a, b, **params)
    terms = [gemm_p.bind(*_compat.match_varying_axes(*((t, b) if i == 0 else (a, t))), **params)
             for i, t in enumerate(tangents) if type(t) is not ad.Zero]
    # A tangent must have its primal's type (a fresh direction may lack the explicit mesh axes).
    return checkpoint_name(out, PRODUCT_NAME), part.in_type_of(functools.reduce(lambda p, q: p + q, terms), out)


ad.defbilinear(gemm_p, _transpose_lhs, _transpose_rhs)
ad.primitive_jvps[gemm_p] = _jvp
transpose_lhs, transpose_rhs = _transpose_lhs, _transpose_rhs


# ---- batching: every vmapped product is one batched launch --------------------------------
# Where the layout allows, a vmapped operand against an unbatched one joins A's leading dims
# or folds into N (B stored [N, K]: no copy; [K, N]: one copy of B, where broadcasting A
# would copy A per example). Otherwise the vmapped axis becomes a leading batch dim next to
# the batch dims already there (kept, not merged: a sharded one keeps its sharding). A
# symbolic vmapped size takes the reference arithmetic, batched by jax.
NOT_MAPPED = None


def to_front(x, dim, size):
    if dim is NOT_MAPPED:
        return jnp.broadcast_to(x, (size,) + x.shape)
    return jnp.moveaxis(x, dim, 0)


def _bind_batched(a, b, params):
    """The batched product, its kind decided again for the batched shapes (kind_for_shapes)."""
    kernel = kind_for_shapes(params["kernel"], params.get("rules", False), a.shape, b.shape, a.dtype,
                             params["out_dtype"], params["transpose_a"], params["transpose_b"])
    if kernel != params["kernel"]:
        params = dict(params, kernel=kernel, stages=_kernels.stages_of(
            kernel if kernel != XLA_KERNEL else _kernels.DEFAULT_KIND))
    return gemm_p.bind(a, b, **params)


def _batch_rule(args, dims, **params):
    a, b = args
    da, db = dims
    if not numeric(a.shape[da] if da is not NOT_MAPPED else b.shape[db]):
        reference = functools.partial(gemm_reference, transpose_a=params["transpose_a"],
                                      transpose_b=params["transpose_b"], out_dtype=params["out_dtype"])
        return jax.vmap(reference, in_axes=(da, db))(a, b), 0
    ta, tb = params["transpose_a"], params["transpose_b"]
    merge_drops = part.merge_drops_explicit_sharding
    if db is NOT_MAPPED and b.ndim == 2 and not ta:  # [v, ..., M, K] against [K, N]: a leading dim
        return _bind_batched(jnp.moveaxis(a, da, 0), b, params), 0
    if da is NOT_MAPPED and b.ndim == 3 and tb:  # [..., M, K] against [v, N, K]: fold v into N
        b = jnp.moveaxis(b, db, 0)
        v, n, k = b.shape
        out = _bind_batched(a, b.reshape(v * n, k), params)
        return out.reshape(out.shape[:-1] + (v, n)), out.ndim - 1
    if da is NOT_MAPPED and b.ndim == 3:  # [..., M, K] against [v, K, N]: v folded into N too
        b = jnp.moveaxis(b, db, 1)  # [K, v, N]: one copy of B
        if not merge_drops(jax.typeof(b), 1, 2):
            k, v, n = b.shape
            out = _bind_batched(a, b.reshape(k, v * n), params)
            return out.reshape(out.shape[:-1] + (v, n)), out.ndim - 1
        db = 1
    nb = b.ndim - 2  # the primitive's batch dims, where both operands have them
    if db is NOT_MAPPED and b.ndim >= 3 and a.ndim == b.ndim + 1 and not ta:  # [v, B..., M, K] against [B..., K, N]
        a = jnp.moveaxis(a, da, nb)  # [B..., v, M, K]: v folded into M
        if not merge_drops(jax.typeof(a), nb, nb + 1):
            v, m, k = a.shape[nb:]
            out = _bind_batched(a.reshape(a.shape[:nb] + (v * m, k)), b, params)
            return out.reshape(a.shape[:nb] + (v, m, out.shape[-1])), nb
        da = nb
    nb = a.ndim - 2
    if da is NOT_MAPPED and a.ndim >= 3 and b.ndim == a.ndim + 1:  # [B..., M, K] against [v, B..., K, N] (or N, K)
        first = nb if tb else nb + 1  # v folded into N: [B..., v, N, K] or [B..., K, v, N]
        b = jnp.moveaxis(b, db, first)
        if not merge_drops(jax.typeof(b), first, first + 1):
            v, n = b.shape[first:first + 2]
            out = _bind_batched(a, b.reshape(b.shape[:first] + (v * n,) + b.shape[first + 2:]), params)
            return out.reshape(out.shape[:-1] + (v, n)), out.ndim - 1
        db = first
    if da is not NOT_MAPPED and da == db and a.ndim == b.ndim and da <= a.ndim - 3:
        # v among (or just after) the batch dims of both: one more batch dim where it is
        # (moving it to the front fed XLA:CPU's simplifier a pattern it aborts on).
        return _bind_batched(a, b, params), da
    size = a.shape[da] if da is not NOT_MAPPED else b.shape[db]
    b_rank = b.ndim - (db is not NOT_MAPPED)
    a_rank = a.ndim - (da is not NOT_MAPPED)
    a, b = to_front(a, da, size), to_front(b, db, size)
    if a_rank > b_rank:  # A's leading dims against a batched B: fold them into M first
        if merge_drops(jax.typeof(a), 1, a.ndim - 2):
            # ...unless that merges a dim sharded on explicit axes (refused): XLA's dot.
            dn = (((a.ndim - 1,), (2 if params["transpose_b"] else 1,)), ((0,), (0,)))
            return jax.lax.dot_general(a, b, dn, preferred_element_type=params["out_dtype"]), 0
        out = _bind_batched(a.reshape((size, math.prod(a.shape[1:-1]), a.shape[-1])), b, params)
        return out.reshape(a.shape[:-1] + out.shape[-1:]), 0
    return _bind_batched(a, b, params), 0


batching.primitive_batchers[gemm_p] = _batch_rule


# ---- a lax.dot_general on the primitive ------------------------------------------------------
def plan_for(lhs, rhs, dimension_numbers, out_dtype) -> GemmPlan | None:
    """The plan of a dot_general (already validated, eligible by type) onto gemm_p, or None
    where it cannot keep jax's typing: explicit mesh axes on a dim that a fold would merge
    into another, or a transpose/reshape jax would refuse."""
    plan = plan_dot_general(np.shape(lhs), np.shape(rhs), dimension_numbers)
    if (_folding_drops_explicit_sharding(lhs, rhs, dimension_numbers, plan.keeps_lhs_free_dims) or
            _explicit_reshape_refused(lhs, rhs, plan, out_dtype)):
        return None
    return plan


def _folding_drops_explicit_sharding(lhs, rhs, dimension_numbers, keeps_lhs_free_dims=False) -> bool:
    """Whether a dim sharded on explicit axes is not the outermost of its folded group
    (free dims, contracting dims): jax refuses that reshape."""
    (lc, rc), (lb, rb) = dimension_numbers
    for x, contract, batch, keeps_free in ((lhs, tuple(lc), tuple(lb), keeps_lhs_free_dims),
                                           (rhs, tuple(rc), tuple(rb), False)):
        spec = part.value_spec(x)
        if spec is None:
            continue
        free = () if keeps_free else tuple(d for d in range(np.ndim(x)) if d not in contract and d not in batch)
        for group in (free, tuple(sorted(contract))):
            if any(spec[d] is not None for d in group[1:]):
                return True
    return False


def _explicit_reshape_refused(lhs, rhs, plan, out_dtype) -> bool:
    """Under explicit mesh axes, whether jax refuses to type the plan's transposes and
    reshapes (some reshapes that change two groups of dims at once; jax 0.10 even raised
    an IndexError for one): then jax's own product is the answer."""
    if not any(spec is not None and any(spec) for spec in (part.value_spec(lhs), part.value_spec(rhs))):
        return False
    try:
        jax.eval_shape(functools.partial(bind_planned, plan=plan, out_dtype=out_dtype, kernel=XLA_KERNEL), lhs, rhs)
    except Exception:  # noqa: BLE001 -- any refusal of the plan's typing
        return True
    return False


def problem_of_plan(plan: GemmPlan, dtype, out_dtype, f16_accumulation=False):
    return problem_of(plan.lhs_shape, plan.rhs_shape, dtype, out_dtype, plan.transpose_a, plan.transpose_b,
                      f16_accumulation=f16_accumulation)


def bind_planned(lhs, rhs, plan, out_dtype, kernel, rules=False):
    """The primitive on the planned operands (transposed and reshaped as the plan says)."""
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    a = lhs if plan.lhs_perm is None else jnp.transpose(lhs, plan.lhs_perm)
    b = rhs if plan.rhs_perm is None else jnp.transpose(rhs, plan.rhs_perm)
    c = gemm(_reshaped(a, plan.lhs_shape), _reshaped(b, plan.rhs_shape), transpose_a=plan.transpose_a,
             transpose_b=plan.transpose_b, out_dtype=out_dtype, kernel=kernel, rules=rules)
    return _reshaped(c, plan.out_shape)


def _reshaped(x, shape):
    return x if tuple(x.shape) == tuple(shape) else x.reshape(shape)


def bilinear(product_fn, tangent_product, lhs, rhs, *, name=None):
    """product_fn(lhs, rhs) as a custom_jvp whose tangent is tangent_product(dlhs, rhs) +
    tangent_product(lhs, drhs); a pair (for dlhs, for drhs) gives each term its own
    product. With `name`, the value is named (a remat policy's handle) only where it is
    differentiated: jax has no transpose rule for a name, and the undifferentiated product
    must stay transposable (jax.linear_transpose)."""
    lhs_term, rhs_term = tangent_product if isinstance(tangent_product, tuple) else (tangent_product,) * 2

    def jvp(primals, tangents):
        (x, y), (dx, dy) = primals, tangents
        terms = [lhs_term(t, y) if i == 0 else rhs_term(x, t) for i, t in enumerate((dx, dy))
                 if not isinstance(t, SymbolicZero)]
        out = product_fn(x, y)
        if name is not None:
            out = checkpoint_name(out, name)
        if not terms:
            return out, jnp.zeros_like(out)
        # A custom JVP's tangent must have its primal's type (a fresh direction may lack
        # the explicit mesh axes).
        return out, part.in_type_of(functools.reduce(lambda p, q: p + q, terms), out)

    differentiated = jax.custom_jvp(product_fn)
    differentiated.defjvp(jvp, symbolic_zeros=True)
    return differentiated(jnp.asarray(lhs), jnp.asarray(rhs))


def f32_cotangent_may_round(precision) -> bool:
    """Whether our derivative may round an f32 cotangent to 16 bits: not at an explicit
    precision, nor under jax_default_matmul_precision (both ask for jax's f32 products)."""
    return default_precision(precision) and jax.config.jax_default_matmul_precision is None


def default_precision(precision) -> bool:
    """None, or DEFAULT however spelled ("fastest", "bfloat16", a pair of them)."""
    if precision is None:
        return True
    levels = precision if isinstance(precision, tuple) else (precision,)
    try:
        return all(lax.Precision(p) == lax.Precision.DEFAULT for p in levels)
    except (TypeError, ValueError):
        return False


def _rounds_f32_cotangent(lhs, rhs, plan, out_dtype, precision) -> bool:
    """Whether a product left to XLA still takes our derivative rule: an f32 result of f16
    operands, whose f32 cotangent jax's rule multiplies in TF32 on the GPU while ours rounds
    it to f16 after a power-of-two scale and runs 16-bit products. Only under "auto" on a
    Hopper GPU with our kernel, at the default precision, and where the operands go to the
    primitive as they are (no transpose, no fold that could change partitioning)."""
    as_is = (plan.lhs_perm is None and plan.rhs_perm is None and tuple(plan.lhs_shape) == np.shape(lhs)
             and tuple(plan.rhs_shape) == np.shape(rhs))
    return (out_dtype == F32 and lhs.dtype == F16 and as_is and f32_cotangent_may_round(precision)
            and current_policy() == "auto" and _ffi.kernel_unavailable_reason() is None
            and _ffi.hopper_gpus_visible())


def dot_general(lhs, rhs, plan: GemmPlan, decision: Decision, out_dtype, fallback, precision=None):
    """A validated, eligible dot_general planned onto the primitive (plan_for), as `decision`
    says: our kernel (the product named for remat policies where differentiated), or
    `fallback` (jax's own function), whose derivative is ours only for an f32 result of
    f16 operands (_rounds_f32_cotangent)."""
    if decision.path == "xla":
        if _rounds_f32_cotangent(lhs, rhs, plan, out_dtype, precision):
            return bilinear(fallback, functools.partial(bind_planned, plan=plan, out_dtype=out_dtype,
                                                        kernel=XLA_KERNEL), lhs, rhs)
        return fallback(lhs, rhs)
    return bind_planned(lhs, rhs, plan, out_dtype, decision.kind, rules=decision.by_rules)


def matmul_rows(x, w):
    """x [..., K] @ w [K, N] of one validated 16-bit type, as jax_hopper.matmul computes it
    (the layers' product with nothing to fuse)."""
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    fallback = functools.partial(lax.dot_general, dimension_numbers=dims, precision=None, preferred_element_type=None)
    plan = plan_for(x, w, dims, x.dtype) if numeric(*np.shape(x), *np.shape(w)) else None
    if plan is None:
        return fallback(x, w)
    decision = decide(problem_of_plan(plan, x.dtype, x.dtype))
    return dot_general(x, w, plan, decision, x.dtype, fallback)
