"""The drop-ins: lax.dot_general, jnp.dot and jnp.matmul semantics on the Hopper kernel.

Each call is checked once by jax itself (`jax.eval_shape` of the function it replaces),
so bad inputs raise jax's own errors and the result type is jax's. Then:
  - two f16 or two bf16 operands (after jnp's type promotion), an f16/bf16 or f32
    result, a plain precision and no out_sharding: eligible, and decided once
    (_dispatch.decide): the gemm primitive (our kernel on Hopper, XLA's dot elsewhere)
    or XLA's own dot;
  - anything else: the jax function itself, unchanged.

accumulation="f16" (an opt-in) allows f16 sums: eligible f16 products then run the
f16-accumulating kind where it was measured faster (policy "kernel": always); elsewhere
the f32 path, which is faster there and more accurate (docs/numerics.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_hopper import _compat, _dispatch
from jax_hopper import _partitioning as part
from jax_hopper._problem import numeric
from jax_hopper.primitives import gemm

F16, F32 = jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)
ACCUMULATIONS = ("f32", "f16")
NOT_ELIGIBLE = ("jax", "not eligible (dtypes, precision, operand types, or an explicit sharding a fold would drop)")


# ---- validation ------------------------------------------------------------------------
def _struct(x):
    """Abstract stand-in for jax.eval_shape. jax arrays, tracers and ShapeDtypeStructs go as
    they are (their type may carry an explicit sharding, which jax's checks must see)."""
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        return x
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return x


def describe(x) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"
    return type(x).__name__


# ---- trace-time caches -----------------------------------------------------------------
# A product's check and plan depend only on its operands' types, its static arguments and
# the trace context (config, mesh, axis environment): computed once per such key, where
# everything in it hashes. Errors are not cached.
CACHE_SIZE = 4096


def _type_key(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return ("struct", x.shape, x.dtype, x.weak_type, x.sharding)
    return jax.typeof(x)


def cache_key(*static, operands):
    """A hashable key for a trace-time result, or None (then it is computed, not cached)."""
    context = _compat.trace_context()
    if context is None:
        return None
    try:
        key = (static, tuple(_type_key(x) for x in operands), context)
        hash(key)
    except TypeError:
        return None
    return key


def cached(store: dict, key, compute):
    if key is None:
        return compute()
    if key not in store:
        if len(store) >= CACHE_SIZE:
            store.clear()
        store[key] = compute()
    return store[key]


_CHECKED: dict = {}
_PLANNED: dict = {}
_PROMOTED: dict = {}


def check(name, fn, lhs, rhs):
    """jax's own validation and result type for fn(lhs, rhs), with both operands named."""
    if isinstance(fn, functools.partial):
        static = (fn.func, fn.args, tuple(sorted(fn.keywords.items())))
    else:
        static = (fn,)
    return cached(_CHECKED, cache_key(*static, operands=(lhs, rhs)), lambda: _check(name, fn, lhs, rhs))


def _check(name, fn, lhs, rhs):
    return naming_errors(name, lhs, rhs, lambda: jax.eval_shape(fn, _struct(lhs), _struct(rhs)))


def naming_errors(name, lhs, rhs, thunk):
    """thunk(), its TypeError or ValueError re-raised with our function and operands named."""
    try:
        return thunk()
    except (TypeError, ValueError) as err:
        try:
            named = type(err)(f"jax_hopper.{name}({describe(lhs)}, {describe(rhs)}): {err}")
        except Exception:  # an error type whose constructor takes something else
            raise err from None
        raise named from None


# What jax's products take as operands (tracers are jax.Arrays). Anything else goes to
# jax's own function, which raises its error (named as ours) or converts it (`__jax_array__`).
JAX_OPERANDS = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


def jax_operands(lhs, rhs, abstract_ok=False) -> bool:
    kinds = JAX_OPERANDS + ((jax.ShapeDtypeStruct,) if abstract_ok else ())
    return isinstance(lhs, kinds) and isinstance(rhs, kinds)


def is_array(x, abstract_ok=False) -> bool:
    return isinstance(x, (jax.Array, np.ndarray)) or (abstract_ok and isinstance(x, jax.ShapeDtypeStruct))


def _is_precision_level(p) -> bool:
    """A lax.Precision level however spelled; not an algorithm (DotAlgorithm or its name)."""
    try:
        lax.Precision(p)
    except (TypeError, ValueError):
        return False
    return True


def plain_precision(precision) -> bool:
    """Every precision level is met by the kernel (exact 16-bit products, f32 sums); an
    algorithm, explicit or through jax_default_matmul_precision, is left to XLA."""
    levels = precision if isinstance(precision, tuple) else (precision,)
    default = jax.config.jax_default_matmul_precision
    return all(_is_precision_level(default if p is None else p) for p in levels)


def _check_accumulation_value(name, accumulation):
    if accumulation not in ACCUMULATIONS:
        raise ValueError(f"jax_hopper.{name}: accumulation must be one of {ACCUMULATIONS}, got {accumulation!r}")


def _check_accumulation(name, accumulation, lhs, rhs, precision, preferred_element_type):
    _check_accumulation_value(name, accumulation)
    if accumulation == "f16":
        if not (is_array(lhs, True) and is_array(rhs, True) and lhs.dtype == F16 and rhs.dtype == F16):
            raise TypeError(f"jax_hopper.{name}(accumulation='f16') takes two f16 arrays (wgmma has no bf16 "
                            f"accumulator), got {describe(lhs)} and {describe(rhs)}")
        if not gemm.default_precision(precision):
            raise ValueError(f"jax_hopper.{name}: accumulation='f16' does not meet precision={precision!r}")
        if preferred_element_type is not None and jnp.dtype(preferred_element_type) != F16:
            raise ValueError(f"jax_hopper.{name}: accumulation='f16' gives f16 sums; preferred_element_type="
                             f"{jnp.dtype(preferred_element_type).name} asks for wider ones")


def _index_tuples(dimension_numbers, lhs, rhs):
    """dot_general's dimension numbers with each entry a tuple, as jax normalises them.
    None (which jax takes for operands of rank 1 or 2, once its check has passed): lhs's
    last dim against rhs's first."""
    if dimension_numbers is None:
        return ((np.ndim(lhs) - 1,), (0,)), ((), ())
    (lc, rc), (lb, rb) = dimension_numbers
    return tuple(tuple((d,) if isinstance(d, (int, np.integer)) else tuple(d) for d in pair)
                 for pair in ((lc, rc), (lb, rb)))


# ---- one product --------------------------------------------------------------------------
def _plan(lhs, rhs, dims, out_dtype, weak, precision, abstract_ok=False):
    """gemm's plan for a validated dot_general, or None where it is not eligible: a weak
    result (only jax's function keeps it), other dtypes, a precision algorithm, symbolic
    shapes, or a fold explicit mesh axes do not allow."""
    return cached(_PLANNED, cache_key(dims, out_dtype, weak, precision, abstract_ok, operands=(lhs, rhs)),
                  lambda: _plan_uncached(lhs, rhs, dims, out_dtype, weak, precision, abstract_ok))


def _plan_uncached(lhs, rhs, dims, out_dtype, weak, precision, abstract_ok):
    if weak or not (is_array(lhs, abstract_ok) and is_array(rhs, abstract_ok)):
        return None
    if not numeric(*np.shape(lhs), *np.shape(rhs)):
        return None
    same_kernel_type = lhs.dtype == rhs.dtype and lhs.dtype in gemm.KERNEL_DTYPES
    # An f32 result's derivative rounds its f32 cotangent to the 16-bit type.
    if not (same_kernel_type and plain_precision(precision) and
            (out_dtype == lhs.dtype or (out_dtype == F32 and gemm.f32_cotangent_may_round(precision)))):
        return None
    return gemm.plan_for(lhs, rhs, dims, out_dtype)


def _decide(plan, dtype, out_dtype, accumulation) -> _dispatch.Decision:
    return _dispatch.decide(gemm.problem_of_plan(plan, dtype, out_dtype, accumulation == "f16"))


def _product(lhs, rhs, dims, out_dtype, weak, *, precision, preferred_element_type, accumulation, decision=None):
    """A validated dot_general: eligible ones decided (unless `decision` is given) and run
    by gemm.dot_general, the rest by lax.dot_general."""
    fn = functools.partial(lax.dot_general, dimension_numbers=dims, precision=precision,
                           preferred_element_type=preferred_element_type)
    plan = _plan(lhs, rhs, dims, out_dtype, weak, precision)
    if plan is None:
        return fn(lhs, rhs)
    if decision is None:
        decision = _decide(plan, lhs.dtype, out_dtype, accumulation)
    return gemm.dot_general(lhs, rhs, plan, decision, out_dtype, fn, precision)


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *, out_sharding=None,
                accumulation="f32"):
    """``lax.dot_general`` on the Hopper kernel; same signature and semantics.
    ``accumulation="f16"`` (f16 operands only) opts into the f16-accumulating kernel."""
    _check_accumulation("dot_general", accumulation, lhs, rhs, precision, preferred_element_type)
    if out_sharding is not None:
        return lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                               out_sharding=out_sharding)
    fn = functools.partial(lax.dot_general, dimension_numbers=dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type)
    if not jax_operands(lhs, rhs):
        return naming_errors("dot_general", lhs, rhs, lambda: fn(lhs, rhs))
    out = check("dot_general", fn, lhs, rhs)
    return _product(lhs, rhs, _index_tuples(dimension_numbers, lhs, rhs), out.dtype, out.weak_type,
                    precision=precision, preferred_element_type=preferred_element_type, accumulation=accumulation)


