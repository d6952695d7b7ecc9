"""Public operations with lax.dot_general / jnp.dot / jnp.matmul semantics.

Every call is first checked by jax itself (`jax.eval_shape` of the jax function it
replaces), so bad inputs raise jax's own errors and the result shape and dtype are by
definition jax's. Then:
  - two f16 or two bf16 operands (after jnp's type promotion), an f16/bf16 or f32
    result, and no out_sharding: eligible. The dispatcher (_dispatch.py) then picks
    the GEMM primitive (our kernel on Hopper, XLA's dot elsewhere) or XLA's own dot,
    by a table of measured rules;
  - anything else: the jax function itself, unchanged.

accumulation="f16" (an explicit opt-in, never the default) allows f16 sums: eligible
f16 products then run the f16-accumulating kernel (the tutorial's final version: an
error that grows with K -- README, "f16 accumulation") where the dispatcher measured it
faster than cuBLASLt (policy "kernel": always); elsewhere they keep the f32 path the
dispatcher picks, which is faster there and more accurate. Where our kernel does not
run (policy "xla", no Hopper GPU) the product is XLA's, with f32 sums.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero

# _autodiff and _batching are imported for their side effect: they register the rules.
from jax_hopper import _autodiff, _batching, _dispatch, _ffi  # noqa: F401
from jax_hopper._dimension_numbers import plan_dot_general
from jax_hopper._primitive import KERNEL_DTYPES, PRODUCT_NAME, XLA_KERNEL, gemm
from jax_hopper._sharding import _axes, is_explicit, padded_spec

F32 = jnp.dtype(jnp.float32)


def _struct(x):
    """Abstract stand-in for jax.eval_shape; non-arrays are left for jax to judge. jax
    arrays, tracers and ShapeDtypeStructs go as they are: their type may carry an
    explicit sharding, and jax's checks of it (a contracting dimension sharded without
    out_sharding) must run."""
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        return x
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return x


def _describe(x) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"
    return type(x).__name__


def _check(name, fn, lhs, rhs):
    """jax's own validation and result type for fn(lhs, rhs), with both operands named."""
    try:
        return jax.eval_shape(fn, _struct(lhs), _struct(rhs))
    except (TypeError, ValueError) as err:
        try:
            named = type(err)(f"jax_hopper.{name}({_describe(lhs)}, {_describe(rhs)}): {err}")
        except Exception:  # an error type whose constructor takes something else
            raise err from None
        raise named from None


def _is_precision_level(p) -> bool:
    """A lax.Precision level however spelled ("highest", "bfloat16_3x", None, ...); not an
    algorithm (a DotAlgorithm, a DotAlgorithmPreset or its name such as "BF16_BF16_F32")."""
    try:
        lax.Precision(p)
    except (TypeError, ValueError):
        return False
    return True


def _plain_precision(precision) -> bool:
    """Precision levels are all met by the kernel (exact 16-bit products, f32 sums);
    an explicit algorithm is honoured by leaving the call to XLA. An operand without one
    takes jax_default_matmul_precision, which may name an algorithm too (jax then rounds
    f16 operands to bf16 for "BF16_BF16_F32", or refuses them for an f8 one)."""
    levels = precision if isinstance(precision, tuple) else (precision,)
    default = jax.config.jax_default_matmul_precision
    return all(_is_precision_level(default if p is None else p) for p in levels)


def _is_array(x, abstract_ok=False) -> bool:
    return isinstance(x, (jax.Array, np.ndarray)) or (abstract_ok and isinstance(x, jax.ShapeDtypeStruct))


def _constant_shapes(*xs) -> bool:
    return _dispatch.numeric(*(d for x in xs for d in np.shape(x)))


def _kernel_eligible(lhs, rhs, out_dtype, precision, abstract_ok=False) -> bool:
    if not (_is_array(lhs, abstract_ok) and _is_array(rhs, abstract_ok) and _constant_shapes(lhs, rhs)):
        return False
    same_kernel_type = lhs.dtype == rhs.dtype and lhs.dtype in KERNEL_DTYPES
    # An f32 result's derivative rounds its f32 cotangent to the 16-bit type (_autodiff).
    return (same_kernel_type and (out_dtype == lhs.dtype or (out_dtype == F32 and _f32_cotangent_may_round(precision)))
            and _plain_precision(precision))


def _index_tuples(dimension_numbers):
    """dot_general's dimension numbers with each entry a tuple, as jax normalises them (it
    takes an int for a one-dim entry: ((1, 0), ((), ())))."""
    (lc, rc), (lb, rb) = dimension_numbers
    return tuple(tuple((d,) if isinstance(d, (int, np.integer)) else tuple(d) for d in pair)
                 for pair in ((lc, rc), (lb, rb)))


def _planned(name, lhs, rhs, dimension_numbers, precision, preferred_element_type, abstract_ok=False):
    """(jax's function, its result type, the kernel plan or None when not eligible)."""
    fn = functools.partial(lax.dot_general, dimension_numbers=dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type)
    out = _check(name, fn, lhs, rhs)
    dimension_numbers = _index_tuples(dimension_numbers)  # valid: jax's checks passed
    # A weak-typed result (both operands weak) stays jax's: the primitive's is strong.
    if out.weak_type or not _kernel_eligible(lhs, rhs, out.dtype, precision, abstract_ok):
        return fn, out, None
    plan = plan_dot_general(np.shape(lhs), np.shape(rhs), dimension_numbers)
    if (_folding_drops_explicit_sharding(lhs, rhs, dimension_numbers, plan.keeps_lhs_free_dims) or
            _explicit_reshape_refused(lhs, rhs, plan, out.dtype)):
        return fn, out, None
    return fn, out, plan


