"""Forward- and reverse-mode rules for the GEMM primitive and the fused dense primitive.

C = op(A) op(B) is bilinear, so its JVP is gemm(dA, B) + gemm(A, dB) and its transposes
are two more products. Each is expressed with transpose flags chosen so that it reads
the stored operands in place (the NT/TN layouts, never a transposing copy), and each is
dispatched like a product the user wrote (_dispatch.choose, under the policy in effect
while the derivative is traced): our kernel where the table says it wins (or under
policy "kernel"), else XLA's dot -- a backward product is not slower than jnp's because
the forward one ran our kernel.

With op(X) = X^T when its flag is set:
  dA = dC op(B)^T                       -> gemm(dC, B, ta=False, tb=not tb)   (A stored [M,K])
  dA = (dC op(B)^T)^T = op(B) dC^T      -> gemm(B, dC, ta=tb, tb=True)       (A stored [K,M])
  dB = op(A)^T dC                       -> gemm(A, dC, ta=not ta, tb=False)  (B stored [K,N])
  dB = (op(A)^T dC)^T = dC^T op(A)      -> gemm(dC, A, ta=True, tb=ta)       (B stored [N,K])
An f32 cotangent (out_dtype=f32) is rounded to the operands' 16-bit type first, so the
backward products multiply 16-bit inputs (on our kernel, or cuBLAS at its 16-bit rate;
jax's own rule runs a mixed f32 x 16-bit dot, TF32 on the GPU: 11 bits of each entry).
bf16 has f32's exponent range but 8 bits: an f32 cotangent c is split into hi = bf16(c)
and lo = bf16(c - hi), 16 bits together, and multiplied twice (the cost of jax's one
TF32 product, which runs at half the 16-bit rate). f16's range ends at 65504 and its smallest subnormal is 2^-24: a
loss-scaled cotangent would round to inf and a mean over many outputs (1e-9 per logit)
to zero. So an f16 one is first scaled by a power of two that puts its largest magnitude
in [2^14, 2^15); the product is taken in f32, the scale undone exactly, and the gradient
rounded once to f16. Each entry is rounded to 11 bits of itself, or to 2^-39 of the
largest where it is that small (f16's subnormals; below about 2^-39 of the largest it
is zero); jax's rule keeps 24 bits (TF32, on the GPU, 11). That is an f16 product's own
error: every gradient is an f16 value rounded to 11 bits anyway. Differentiated again
(hessians, gradient penalties) that computation has the derivatives of jax's rule.
With A [..., M, K] (leading dims, a rank-2 B) dA is the same product with leading dims;
dB contracts them with M: on XLA's path one dot_general over all of them (partitioned
like jnp's: a sharded sequence dim gives partial sums and an all-reduce), on our kernel
the folded [L*M, K]^T [L*M, N] product.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero
from jax.interpreters import ad

from jax_hopper import _dispatch
from jax_hopper._fallback import (
    ACTIVATION_FNS,
    activation_grad_with_bias_grad_reference,
    activation_with_derivative,
    dense_like_jnp,
    dense_with_derivative_reference,
    gemm_reference,
)
from jax_hopper._fused import dense_derivative_p, dense_grad_p, dense_p, fused_dense, fused_dense_with_derivative
from jax_hopper._primitive import PRODUCT_NAME, gemm, gemm_p
from jax_hopper._sharding import is_explicit, merge_drops_explicit_sharding, padded_spec

# f32's exponent field: 2^e for an integer e is the bit pattern (e + bias) << mantissa bits
# (a normal f32: -126 <= e <= 127).
F32_EXPONENT_BIAS = 127
BF16_EXPONENT_BITS, BF16_MANTISSA_BITS = 8, 7
F32_MANTISSA_BITS = 23
BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)
# A scaled f16 cotangent's largest magnitude lies in [2^14, 2^15): below 65504 after
# rounding, leaving f16's 2^-24..2^15 range to its smaller values.
F16_SCALED_EXPONENT = 15
# The scale 2^s: s >= 15 - 128 (finite f32 values are below 2^128) needs no bound; s is
# capped at 126 so that 2^-s stays a normal f32 (a cotangent below 2^-111 is then not
# scaled all the way up, and still rounds to f16 without overflow).
MAX_SCALE_EXPONENT = 126


def _pow2(e):
    """2.0^e in f32, exactly, for an integer e with -126 <= e <= 127."""
    return lax.bitcast_convert_type((e + F32_EXPONENT_BIAS).astype(jnp.int32) << F32_MANTISSA_BITS, jnp.float32)


def _scaled_to_f16(ct):
    """(ct * 2^s rounded to f16, 2^-s) with its largest finite magnitude scaled into
    [2^14, 2^15): an inf or nan entry stays one and propagates as in jnp, without pulling
    the scale of the finite entries past 65504. An empty ct gets s = 15."""
    _, e = jnp.frexp(jnp.max(jnp.where(jnp.isfinite(ct), jnp.abs(ct), 0), initial=0.0))  # max < 2^e
    s = jnp.minimum(F16_SCALED_EXPONENT - e, MAX_SCALE_EXPONENT)
    return (ct * _pow2(s)).astype(jnp.float16), _pow2(-s)


def _gradient(ct, other, product, dtype):
    """A gradient of the primitive: product(c, other, out_dtype), the backward product
    with the cotangent c in its place, for the cotangent as the products use it (module
    docstring): in the operands' type `dtype`; an f32 one of f16 operands scaled,
    rounded and its product unscaled; an f32 one of bf16 operands split into two bf16
    parts, two products summed. These derivatives (second-order autodiff) are those of
    jax's rule, the f32 product: the scale chosen for ct must not be applied to a tangent
    or cotangent of another magnitude."""
    if ct.dtype == dtype:
        return product(ct, other, dtype)

    def rounded(c, o):
        if dtype == jnp.bfloat16:
            # hi: c rounded to bf16's 8 bits, kept in f32 by reduce_precision. Not
            # c.astype(bf16).astype(f32): XLA on the GPU may drop that round trip (excess
            # precision allowed), which made lo zero on the H200 (test_autodiff, 7b990c9).
            hi = lax.reduce_precision(c, exponent_bits=BF16_EXPONENT_BITS, mantissa_bits=BF16_MANTISSA_BITS)
            # A finite c past bf16's largest value rounds to inf: hi keeps that largest
            # value and lo the rest (jax's f32 product of it is finite).
            hi = jnp.where(jnp.isinf(hi) & jnp.isfinite(c), jnp.sign(c) * BF16_MAX, hi)
            # An inf or nan entry is all in hi (inf - inf would put a nan in lo).
            lo = jnp.where(jnp.isfinite(hi), c - hi, 0)
            hi, lo = hi.astype(dtype), lo.astype(dtype)  # hi exactly
            p_hi = product(hi, o, jnp.float32)
            total = p_hi + product(lo, o, jnp.float32)
            # A nan only the low part brought (its 0 against an inf of the other operand, or
            # its opposite sign against an overflowed high product) is not in jax's one f32
            # product, which gives the high part's inf there.
            return jnp.where(jnp.isnan(total) & ~jnp.isnan(p_hi), p_hi, total).astype(dtype)
        c16, undo = _scaled_to_f16(c)
        return (product(c16, o, jnp.float32) * undo).astype(dtype)

    def exact(c, o):  # jax's rule: the mixed f32 x f16 product (XLA's dot)
        return product(c, o, jnp.float32).astype(dtype)

    def jvp(primals, tangents):
        y = rounded(*primals)
        return y, _jvp_where_moving(exact, primals, tangents, SymbolicZero, y)[1]

    f = jax.custom_jvp(rounded)
    f.defjvp(jvp, symbolic_zeros=True)
    return f(ct, other)


def _jvp_where_moving(f, primals, tangents, zero_type, like):
    """jax.jvp of f differentiated only in the arguments whose tangent is not a symbolic
    zero (of `zero_type`): instantiating one would add a product of zeros. With none
    moving: f's value (`like`'s, if given, not recomputed) and a zero tangent."""
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


def _problem(a, b, transpose_a, transpose_b, out_dtype=None):
    return _dispatch.problem_of(a.shape, b.shape, a.dtype, a.dtype if out_dtype is None else out_dtype, transpose_a,
                                transpose_b)


def _kernel_chosen(a, b, transpose_a, transpose_b) -> bool:
    """Whether the dispatcher sends this product (16-bit result) to our kernel."""
    return _dispatch.choose(_problem(a, b, transpose_a, transpose_b))[0] == "kernel"


def _aval(x):
    """x's type. An operand being differentiated is a placeholder with an aval
    (UndefinedPrimal; ValAccum in newer jax), not an array."""
    return x.aval if hasattr(x, "aval") else jax.typeof(x)


def _sharding_of(x):
    """The sharding in x's type. A type with no mesh (an array made before entering the
    mesh context) counts as replicated over the current mesh, as in jax's own dot rule:
    its gradient's product, typed with the empty mesh, was refused where it contracts a
    sharded dim."""
    aval = _aval(x)
    sharding = getattr(aval, "sharding", None)
    if getattr(getattr(sharding, "mesh", None), "empty", False):
        mesh = jax.sharding.get_abstract_mesh()
        if not mesh.empty:
            return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*[None] * aval.ndim))
    return sharding


def _explicitly_typed(x) -> bool:
    """Whether x's own type names explicit mesh axes (a type with no mesh does not)."""
    return is_explicit(getattr(_aval(x), "sharding", None))