def dispatch_path(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *,
                  accumulation="f32") -> tuple[str, str]:
    """Which path ``dot_general`` takes for these operands (arrays or ShapeDtypeStructs)
    under the current policy: ("kernel" | "xla", the rule), or ("jax", why) where the
    product is not eligible. Under sharding, a product the rules send to our kernel is
    decided again on each device's shards."""
    _check_accumulation("dispatch_path", accumulation, lhs, rhs, precision, preferred_element_type)
    fn = functools.partial(lax.dot_general, dimension_numbers=dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type)
    if not jax_operands(lhs, rhs, abstract_ok=True):
        naming_errors("dispatch_path", lhs, rhs, lambda: fn(lhs, rhs))  # jax's error for what it does not take
        return NOT_ELIGIBLE
    out = check("dot_general", fn, lhs, rhs)
    dims = _index_tuples(dimension_numbers, lhs, rhs)
    plan = _plan(lhs, rhs, dims, out.dtype, out.weak_type, precision, abstract_ok=True)
    if plan is None:
        return NOT_ELIGIBLE
    decision = _decide(plan, lhs.dtype, out.dtype, accumulation)
    return decision.path, decision.rule


# ---- jnp's promotion --------------------------------------------------------------------------
def converts_exactly(dtype, *xs) -> bool:
    """Whether converting every x to dtype keeps every value (a "safe" cast). An operand's
    own dtype: jnp.result_type of a lone Python scalar is the default float."""
    return all(np.can_cast(x.dtype if hasattr(x, "dtype") else jnp.result_type(x), dtype, "safe") for x in xs)