def _explicit_reshape_refused(lhs, rhs, plan, out_dtype) -> bool:
    """Under explicit mesh axes jax types every reshape of a sharded operand and refuses
    some that _folding_drops_explicit_sharding lets through: one that changes two groups
    of dims at once (jax 0.10: [8@x, 16, 16] -> (8, 256, 1), a merged K plus a unit N;
    [8, 1024@x, 1] -> (8, 16, 64)). The plan's transposes, reshapes and the result's
    reshape are typed here without running anything; where jax refuses one, it computes
    the product. Refusals are not always a ShardingTypeError: jax 0.10's reshape rule
    raised an IndexError for [261, 332@y, 1, 5] -> the plan's rhs (found by
    scripts/fuzz_gpu.py), where lax.dot_general computes; whatever typing the plan
    raises, jax's own product is the answer."""
    if not any(spec is not None and any(spec) for spec in (_explicit_spec(lhs), _explicit_spec(rhs))):
        return False
    try:
        jax.eval_shape(functools.partial(_bind, plan=plan, out_dtype=out_dtype, kernel=XLA_KERNEL), lhs, rhs)
    except Exception:  # noqa: BLE001 -- see above: any refusal of the plan's typing
        return True
    return False


def _explicit_spec(x):
    """x's sharding spec per dimension where explicit mesh axes put it in the type, else None."""
    try:
        sharding = getattr(jax.typeof(x), "sharding", None)
    except (AttributeError, TypeError):
        return None
    return padded_spec(sharding, np.ndim(x)) if is_explicit(sharding) else None


def _folding_drops_explicit_sharding(lhs, rhs, dimension_numbers, keeps_lhs_free_dims=False) -> bool:
    """The kernel sees each operand as [B...,] rows x columns: its free and contracting
    dims each fold into one (except the free dims of an lhs [..., M, K] against a
    rank-2 rhs, which the primitive keeps, and the batch dims, which it keeps too). A dim
    sharded on explicit mesh axes that is not the outermost of its folded group cannot
    keep its sharding through that reshape (jax refuses it), so jax computes such a
    product."""
    (lc, rc), (lb, rb) = dimension_numbers
    for x, contract, batch, keeps_free in ((lhs, tuple(lc), tuple(lb), keeps_lhs_free_dims),
                                           (rhs, tuple(rc), tuple(rb), False)):
        spec = _explicit_spec(x)
        if spec is None:
            continue
        free = () if keeps_free else tuple(d for d in range(np.ndim(x)) if d not in contract and d not in batch)
        for group in (free, tuple(sorted(contract))):
            if any(spec[d] is not None for d in group[1:]):
                return True
    return False


def _epilogue_changes_result_type(x, w, bias, residual) -> bool:
    """Under explicit mesh axes, whether jnp's `x @ w + bias` / `... + residual` would have
    another result type than x @ w (leading dims as x, N as w), which is the fused kernel's:
    an operand sharded where x @ w is not (jnp's sum combines the shardings), or one typed
    with explicit axes next to an x @ w without them."""
    x_spec, w_spec = _explicit_spec(x), _explicit_spec(w)
    for v in (bias, residual):
        spec = None if v is None else _explicit_spec(v)
        if spec is None:
            continue
        if x_spec is None or w_spec is None:
            return True
        product = (tuple(x_spec[:-1]) + (w_spec[-1],))[-len(spec):]
        if any(s is not None and s != p for s, p in zip(spec, product)):
            return True
    return False


def _problem(plan, lhs, out):
    return _dispatch.problem_of(plan.lhs_shape, plan.rhs_shape, lhs.dtype, out.dtype, plan.transpose_a,
                                plan.transpose_b)


ACCUMULATIONS = ("f32", "f16")
F16 = jnp.dtype(jnp.float16)


def _check_accumulation_value(name, accumulation):
    if accumulation not in ACCUMULATIONS:
        raise ValueError(f"jax_hopper.{name}: accumulation must be one of {ACCUMULATIONS}, got {accumulation!r}")


def _f32_cotangent_may_round(precision) -> bool:
    """Whether our derivative may round an f32 cotangent to 16 bits: not at an explicit
    precision, nor under jax_default_matmul_precision (both ask for jax's f32 products)."""
    return _default_precision(precision) and jax.config.jax_default_matmul_precision is None


def _default_precision(precision) -> bool:
    """None, or DEFAULT however spelled ("fastest", "bfloat16", a pair of them)."""
    if precision is None:
        return True
    levels = precision if isinstance(precision, tuple) else (precision,)
    try:
        return all(lax.Precision(p) == lax.Precision.DEFAULT for p in levels)
    except (TypeError, ValueError):  # a DotAlgorithm or another object: not a plain level
        return False