def _in_type_of(y, like):
    """y resharded to `like`'s sharding where explicit mesh axes put it in the type: the
    kernel's result follows its own operands (batch and M from the first), and a
    cotangent must have its primal's type (a batch sharded on one operand only gave the
    other's gradient a sharded batch, which jax refuses)."""
    want = None if like is None else _sharding_of(like)
    have = getattr(jax.typeof(y), "sharding", None)
    if not (is_explicit(want) and hasattr(have, "spec")):
        return y
    return y if padded_spec(want, y.ndim) == padded_spec(have, y.ndim) else jax.sharding.reshard(y, want)


# A derivative's product, on the default kernel (a V5 forward, jnp.dot's layout only,
# has no NT/TN instances to reuse) or XLA's dot, as the dispatcher says. `like`: the
# operand whose gradient this is (the result has its stored shape and takes its
# sharding on the XLA path, as jax's own dot transpose does).
def _product(a, b, *, transpose_a=False, transpose_b=False, like=None, out_dtype=None):
    out_dtype = a.dtype if out_dtype is None else out_dtype
    problem = _problem(a, b, transpose_a, transpose_b, out_dtype)
    path, rule = _dispatch.choose(problem)
    if a.dtype == b.dtype and path == "kernel":  # (mixed: jax's rule, _gradient)
        kernel = _dispatch.kernel_for(problem)
        return _in_type_of(gemm(a, b, transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=out_dtype,
                                kernel=kernel, rules=_dispatch.picked_by_rules(rule)), like)
    return gemm_reference(a, b, transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=out_dtype,
                          out_sharding=None if like is None else _sharding_of(like))