def _promote(a, b, preferred_element_type):
    """Both operands in jnp's promoted type, or None where jnp's own function must run: a
    weak result; a non-floating type; a conversion that would change a value (jnp does not
    convert: lax.dot_general takes the operands as given); mixed operands that lax would
    convert to preferred_element_type inexactly; a pair jax does not promote."""
    dtype = cached(_PROMOTED, cache_key(preferred_element_type, operands=(a, b)),
                   lambda: _promoted_type(a, b, preferred_element_type))
    if dtype is None:
        return None
    return tuple(x if isinstance(x, jax.Array) and x.dtype == dtype and not jax.typeof(x).weak_type
                 else jnp.asarray(x, dtype) for x in (a, b))


def _promoted_type(a, b, preferred_element_type):
    try:
        dtype, weak = jax.dtypes.result_type(a, b, return_weak_type_flag=True)
    except jax.dtypes.TypePromotionError:
        return None
    if weak or not jnp.issubdtype(dtype, jnp.floating):
        return None
    if preferred_element_type is not None and not jnp.issubdtype(preferred_element_type, jnp.floating):
        return None
    if not converts_exactly(dtype, a, b):
        return None
    if (preferred_element_type is not None and jnp.result_type(a) != jnp.result_type(b)
            and not converts_exactly(jnp.dtype(preferred_element_type), a, b)):
        return None
    return dtype