def _check_accumulation(name, accumulation, lhs, rhs, precision, preferred_element_type):
    _check_accumulation_value(name, accumulation)
    if accumulation == "f16":
        if not (_is_array(lhs, True) and _is_array(rhs, True) and lhs.dtype == F16 and rhs.dtype == F16):
            raise TypeError(f"jax_hopper.{name}(accumulation='f16') takes two f16 arrays (wgmma has no bf16 "
                            f"accumulator), got {_describe(lhs)} and {_describe(rhs)}")
        if not _default_precision(precision):
            raise ValueError(f"jax_hopper.{name}: accumulation='f16' does not meet precision={precision!r}")
        if preferred_element_type is not None and jnp.dtype(preferred_element_type) != F16:
            raise ValueError(f"jax_hopper.{name}: accumulation='f16' gives f16 sums; preferred_element_type="
                             f"{jnp.dtype(preferred_element_type).name} asks for wider ones")


def _path(plan, lhs, out, accumulation) -> tuple[str, str, str]:
    """(path, rule, the kernel kind that runs it on the kernel path) from the dispatcher."""
    return _dispatch.pick(_problem(plan, lhs, out), f16_accumulation=accumulation == "f16")


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *, out_sharding=None,
                accumulation="f32"):
    """``lax.dot_general`` on the Hopper kernel; same signature and semantics.

    ``accumulation="f16"`` (f16 operands only) opts into the f16-accumulating kernel:
    see the module docstring.
    """
    _check_accumulation("dot_general", accumulation, lhs, rhs, precision, preferred_element_type)
    if out_sharding is not None:
        return lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                               out_sharding=out_sharding)
    fn, out, plan = _planned("dot_general", lhs, rhs, dimension_numbers, precision, preferred_element_type)
    path = None if plan is None else _path(plan, lhs, out, accumulation)
    if path is None:
        return fn(lhs, rhs)
    if path[0] == "xla":
        if _rounds_f32_cotangent(lhs, rhs, out, plan, precision):
            return _xla_product_with_our_derivative(fn, lhs, rhs, plan, out.dtype)
        return fn(lhs, rhs)
    ours = functools.partial(_bind, plan=plan, out_dtype=out.dtype, kernel=path[2],
                             rules=_dispatch.picked_by_rules(path[1]))
    return _bilinear(ours, ours, lhs, rhs, name=PRODUCT_NAME)


def _bind(lhs, rhs, plan, out_dtype, kernel, rules=False):
    """The primitive on the planned operands (transposed and reshaped as the plan says)."""
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    a = lhs if plan.lhs_perm is None else jnp.transpose(lhs, plan.lhs_perm)
    b = rhs if plan.rhs_perm is None else jnp.transpose(rhs, plan.rhs_perm)
    c = gemm(a.reshape(plan.lhs_shape), b.reshape(plan.rhs_shape), transpose_a=plan.transpose_a,
             transpose_b=plan.transpose_b, out_dtype=out_dtype, kernel=kernel, rules=rules)
    return c.reshape(plan.out_shape)


def _rounds_f32_cotangent(lhs, rhs, out, plan, precision) -> bool:
    """Whether a product the dispatcher leaves to XLA still takes our derivative rule: an
    f32 result of f16 operands, whose f32 cotangent jax's rule multiplies in a mixed
    f32 x f16 dot, which on the GPU runs as TF32 (the cotangent rounded to 11 bits, at
    TF32's rate). Ours rounds it to f16 after a power-of-two scale (_autodiff: the same
    11 bits, f32's range) and runs 16-bit products: an LM head's training step 1.74x
    faster (BENCHMARKS.md, session of 2026-12-02 17:25). Only under "auto" on a GPU with
    our kernel (off the GPU jax's f32 dot keeps 24 bits), at the default precision (an
    explicit one, or jax_default_matmul_precision, asks for jax's f32 products), and
    where the operands are the primitive's as they are (no transposing copy, no fold of
    several dims into one, which could change how a sharded product is partitioned)."""
    as_is = (plan.lhs_perm is None and plan.rhs_perm is None and tuple(plan.lhs_shape) == np.shape(lhs)
             and tuple(plan.rhs_shape) == np.shape(rhs))
    return (out.dtype == F32 and lhs.dtype == F16 and as_is and _f32_cotangent_may_round(precision)
            and _dispatch.current_policy() == "auto"
            and _ffi.kernel_unavailable_reason() is None and _ffi.hopper_gpus_visible())


def _xla_product_with_our_derivative(fn, lhs, rhs, plan, out_dtype):
    """fn(lhs, rhs), jnp's own product (XLA's dot: remat's dot policies, sharding and vmap
    see jnp's), whose tangent is our primitive with kernel XLA_KERNEL (XLA's dot as well),
    so that reverse mode transposes it with our rule (_autodiff)."""
    return _bilinear(fn, functools.partial(_bind, plan=plan, out_dtype=out_dtype, kernel=XLA_KERNEL), lhs, rhs)


def _bilinear(product, tangent_product, lhs, rhs, *, name=None):
    """product(lhs, rhs) as a custom_jvp whose tangent is tangent_product(dlhs, rhs) +
    tangent_product(lhs, drhs) (both bilinear). With `name`, the value is named (a remat
    policy's handle) only in that JVP, i.e. where it is differentiated: jax has no
    transpose rule for a name, and the undifferentiated product must stay transposable
    (jax.linear_transpose, lax.custom_linear_solve's transposed solve)."""
    def jvp(primals, tangents):
        (x, y), (dx, dy) = primals, tangents
        terms = [tangent_product(t, y) if i == 0 else tangent_product(x, t) for i, t in enumerate((dx, dy))
                 if not isinstance(t, SymbolicZero)]
        out = product(x, y)
        if name is not None:
            out = checkpoint_name(out, name)
        if not terms:
            return out, jnp.zeros_like(out)
        # A tangent typed without the primal's explicit mesh axes (a fresh direction) gives
        # a product typed without them; a custom JVP's tangent must have its primal's type.
        return out, _autodiff._in_type_of(functools.reduce(lambda p, q: p + q, terms), out)

    differentiated = jax.custom_jvp(product)
    differentiated.defjvp(jvp, symbolic_zeros=True)
    return differentiated(jnp.asarray(lhs), jnp.asarray(rhs))