def _transpose_lhs(ct, a, b, *, transpose_a, transpose_b, out_dtype, kernel, stages, rules=False):
    del out_dtype, kernel, stages, rules

    def product(c, b, out_dtype):
        if transpose_a:
            return _product(b, c, transpose_a=transpose_b, transpose_b=True, like=a, out_dtype=out_dtype)
        return _product(c, b, transpose_a=False, transpose_b=not transpose_b, like=a, out_dtype=out_dtype)

    return _gradient(ct, b, product, b.dtype)


def _inner_dims_explicitly_sharded(x) -> bool:
    """Whether explicit mesh axes shard a dim of x [L0, ..., R, P] past L0 and before P,
    which folding to [L0 * ... * R, P] cannot keep (jax refuses that reshape)."""
    return merge_drops_explicit_sharding(_aval(x), 0, x.ndim - 2)


def _contracting_leading_dims(x, y, *, like, out_dtype=None):
    """x^T y over all leading dims and the rows of x [..., R, P] and y [..., R, Q]: [P, Q]
    (in out_dtype, default x's).
    On our kernel the contracted dims are folded into one (under Auto mesh axes a sharded
    inner one is gathered first); on XLA's path, and where explicit axes shard an inner
    one, one dot_general contracts them all (partial sums and an all-reduce, as jnp)."""
    rows = tuple(range(x.ndim - 1))
    r, p, q = math.prod(x.shape[:-1]), x.shape[-1], y.shape[-1]
    foldable = r > 0 and not (_inner_dims_explicitly_sharded(x) or _inner_dims_explicitly_sharded(y))
    out_dtype = x.dtype if out_dtype is None else out_dtype
    problem = _dispatch.problem_of((r, p), (r, q), x.dtype, out_dtype, True, False)
    if foldable and x.dtype == y.dtype and _dispatch.choose(problem)[0] == "kernel":
        return _product(x.reshape(r, p), y.reshape(r, q), transpose_a=True, like=like, out_dtype=out_dtype)
    preferred = None if out_dtype == x.dtype else out_dtype
    return lax.dot_general(x, y, ((rows, rows), ((), ())), preferred_element_type=preferred,
                           out_sharding=_sharding_of(like))