def dot(a, b, *, precision=None, preferred_element_type=None, out_sharding=None, accumulation="f32"):
    """``jnp.dot`` on the Hopper kernel (N-D ``x @ W`` included); same semantics.
    ``accumulation="f16"``: see ``dot_general``."""
    _check_accumulation_value("dot", accumulation)
    fn = functools.partial(jnp.dot, precision=precision, preferred_element_type=preferred_element_type)
    if out_sharding is not None:
        return fn(a, b, out_sharding=out_sharding)
    if not jax_operands(a, b):
        return naming_errors("dot", a, b, lambda: fn(a, b))
    out = check("dot", fn, a, b)
    promoted = None if np.ndim(a) == 0 or np.ndim(b) == 0 else _promote(a, b, preferred_element_type)
    if promoted is None:
        return fn(a, b)  # scalar products are elementwise; weak or unpromotable operands
    a, b = promoted
    _check_accumulation("dot", accumulation, a, b, precision, preferred_element_type)
    dims = (((a.ndim - 1,), (max(b.ndim - 2, 0),)), ((), ()))
    return _product(a, b, dims, out.dtype, out.weak_type, precision=precision,
                    preferred_element_type=preferred_element_type, accumulation=accumulation)


# ---- matmul ----------------------------------------------------------------------------------
def matmul(a, b, *, precision=None, preferred_element_type=None, out_sharding=None, accumulation="f32"):
    """``jnp.matmul`` on the Hopper kernel (batch broadcasting included); same semantics.
    ``accumulation="f16"``: see ``dot_general``.

    2-D operands: C = A @ B. Leading dims of `a` against a 2-D `b` fold into M (one
    GEMM); batch dims shared by both: one batched launch; one only `a` has folds into M
    (jnp.matmul's decomposition); one only `b` has broadcasts `a` (_matmul_broadcast).
    """
    _check_accumulation_value("matmul", accumulation)
    fn = functools.partial(jnp.matmul, precision=precision, preferred_element_type=preferred_element_type)
    if out_sharding is not None:
        return fn(a, b, out_sharding=out_sharding)
    if not jax_operands(a, b):
        return naming_errors("matmul", a, b, lambda: fn(a, b))
    out = check("matmul", fn, a, b)  # jax's errors first (a scalar operand: its ValueError)
    promoted = _promote(a, b, preferred_element_type)
    if promoted is None:
        return fn(a, b)
    a, b = promoted
    _check_accumulation("matmul", accumulation, a, b, precision, preferred_element_type)
    product = functools.partial(_product, out_dtype=out.dtype, weak=False, precision=precision,
                                preferred_element_type=preferred_element_type, accumulation=accumulation)

    def decide_batched(a_struct, b_struct, dims):
        plan = _plan(a_struct, b_struct, dims, out.dtype, False, precision, abstract_ok=True)
        return None if plan is None else _decide(plan, a.dtype, out.dtype, accumulation)

    # An f32 result of f16 operands takes our derivative rule on the XLA path too: no jnp program for it.
    jnp_matmul = None if (out.dtype == F32 and a.dtype == F16) else fn
    return _matmul_as_dot_general(a, b, product, jnp_matmul, decide_batched)


def _definitely_equal(x, y) -> bool:
    """x == y for every value of symbolic dims; False where undecided."""
    try:
        return bool(x == y)
    except jax.errors.InconclusiveDimensionOperation:
        return False


def _batch_specs(x, count):
    """The explicit-axes shardings of x's batch dims (those before its last two), right-
    aligned to `count` batch dims as matmul broadcasts them."""
    spec = part.value_spec(x) if x.ndim > 1 else None
    spec = (None,) * max(x.ndim - 2, 0) if spec is None else tuple(spec[:-2])
    return (None,) * (count - len(spec)) + spec