def dispatch_path(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *,
                  accumulation="f32") -> tuple[str, str]:
    """Which path ``dot_general`` takes for these operands (arrays or ShapeDtypeStructs)
    under the current policy: ("kernel" | "xla", the dispatcher rule), or ("jax", why)
    when the product is not eligible. For the whole product: under sharding, a product
    the rules send to our kernel is dispatched again on each device's shards."""
    _check_accumulation("dispatch_path", accumulation, lhs, rhs, precision, preferred_element_type)
    _, out, plan = _planned("dot_general", lhs, rhs, dimension_numbers, precision, preferred_element_type,
                            abstract_ok=True)
    if plan is None:
        return "jax", "not eligible (dtypes, precision, operand types, or an explicit sharding a fold would drop)"
    return _path(plan, lhs, out, accumulation)[:2]


def _converts_exactly(dtype, *xs) -> bool:
    """Whether converting every x to dtype keeps every value: a "safe" cast (int8 -> f16
    yes; int16 -> f16, f32 -> bf16, a weak f32 array -> bf16 no). jnp multiplies operands
    in their own types, so only such a conversion may precede our kernel. An operand's own
    dtype: jnp.result_type of a lone Python scalar is the default float."""
    return all(np.can_cast(x.dtype if hasattr(x, "dtype") else jnp.result_type(x), dtype, "safe") for x in xs)


def _multiplied_as_floats(x, w) -> bool:
    """Whether jnp multiplies x and w in a floating type. An integer pair is multiplied as
    integers (wrapping) and only then promoted by a floating bias or residual, so a layer
    of the promoted type must not convert them first."""
    return bool(jnp.issubdtype(jnp.result_type(x, w), jnp.floating))


def _promote(a, b, preferred_element_type):
    """Both operands in jnp's promoted type, or None where jnp's own function must run:
    a weakly typed result (both operands weak: jax's function keeps that); mixed operand
    types that lax's conversion to preferred_element_type would round; a conversion
    that would change a value (jnp does not convert: lax.dot_general takes the operands
    as given, so int16 against bf16 keeps 257 where bf16 has 256); or a non-floating
    preferred_element_type (lax converts mixed operands to it first); a pair that jax does
    not promote (f16 x float8, or any mixed pair under strict promotion: jnp runs them
    as given when preferred_element_type says the result type) or whose promoted type is
    not floating (int8 x uint16 is int32, which lax would not accumulate into an f16
    preferred_element_type; no integer pair runs on the kernel anyway). A weak operand
    does not widen the other (bf16 x a weak f32 array is bf16), and is converted only
    where that is exact (a weak f32 array against bf16 is jnp's own product)."""
    try:
        dtype, weak = jax.dtypes.result_type(a, b, return_weak_type_flag=True)
    except jax.dtypes.TypePromotionError:
        return None
    if weak or not jnp.issubdtype(dtype, jnp.floating):
        return None
    if preferred_element_type is not None and not jnp.issubdtype(preferred_element_type, jnp.floating):
        return None
    if not _converts_exactly(dtype, a, b):
        return None
    if (preferred_element_type is not None and jnp.result_type(a) != jnp.result_type(b)
            and not _converts_exactly(jnp.dtype(preferred_element_type), a, b)):
        # lax converts mixed operands to the result type before the product (on CPU and
        # GPU): bf16 x f32 with a bf16 result multiplies the f32 operand rounded to bf16.
        # Where that conversion is exact (f16 x int8 -> f32) the values are ours.
        return None
    # The pair's type is strong here, so a weak operand of it becomes strong (no value changes).
    return tuple(x if isinstance(x, jax.Array) and x.dtype == dtype and not jax.typeof(x).weak_type
                 else jnp.asarray(x, dtype) for x in (a, b))


def dot(a, b, *, precision=None, preferred_element_type=None, out_sharding=None, accumulation="f32"):
    """``jnp.dot`` on the Hopper kernel (N-D ``x @ W`` included); same semantics.
    ``accumulation="f16"``: see ``dot_general``."""
    _check_accumulation_value("dot", accumulation)
    fn = functools.partial(jnp.dot, precision=precision, preferred_element_type=preferred_element_type)
    if out_sharding is not None:
        return fn(a, b, out_sharding=out_sharding)
    _check("dot", fn, a, b)
    promoted = None if np.ndim(a) == 0 or np.ndim(b) == 0 else _promote(a, b, preferred_element_type)
    if promoted is None:
        return fn(a, b)  # scalar products are elementwise (nothing is summed); weak results
    a, b = promoted
    contract = ((a.ndim - 1,), (max(b.ndim - 2, 0),))
    return dot_general(a, b, (contract, ((), ())), precision=precision, preferred_element_type=preferred_element_type,
                       accumulation=accumulation)