def _transpose_rhs(ct, a, b, *, transpose_a, transpose_b, out_dtype, kernel, stages, rules=False):
    del out_dtype, kernel, stages, rules

    def product(c, a, out_dtype):
        if a.ndim > _aval(b).ndim:  # A [..., M, K] (not transposed): contract its leading dims and M
            x, y = (c, a) if transpose_b else (a, c)
            return _contracting_leading_dims(x, y, like=b, out_dtype=out_dtype)
        if transpose_b:
            return _product(c, a, transpose_a=True, transpose_b=transpose_a, like=b, out_dtype=out_dtype)
        return _product(a, c, transpose_a=not transpose_a, transpose_b=False, like=b, out_dtype=out_dtype)

    return _gradient(ct, a, product, a.dtype)


ad.defbilinear(gemm_p, _transpose_lhs, _transpose_rhs)


# ---- the fused dense primitive ------------------------------------------------------
# y = act(z) + r with z = x w + b. Its JVP is
#   dy = act'(z) (dx w + x dw + db) + dr.
# Where the table sends the plain product x w to XLA (the fused kernel was picked for
# its activation alone), the JVP is that of jnp's own computation (below). Otherwise
# the tangent products are dispatched like any product (_product; reverse mode
# transposes them into the NT/TN products above) in the operands' type, so the
# backward pass moves 16-bit cotangents only, as jnp.dot's does. Without an activation
# y is linear in z: the primal stays one fused call (bias and residual in the
# epilogue). With one, act' needs z: the kernel produces z (bias fused) rounded to the
# operands' type -- jnp's own rounding point, and the cheapest thing to save
# (recomputing z would cost a product) -- and XLA applies act and the residual in one
# elementwise pass; under differentiation y thus carries one more rounding than the
# undifferentiated fused call, and the fused activation (the forward's gain) is not
# used. act' is applied by XLA in the backward pass too: fusing it into the epilogue
# of the product that produces the cotangent is not done.
# The saved-derivative form (exact GELU, tanh-GELU and SiLU by default, where the
# dispatcher runs the derivative kind; no residual, which that kind does not add): one
# launch writes act(z) and act'(z), both from the f32 z, and the tangent is act'(z) dz,
# so the backward pass multiplies by the saved act'(z) instead of recomputing it from z
# -- jax_hopper.mlp's form, for a block built from `dense` calls. On the kernel path the
# value is then the undifferentiated fused call's (one rounding of act(z)); a program
# spanning devices lowers the derivative primitive to jnp's computation (it has no
# partitioning rules).
def derivative_kind_runs(x, w, b, activation) -> bool:
    """Whether the dispatcher sends act(z), act'(z) of z = x w + b to the derivative kind."""
    if activation is None:
        return False
    problem = _dispatch.problem_of((math.prod(x.shape[:-1]), x.shape[-1]), w.shape, x.dtype, x.dtype, False, False)
    explicit = any(_explicitly_typed(v) for v in (x, w, b) if v is not None)
    return not explicit and _dispatch.choose_dense_with_derivative(problem, activation)[0] == "kernel"