def _matmul_as_dot_general(a, b, product, jnp_matmul, decide_batched, broadcast=True):
    """jnp.matmul's decomposition into one dot_general: a batch dim in both operands (same
    size and sharding) is a batch dim of the product; one that only one operand has (or
    has as other than 1) is a free dim of that operand, folded into its M or N (no
    broadcast copy; its sharding stays); size-1 dims of both are squeezed and restored.
    Where `b` has batch dims `a` lacks and `broadcast` is set: _matmul_broadcast."""
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
        else:  # jnp's check refuses these first
            raise ValueError(f"Incompatible types for matmul arguments: {jax.typeof(a)} and {jax.typeof(b)}")
    if idx_b_other and broadcast:  # b's own batch dims beside N
        return _matmul_broadcast(a, b, product, jnp_matmul, decide_batched)
    if a_is_mat:
        idx_a_other.append(nb)
    if b_is_mat:
        idx_b_other.append(nb + a_is_mat)
    perm = tuple(int(p) for p in np.argsort(np.concatenate([idx_batch, idx_a_other, idx_b_other]).astype(int)))
    a = lax.squeeze(a, tuple(a_squeeze)) if a_squeeze else a
    b = lax.squeeze(b, tuple(b_squeeze)) if b_squeeze else b
    out = product(a, b, (((a.ndim - 1,), (b.ndim - 1 - b_is_mat,)), (tuple(a_batch), tuple(b_batch))))
    if perm != tuple(range(len(perm))):
        out = lax.transpose(out, perm)
    if both_squeeze:
        out = lax.expand_dims(out, tuple(both_squeeze))
    return out


def _broadcast_batch(x, batch, specs):
    """x [..., R, C] broadcast to [*batch, R, C]. Under explicit mesh axes the copy takes
    the batch dims' shardings `specs` (the other operand's)."""
    if tuple(x.shape[:-2]) == tuple(batch):
        return x
    y = jnp.broadcast_to(x, tuple(batch) + x.shape[-2:])
    own = part.value_spec(x)
    if own is not None and any(specs):
        # A mesh axis names one dim: x's row and column dims give up those the batch dims take.
        used = {axis for axes in part.axes(specs, len(specs)) for axis in axes}
        kept = [tuple(axis for axis in axes if axis not in used) or None for axes in part.axes(own[-2:], 2)]
        y = jax.sharding.reshard(y, jax.sharding.PartitionSpec(*specs, *kept))
    return y


def _matmul_broadcast(a, b, product, jnp_matmul, decide_batched):
    """matmul where `b` has batch dims that `a` lacks (or has as 1): both broadcast to the
    common batch, one batched launch (jnp's decomposition would copy b transposed). Where
    the batched product would not run our kernel the broadcast buys nothing, and
    `jnp_matmul` computes jnp's own program (partitioned as jnp's).

    The derivative of an operand that was broadcast is jnp's decomposition's: its
    gradient is one product over the batch dims it lacks and its own contraction, summed
    in f32 and rounded once (the batched launch's transpose would round each batch
    entry's gradient to 16 bits before summing them, turning a finite sum infinite)."""
    a_vec, b_vec = a.ndim == 1, b.ndim == 1
    a2 = a[None, :] if a_vec else a
    b2 = b[:, None] if b_vec else b
    batch = tuple(jnp.broadcast_shapes(a2.shape[:-2], b2.shape[:-2]))
    nb = len(batch)
    dims = (((nb + 1,), (nb,)), (tuple(range(nb)), tuple(range(nb))))
    decision = None
    if jnp_matmul is not None:
        decision = decide_batched(*[jax.ShapeDtypeStruct(batch + x.shape[-2:], x.dtype) for x in (a2, b2)], dims)
        if decision is None or decision.path != "kernel":
            return jnp_matmul(a, b)
    specs = tuple(sa if sa is not None else sb for sa, sb in zip(_batch_specs(a2, nb), _batch_specs(b2, nb)))

    def batched(x, y):
        x2 = x[None, :] if a_vec else x
        y2 = y[:, None] if b_vec else y
        out = product(_broadcast_batch(x2, batch, specs), _broadcast_batch(y2, batch, specs), dims,
                      decision=decision)
        if a_vec:
            out = jnp.squeeze(out, axis=-2)
        if b_vec:
            out = jnp.squeeze(out, axis=-1)
        return out

    def decomposed(x, y):
        return _matmul_as_dot_general(x, y, product, jnp_matmul, decide_batched, broadcast=False)

    a_term = batched if tuple(a2.shape[:-2]) == batch else decomposed
    b_term = batched if tuple(b2.shape[:-2]) == batch else decomposed
    return gemm.bilinear(batched, (a_term, b_term), a, b, name=gemm.PRODUCT_NAME)