def matmul(a, b, *, precision=None, preferred_element_type=None, out_sharding=None, accumulation="f32"):
    """``jnp.matmul`` on the Hopper kernel (batch broadcasting included); same semantics.
    ``accumulation="f16"``: see ``dot_general``.

    2-D operands: C = A @ B. Leading dims of `a` against a 2-D `b` fold into M (one
    plain GEMM); batch dims: one batched launch over the shared ones; one that only `a`
    has is folded into M (jnp.matmul's decomposition, _matmul_as_dot_general); one that
    only `b` has broadcasts `a` (_matmul_broadcast).
    """
    _check_accumulation_value("matmul", accumulation)
    fn = functools.partial(jnp.matmul, precision=precision, preferred_element_type=preferred_element_type)
    if out_sharding is not None:
        return fn(a, b, out_sharding=out_sharding)
    out = _check("matmul", fn, a, b)  # jax's errors first (a scalar operand: its ValueError)
    if not (_is_array(a) and _is_array(b)):
        raise TypeError(f"jax_hopper.matmul: operands must be jax or numpy arrays, got "
                        f"{type(a).__name__} and {type(b).__name__}")
    promoted = _promote(a, b, preferred_element_type)
    if promoted is None:
        return fn(a, b)
    a, b = promoted
    _check_accumulation("matmul", accumulation, a, b, precision, preferred_element_type)
    kw = dict(precision=precision, preferred_element_type=preferred_element_type, accumulation=accumulation)
    # An f32 result of f16 operands takes our derivative rule on the XLA path too
    # (dot_general: _rounds_f32_cotangent): no jnp program for it.
    f32_of_f16 = out.dtype == F32 and a.dtype == F16
    return _matmul_as_dot_general(a, b, functools.partial(dot_general, **kw), jnp_matmul=None if f32_of_f16 else fn,
                                  path=functools.partial(dispatch_path, **kw))


def _broadcast_batch(x, batch, specs):
    """x [..., R, C] broadcast to [*batch, R, C]. Through x's type widened to f32: the
    transpose (x's gradient) then sums the per-batch gradients in f32 and rounds once,
    where a 16-bit reduce_sum over a long batch lost bits (7x jnp's error at 1024). Under
    explicit mesh axes the copy takes the batch dims' shardings `specs` (the other
    operand's), so the batched product keeps them."""
    if tuple(x.shape[:-2]) == tuple(batch):
        return x
    wide = jnp.promote_types(x.dtype, jnp.float32)
    y = jnp.broadcast_to(x.astype(wide), tuple(batch) + x.shape[-2:]).astype(x.dtype)
    own = _explicit_spec(x)
    if own is not None and any(specs):
        # A mesh axis names one dim: x's own row and column dims give up those the batch
        # dims take (x's K on the axis that shards the batch: jnp.matmul gathers that K).
        used = {axis for axes in _axes(specs, len(specs)) for axis in axes}
        kept = [tuple(axis for axis in axes if axis not in used) or None for axes in _axes(own[-2:], 2)]
        y = jax.sharding.reshard(y, jax.sharding.PartitionSpec(*specs, *kept))
    return y


def _batch_specs(x, count):
    """The explicit-axes shardings of x's batch dims (those before its last two; none for
    a vector), right-aligned to `count` batch dims as matmul broadcasts them."""
    spec = _explicit_spec(x) if x.ndim > 1 else None
    spec = (None,) * max(x.ndim - 2, 0) if spec is None else tuple(spec[:-2])
    return (None,) * (count - len(spec)) + spec


def _matmul_broadcast(a, b, dot_general_fn, jnp_matmul=None, path=None):
    """matmul where `b` has batch dims that `a` lacks (or has as 1): both broadcast to
    the common batch, one batched launch. jnp.matmul's decomposition (b's extra batch
    dims as free dims of b, beside N) would need b transposed to [K, batch * N] before
    our kernel (a copy of b; under Auto axes a sharded N gathered).

    Where the batched product would not run our kernel (`path`, the dispatcher's answer
    for it), the broadcast buys nothing and `jnp_matmul` computes jnp's own program: no
    copy of `a`, partitioned as jnp's (a K sharded on b alone: the broadcast form's
    program summed 16-bit partial products where jnp's gathers K; found by
    scripts/fuzz_gpu.py). Without `jnp_matmul`, always the broadcast form."""
    a_vec, b_vec = a.ndim == 1, b.ndim == 1
    a2 = a[None, :] if a_vec else a
    b2 = b[:, None] if b_vec else b
    batch = tuple(jnp.broadcast_shapes(a2.shape[:-2], b2.shape[:-2]))
    nb = len(batch)
    dims = (((nb + 1,), (nb,)), (tuple(range(nb)), tuple(range(nb))))
    if jnp_matmul is not None:
        batched = [jax.ShapeDtypeStruct(batch + x.shape[-2:], x.dtype) for x in (a2, b2)]
        if path(*batched, dims)[0] != "kernel":
            return jnp_matmul(a, b)

    specs = tuple(sa if sa is not None else sb for sa, sb in zip(_batch_specs(a2, nb), _batch_specs(b2, nb)))
    a2, b2 = _broadcast_batch(a2, batch, specs), _broadcast_batch(b2, batch, specs)
    out = dot_general_fn(a2, b2, dims)
    if a_vec:
        out = jnp.squeeze(out, axis=-2)
    if b_vec:
        out = jnp.squeeze(out, axis=-1)
    return out