def saved_derivative_choice(x, w, b, activation) -> tuple[bool, bool]:
    """(whether to save act'(z) instead of z, whether the derivative kind computes it)."""
    # Only asked where the form can apply: the question may warn that the kernel is missing.
    kernel = _dispatch.may_save_derivative(activation) and derivative_kind_runs(x, w, b, activation)
    return _dispatch.saves_derivative(activation, kernel), kernel


def activation_and_derivative(x, w, b, activation, kernel):
    """(act(z), act'(z)) for z = x w + b: one launch of the derivative kind (both from the
    f32 z) if `kernel`, else the layer (dispatched as in `dense`) and one XLA pass
    computing both from its 16-bit result."""
    if kernel:
        return fused_dense_with_derivative(x, w, b, activation=activation)
    from jax_hopper.ops import dense

    return activation_with_derivative(dense(x, w, b), activation)


def _z_tangent(x, w, dx, dw, dbias, has_bias):
    """dz = dx w + x dw + db, each product dispatched (16-bit, as jnp.dot's tangents)."""
    dz = None
    for tangent, product in ((dx, lambda t: _product(t, w)), (dw, lambda t: _product(x, t))):
        if not isinstance(tangent, ad.Zero):
            dz = product(tangent) if dz is None else dz + product(tangent)
    if has_bias and not isinstance(dbias, ad.Zero):
        # Alone (x and w fixed: a bias-only fine-tune) the bias tangent still spans all rows.
        dz = jnp.broadcast_to(dbias, x.shape[:-1] + w.shape[1:]) if dz is None else dz + dbias
    return jnp.zeros(x.shape[:-1] + w.shape[1:], x.dtype) if dz is None else dz


def _dense_jvp(primals, tangents, **params):
    # The layer's output is named (a remat policy's handle, ops.PRODUCT_NAME) here, where it
    # is differentiated, not in ops.dense: jax has no transpose rule for a name, and an
    # undifferentiated affine layer must stay transposable (jax.linear_transpose).
    y, dy = _dense_jvp_unnamed(primals, tangents, **params)
    return checkpoint_name(y, PRODUCT_NAME), dy


def _dense_jvp_unnamed(primals, tangents, *, activation, has_bias, has_residual, rules=False):
    x, w, bias, residual = primals
    dx, dw, dbias, dresidual = tangents
    optional_bias = bias if has_bias else None
    if activation is not None and not has_residual:
        save, kernel = saved_derivative_choice(x, w, optional_bias, activation)
        if save:
            y, derivative = activation_and_derivative(x, w, optional_bias, activation, kernel)
            # Named, so a remat policy can keep what the backward pass needs (ops.PRODUCT_NAME).
            derivative = checkpoint_name(derivative, PRODUCT_NAME)
            return y, derivative * _z_tangent(x, w, dx, dw, dbias, has_bias)
    if not _kernel_chosen(x, w, False, False):
        # The table sends the plain product to XLA (the fused kernel was picked for its
        # activation, a saving the derivative cannot use): differentiate jnp's own
        # computation, so a training step runs exactly what the user's jnp would.
        def like_jnp(x, w, bias, residual):
            return dense_like_jnp(x, w, bias if has_bias else None, residual if has_residual else None,
                                  activation=activation)

        return _jvp_where_moving(like_jnp, primals, tangents, ad.Zero, None)
    f32 = jnp.float32
    dz = _z_tangent(x, w, dx, dw, dbias, has_bias)
    if activation is None:
        y = fused_dense(x, w, optional_bias, residual if has_residual else None, rules=rules)
        dy = dz
    else:
        # z's kind was picked by _kernel_chosen (the plain product's rules), which the fused
        # layer's rules, asked again on shards (_fused._cuda_impl), can answer otherwise
        # ("wide-aligned" is not theirs): z runs as picked.
        z = checkpoint_name(fused_dense(x, w, optional_bias, None), PRODUCT_NAME)
        y, dy = jax.jvp(ACTIVATION_FNS[activation], (z.astype(f32),), (dz.astype(f32),))
        if has_residual:
            y = y + residual.astype(f32)
        y, dy = y.astype(x.dtype), dy.astype(x.dtype)
    if has_residual and not isinstance(dresidual, ad.Zero):
        dy = dy + dresidual
    return y, dy