def _definitely_equal(x, y) -> bool:
    """x == y for every value of symbolic dims (jax.export): False where undecided (what
    jnp.matmul asks of a batch dim)."""
    try:
        return bool(x == y)
    except jax.errors.InconclusiveDimensionOperation:
        return False


def _matmul_as_dot_general(a, b, dot_general_fn, jnp_matmul=None, path=None):
    """jnp.matmul's own decomposition into one dot_general where `a` holds every batch
    dim: a batch dim present in both operands (same size and sharding) is a batch dim of
    the product; one of `a`'s that `b` lacks or has as 1 is a free dim of `a`, folded
    into M (no broadcast copy of b: b's gradient sums over it in one contraction, and
    a's sharding of it stays); size-1 dims of both are squeezed and restored. Where `b`
    has batch dims `a` lacks: _matmul_broadcast."""
    a_is_mat, b_is_mat = a.ndim > 1, b.ndim > 1
    a_dims = a.shape[:-2] if a_is_mat else ()
    b_dims = b.shape[:-2] if b_is_mat else ()
    nb = max(len(a_dims), len(b_dims))
    a_dims = (None,) * (nb - len(a_dims)) + a_dims
    b_dims = (None,) * (nb - len(b_dims)) + b_dims

    a_specs, b_specs = _batch_specs(a, nb), _batch_specs(b, nb)
    a_squeeze, b_squeeze, both_squeeze, a_batch, b_batch = [], [], [], [], []
    idx_batch, idx_a_other, idx_b_other = [], [], []
    for i, (ba, bb, sa, sb) in enumerate(zip(a_dims, b_dims, a_specs, b_specs)):
        if ba is None:
            idx_b_other.append(i)
        elif bb is None:
            idx_a_other.append(i)
        elif _definitely_equal(ba, 1) and _definitely_equal(bb, 1) and sa is None and sb is None:
            a_squeeze.append(len(idx_batch) + len(idx_a_other) + len(a_squeeze))
            b_squeeze.append(len(idx_batch) + len(idx_b_other) + len(b_squeeze))
            both_squeeze.append(i)
        elif _definitely_equal(ba, 1) and sa is None:
            idx_b_other.append(i)
            a_squeeze.append(len(idx_batch) + len(idx_a_other) + len(a_squeeze))
        elif _definitely_equal(bb, 1) and sb is None:
            idx_a_other.append(i)
            b_squeeze.append(len(idx_batch) + len(idx_b_other) + len(b_squeeze))
        elif _definitely_equal(ba, bb) and sa == sb:
            a_batch.append(len(idx_batch) + len(idx_a_other))
            b_batch.append(len(idx_batch) + len(idx_b_other))
            idx_batch.append(i)
        else:  # jnp's check (_check) refuses these first
            raise ValueError(f"Incompatible types for matmul arguments: {jax.typeof(a)} and {jax.typeof(b)}")
    if idx_b_other:  # b's own batch dims beside N (see _matmul_broadcast)
        return _matmul_broadcast(a, b, dot_general_fn, jnp_matmul, path)
    if a_is_mat:
        idx_a_other.append(nb)
    if b_is_mat:
        idx_b_other.append(nb + a_is_mat)
    perm = tuple(int(p) for p in np.argsort(np.concatenate([idx_batch, idx_a_other, idx_b_other]).astype(int)))
    a = lax.squeeze(a, tuple(a_squeeze))
    b = lax.squeeze(b, tuple(b_squeeze))
    out = dot_general_fn(a, b, (((a.ndim - 1,), (b.ndim - 1 - b_is_mat,)), (tuple(a_batch), tuple(b_batch))))
    if perm != tuple(range(len(perm))):
        out = lax.transpose(out, perm)
    if both_squeeze:
        out = lax.expand_dims(out, tuple(both_squeeze))
    return out


def _check_layer_operands(op, operands, activation) -> str:
    """The checks dense and mlp share: arrays (or None) and a known activation; a bias or
    residual may also be a scalar, as jnp's x @ w + 0.5 (a Python number weakly typed, a
    NumPy scalar of its own type). Returns the operands described for later error messages."""
    from jax_hopper._fused import ACTIVATIONS

    for name, v in operands.items():
        scalar_ok = name not in ("x", "w", "w1", "w2") and isinstance(v, (int, float, complex, np.generic))
        if v is not None and not (_is_array(v) or scalar_ok):
            raise TypeError(f"jax_hopper.{op}: {name} must be a jax or numpy array, got {type(v).__name__}")
    if not (activation is None or isinstance(activation, str)) or activation not in ACTIVATIONS:
        raise ValueError(f"jax_hopper.{op}: activation must be None or one of "
                         f"{sorted(a for a in ACTIVATIONS if a)}, got {activation!r}")
    return ", ".join(f"{n} {_describe(v)}" for n, v in operands.items() if v is not None)