ad.primitive_jvps[dense_p] = _dense_jvp


def _dense_transpose(ct, x, w, bias, residual, *, activation, has_bias, has_residual, rules=False):
    """jax.linear_transpose through a layer without activation, x w + b + r, linear in the
    one undefined operand (the others are constants, as in jnp's x @ w + b): the
    transposes of the maps its JVP uses (the product's own rules, the bias broadcast's
    sum), so they match jax.grad's and keep the operands' types (explicit shardings,
    shard_map's varying axes). grad itself never needs this (it transposes the JVP's maps)."""
    del rules  # the transposed products are dispatched afresh
    if activation is not None:
        raise NotImplementedError(f"Transpose rule for 'jax_hopper_dense' with activation {activation!r}: "
                                  "the layer is not linear")
    if ad.is_undefined_primal(x) and ad.is_undefined_primal(w):
        raise NotImplementedError("Transpose rule for 'jax_hopper_dense': x and w both linear inputs (bilinear)")
    ct = ad.instantiate_zeros(ct)
    flags = dict(transpose_a=False, transpose_b=False, out_dtype=ct.dtype, kernel=None, stages=None)
    return [_transpose_lhs(ct, x, w, **flags) if ad.is_undefined_primal(x) else None,
            _transpose_rhs(ct, x, w, **flags) if ad.is_undefined_primal(w) else None,
            # In ct's own type, as jax transposes jnp's bias broadcast (jnp.sum would sum in f32).
            lax.reduce(ct, np.zeros((), ct.dtype), lax.add, tuple(range(ct.ndim - 1)))
            if has_bias and ad.is_undefined_primal(bias) else None,
            ct if has_residual and ad.is_undefined_primal(residual) else None]


ad.primitive_transposes[dense_p] = _dense_transpose


# ---- the backward form (differentiated again: second-order gradients of jax_hopper.mlp)
# dz = (g w^T) * act'(z) (and its bias gradient) keep the kernel's values; their tangents
# are those of the f32 reference arithmetic (act'' by jax), in the operands' type.
def _dense_grad_jvp(primals, tangents, *, activation, bias_grad):
    outs = dense_grad_p.bind(*primals, activation=activation, bias_grad=bias_grad)
    tangents = tuple(ad.instantiate_zeros(t) for t in tangents)

    def reference(g, w, z):
        return activation_grad_with_bias_grad_reference(g, w, z, activation=activation, bias_grad=bias_grad)

    _, douts = jax.jvp(reference, primals, tangents)
    return outs, list(douts)


ad.primitive_jvps[dense_grad_p] = _dense_grad_jvp


# ---- the forward form that also writes act'(z) (second-order gradients of mlp) ---------
# Both outputs keep the kernel's values; their tangents are those of the reference
# arithmetic (act' and act'' by jax), in the operands' type.
def _dense_derivative_jvp(primals, tangents, *, activation, has_bias):
    outs = dense_derivative_p.bind(*primals, activation=activation, has_bias=has_bias)
    tangents = tuple(ad.instantiate_zeros(t) for t in tangents)

    def reference(x, w, b):
        return dense_with_derivative_reference(x, w, b if has_bias else None, activation=activation)

    _, douts = jax.jvp(reference, primals, tangents)
    return outs, list(douts)


ad.primitive_jvps[dense_derivative_p] = _dense_derivative_jvp