def _broadcast_epilogue(op, rows_shape, n, bias, residual, names, described, width="N"):
    """jnp's broadcasting of ``act(rows @ w + bias) + residual`` (rows_shape: the product's
    [..., N] = rows_shape + (n,)). Returns (bias, jnp_only, result shape): a bias [1, N] or
    [1, 1, N] (not adding dims) reshaped to [N], the epilogue's (its gradient is then the
    [N] one reshaped); jnp_only where only jnp's computation has jnp's result (it
    broadcasts to a larger result, a bias varies along rows or is broadcast along them (a
    scalar: its gradient would sum rounded column sums), a residual is not of the result's
    shape). Shapes jnp would refuse raise a ValueError naming the operand."""
    product = tuple(rows_shape) + (n,)
    full = product
    for name, v, want in ((names[0], bias, f"[{width}] = [{n}]"), (names[1], residual, str(list(product)))):
        if v is None:
            continue
        try:
            full = tuple(jnp.broadcast_shapes(full, np.shape(v)))  # (symbolic dims too)
        except ValueError:
            raise ValueError(f"jax_hopper.{op}: {name} must be {want} or broadcast against the result "
                             f"{list(full)} as in jnp; got {described}") from None
    jnp_only = full != product or (residual is not None and tuple(np.shape(residual)) != product)
    if bias is not None and np.shape(bias) != (n,):
        shape = np.shape(bias)
        if math.prod(shape[:-1]) == 1 and shape[-1:] == (n,) and not jnp_only:
            bias = jnp.reshape(bias, (n,))
        else:
            jnp_only = True
    return bias, jnp_only, full


def _layer_type(op, operands, described):
    """(type, weak) of a layer: jnp's promotion of all its operands, floating or complex
    (flax.linen.Dense's promotion accepts any inexact type; complex layers are jnp's)."""
    dtype, weak = jax.dtypes.result_type(*(v for v in operands.values() if v is not None),
                                         return_weak_type_flag=True)
    if not jnp.issubdtype(dtype, jnp.inexact):
        raise TypeError(f"jax_hopper.{op}: floating-point or complex operands only; got {described}")
    return dtype, weak


def dense(x, w, bias=None, *, activation=None, residual=None):
    """A dense layer, ``act(x @ w + bias) + residual``, with the bias add, the activation
    and the residual add fused into our kernel's epilogue.

    x [..., K], w [K, N], bias [N] or None, residual [..., N] or None; activation None,
    "relu", "gelu_tanh" (jax.nn.gelu's default), "gelu_exact" or "silu". A bias or
    residual of another shape broadcasts as in jnp: a bias [1, N] is the fused [N];
    anything else (a scalar bias, a bias varying along rows, a residual [N], a larger
    result) is jnp's layer. On the kernel
    path: f32 products and sums, bias, activation and residual in f32, one rounding to
    the result type (jnp's promotion of all operands). Eligible when all
    operands share one 16-bit type; then the dispatcher picks the fused kernel (rule
    "fused-activation" where it was measured faster, policy "kernel" always, within the
    kernel's limits) or XLA,
    computing it as jnp would: ``act(x @ w + bias) + residual`` on 16-bit values (the
    same answers as the user's own jnp, at its speed). Operands promoting to another type
    (an f32 bias with f16 x and w: jnp rounds x @ w to f16 before adding it) are
    computed as jnp would, too. Differentiable (each product of
    the derivative is dispatched like a plain product; where only the activation picked
    the kernel, the value and gradient under differentiation are jnp's -- except exact
    GELU, tanh-GELU and SiLU without a residual where the derivative kind runs
    (_dispatch.choose_dense_with_derivative): one launch then writes act(z) and act'(z),
    and the backward pass multiplies by act'(z); in a program spanning devices that
    launch lowers to jnp's computation) and vmappable. With no bias, activation or
    residual it is ``matmul(x, w)``: our plain product, dispatched and transposable as such.
    """
    from jax_hopper._fallback import dense_like_jnp
    from jax_hopper._fused import fused_dense

    operands = {"x": x, "w": w, "bias": bias, "residual": residual}
    described = _check_layer_operands("dense", operands, activation)
    if np.ndim(x) < 1 or np.ndim(w) != 2 or np.shape(x)[-1] != np.shape(w)[0]:
        raise ValueError(f"jax_hopper.dense: needs x [..., K] and w [K, N]; got {described}")
    n = np.shape(w)[1]
    out_shape = tuple(np.shape(x)[:-1]) + (n,)
    bias, jnp_only, _ = _broadcast_epilogue("dense", np.shape(x)[:-1], n, bias, residual, ("bias", "residual"),
                                            described)
    dtype, weak = _layer_type("dense", operands, described)
    # Every operand weakly typed: jnp's result is weak too, which only jnp's computation
    # keeps. x or w that the layer's type cannot hold exactly (int32 x against a bf16 bias;
    # a weak f32 x), or an integer pair: jnp multiplies them in their own type, then rounds.
    # A jax_default_matmul_precision naming an algorithm: jnp's x @ w follows it.
    # A layer type that is not one of the kernel's (an f32 bias with 16-bit x and w): jnp
    # multiplies x and w in their own type and rounds before adding the bias.
    # Epilogue operands that broadcast otherwise than the kernel's [N] and [..., N]: jnp's.
    if (weak or jnp_only or not _converts_exactly(dtype, x, w) or not _multiplied_as_floats(x, w) or
            not _plain_precision(None) or jnp.dtype(dtype) not in KERNEL_DTYPES):
        return dense_like_jnp(x, w, bias, residual, activation=activation)
    x, w = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
    _check("dense", jnp.matmul, x, w)  # jax's own checks of x @ w (a K sharded on explicit mesh axes)
    if bias is None and residual is None and activation is None:
        # Nothing to fuse: the layer is our plain product, dispatched by the rules measured
        # on plain products and linear like it (jax.linear_transpose works through it).
        return matmul(x, w)
    bias = None if bias is None else jnp.asarray(bias, dtype)
    residual = None if residual is None else jnp.asarray(residual, dtype)
    if _epilogue_changes_result_type(x, w, bias, residual):  # (explicit mesh axes) jnp's sum combines the shardings
        return dense_like_jnp(x, w, bias, residual, activation=activation)
    if not _constant_shapes(x, w):
        return dense_like_jnp(x, w, bias, residual, activation=activation)
    problem = _dispatch.layer_problem(x.shape, w.shape, dtype)
    path, rule = _dispatch.choose_dense(problem, activation)
    if not (min(problem.m, problem.n, problem.k) > 0 and path == "kernel"):
        return dense_like_jnp(x, w, bias, residual, activation=activation)
    # Leading dims of x stay: the primitive folds them into M on each device, so a
    # sharded one (a sequence dim) keeps its sharding.
    x2 = x.reshape(1, problem.k) if x.ndim == 1 else x
    r2 = None if residual is None else residual.reshape(x2.shape[:-1] + (n,))
    # Where the rules picked the kernel they pick again on each device's shards (_fused._cuda_impl).
    out = fused_dense(x2, w, bias, r2, activation=activation, rules=_dispatch.picked_by_rules(rule))
    return out.reshape(out_shape)  # named where differentiated


def mlp(x, w1, b1, w2, b2, *, activation="gelu_tanh", residual=None):
    """A transformer MLP block, ``act(x @ w1 + b1) @ w2 + b2 + residual``, whose backward
    pass fuses the activation's derivative into the epilogue of the product that
    produces the hidden layer's cotangent (dh = dy w2^T; cuBLASLt's DGELU epilogue,
    which jnp's block does not get).

    x [..., D], w1 [D, F], b1 [F] or None, w2 [F, N], b2 [N] or None, residual [..., N]
    or None (other shapes broadcast as in `dense`); activation None, "relu", "gelu_tanh"
    (jax.nn.gelu's default), "gelu_exact" or "silu". Undifferentiated it is
    ``dense(dense(x, w1, b1, activation=...), w2, b2, residual=residual)``;
    differentiated in reverse mode (jax.grad, jax.vjp) the forward saves the
    pre-activation z1 = x w1 + b1 and act(z1) in the operands' type, as jnp's block
    does. The backward form runs on our kernel under policy "kernel", and under "auto"
    where it was measured ahead with the bias gradient summed in its epilogue (b1
    differentiated; rule "backward-form-with-bias-gradient": every dimension >= 4096,
    model width <= 8192), for F a multiple of 8, on one device (a program spanning
    several computes it through XLA; operands typed with explicit mesh axes take the
    product and XLA's pass). With exact GELU, tanh-GELU or SiLU, where the dispatcher
    runs the derivative kind on the first layer (rules "fused-activation" and
    "saved-derivative"; F a multiple of 8), the forward instead saves act'(z1), written
    by the same launch as act(z1), and the backward multiplies by it instead of
    recomputing act'. In forward mode (jax.jvp, jacfwd, Hessian-vector products) the
    tangent is computed with products dispatched like plain ones and act' (or the saved
    act'(z1)) applied by XLA. Operands of one 16-bit type use this path; anything else
    is computed as jnp would.
    """
    from jax_hopper._fallback import dense_like_jnp
    from jax_hopper._mlp import mlp_block

    operands = {"x": x, "w1": w1, "b1": b1, "w2": w2, "b2": b2, "residual": residual}
    described = _check_layer_operands("mlp", operands, activation)
    if (np.ndim(x) < 1 or np.ndim(w1) != 2 or np.ndim(w2) != 2 or np.shape(x)[-1] != np.shape(w1)[0] or
            np.shape(w1)[1] != np.shape(w2)[0]):
        raise ValueError(f"jax_hopper.mlp: needs x [..., D], w1 [D, F] and w2 [F, N]; got {described}")
    f, n = np.shape(w2)
    out_shape = tuple(np.shape(x)[:-1]) + (n,)
    b1, hidden_jnp_only, hidden = _broadcast_epilogue("mlp", np.shape(x)[:-1], f, b1, None, ("b1", None), described,
                                                      width="F")
    b2, jnp_only, _ = _broadcast_epilogue("mlp", hidden[:-1], n, b2, residual, ("b2", "residual"), described)
    dtype, weak = _layer_type("mlp", operands, described)
    if (weak or hidden_jnp_only or jnp_only or jnp.dtype(dtype) not in KERNEL_DTYPES or
            not _converts_exactly(dtype, x, w1, w2) or
            not _multiplied_as_floats(x, w1) or not _plain_precision(None) or not _constant_shapes(x, w1, w2) or
            0 in np.shape(x) + np.shape(w2) + (np.shape(w1)[0],)):
        h = dense_like_jnp(x, w1, b1, None, activation=activation)
        return dense_like_jnp(h, w2, b2, residual, activation=None)
    x, w1, w2 = (jnp.asarray(v, dtype) for v in (x, w1, w2))
    b1, b2, residual = (None if v is None else jnp.asarray(v, dtype) for v in (b1, b2, residual))
    if x.ndim == 1:  # one row: the block's products take x [..., M, D]
        rows = lambda v: None if v is None else v.reshape(1, -1)  # noqa: E731
        return mlp_block(rows(x), w1, b1, w2, b2, rows(residual), activation).reshape(out_shape)
    return mlp_block(x, w1, b1, w2, b2, residual, activation)
