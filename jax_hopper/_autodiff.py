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
An f32 cotangent (out_dtype=f32) of bf16 operands is rounded to bf16 first: the kernel
multiplies 16-bit inputs. Of f16 operands it stays f32 and its products run XLA's dot, as
jax's own rule has them (f32 times the f16 operand, rounded once at the end): f16's range
ends at 65504 and its smallest subnormal is 2^-24, so a loss-scaled cotangent would round
to inf and a mean over many outputs (1e-9 per logit) to zero, where jnp's gradient is
finite and nonzero. bf16 has f32's exponent range.
With A [..., M, K] (leading dims, a rank-2 B) dA is the same product with leading dims;
dB contracts them with M: on XLA's path one dot_general over all of them (partitioned
like jnp's: a sharded sequence dim gives partial sums and an all-reduce), on our kernel
the folded [L*M, K]^T [L*M, N] product.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
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
from jax_hopper._primitive import gemm, gemm_p
from jax_hopper._sharding import is_explicit, merge_drops_explicit_sharding, padded_spec


def _cotangent_for(ct, dtype):
    """The cotangent as the products use it: in the operands' 16-bit type (our kernel's
    input), except an f32 one of f16 operands, which stays f32 (module docstring)."""
    if ct.dtype == dtype or (dtype == jnp.float16 and jnp.dtype(ct.dtype).itemsize > 2):
        return ct
    return ct.astype(dtype)


def _mixed(a, b):
    """(wider, narrower) dtype of an f32 cotangent and a 16-bit operand; None when a and b
    have one type."""
    if a.dtype == b.dtype:
        return None
    wide, narrow = sorted((a.dtype, b.dtype), key=lambda d: jnp.dtype(d).itemsize, reverse=True)
    return wide, narrow


def _problem(a, b, transpose_a, transpose_b):
    return _dispatch.problem_of(a.shape, b.shape, a.dtype, a.dtype, transpose_a, transpose_b)


def _kernel_chosen(a, b, transpose_a, transpose_b) -> bool:
    """Whether the dispatcher sends this product (16-bit result) to our kernel."""
    return _dispatch.choose(_problem(a, b, transpose_a, transpose_b))[0] == "kernel"


def _aval(x):
    """x's type. An operand being differentiated is a placeholder with an aval
    (UndefinedPrimal; ValAccum in newer jax), not an array."""
    return x.aval if hasattr(x, "aval") else jax.typeof(x)


def _sharding_of(x):
    """The sharding in x's type."""
    return getattr(_aval(x), "sharding", None)


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
def _product(a, b, *, transpose_a=False, transpose_b=False, like=None):
    mixed = _mixed(a, b)
    if mixed is not None:  # an f32 cotangent kept (f16 operands): XLA's dot in f32, as jax's rule
        return gemm_reference(a, b, transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=mixed[0],
                              out_sharding=None if like is None else _sharding_of(like)).astype(mixed[1])
    problem = _problem(a, b, transpose_a, transpose_b)
    if _dispatch.choose(problem)[0] == "kernel":
        kernel = _dispatch.kernel_for(problem)
        return _in_type_of(gemm(a, b, transpose_a=transpose_a, transpose_b=transpose_b, kernel=kernel), like)
    return gemm_reference(a, b, transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=a.dtype,
                          out_sharding=None if like is None else _sharding_of(like))


def _transpose_lhs(ct, a, b, *, transpose_a, transpose_b, out_dtype, kernel, stages):
    del out_dtype, kernel, stages
    ct = _cotangent_for(ct, b.dtype)
    if transpose_a:
        return _product(b, ct, transpose_a=transpose_b, transpose_b=True, like=a)
    return _product(ct, b, transpose_a=False, transpose_b=not transpose_b, like=a)


def _inner_dims_explicitly_sharded(x) -> bool:
    """Whether explicit mesh axes shard a dim of x [L0, ..., R, P] past L0 and before P,
    which folding to [L0 * ... * R, P] cannot keep (jax refuses that reshape)."""
    return merge_drops_explicit_sharding(_aval(x), 0, x.ndim - 2)


def _contracting_leading_dims(x, y, *, like):
    """x^T y over all leading dims and the rows of x [..., R, P] and y [..., R, Q]: [P, Q].
    On our kernel the contracted dims are folded into one (under Auto mesh axes a sharded
    inner one is gathered first); on XLA's path, and where explicit axes shard an inner
    one, one dot_general contracts them all (partial sums and an all-reduce, as jnp)."""
    rows = tuple(range(x.ndim - 1))
    r, p, q = math.prod(x.shape[:-1]), x.shape[-1], y.shape[-1]
    foldable = r > 0 and not (_inner_dims_explicitly_sharded(x) or _inner_dims_explicitly_sharded(y))
    mixed = _mixed(x, y)
    if mixed is not None:  # an f32 cotangent kept (f16 operands): XLA's dot in f32, as jax's rule
        return lax.dot_general(x, y, ((rows, rows), ((), ())), preferred_element_type=mixed[0],
                               out_sharding=_sharding_of(like)).astype(mixed[1])
    problem = _dispatch.problem_of((r, p), (r, q), x.dtype, x.dtype, True, False)
    if foldable and _dispatch.choose(problem)[0] == "kernel":
        return _product(x.reshape(r, p), y.reshape(r, q), transpose_a=True, like=like)
    return lax.dot_general(x, y, ((rows, rows), ((), ())), out_sharding=_sharding_of(like))


def _transpose_rhs(ct, a, b, *, transpose_a, transpose_b, out_dtype, kernel, stages):
    del out_dtype, kernel, stages
    ct = _cotangent_for(ct, a.dtype)
    if a.ndim > _aval(b).ndim:  # A [..., M, K] (not transposed): contract its leading dims and M
        return _contracting_leading_dims(ct, a, like=b) if transpose_b else _contracting_leading_dims(a, ct, like=b)
    if transpose_b:
        return _product(ct, a, transpose_a=True, transpose_b=transpose_a, like=b)
    return _product(a, ct, transpose_a=not transpose_a, transpose_b=False, like=b)


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
    explicit = any(is_explicit(_sharding_of(v)) for v in (x, w, b) if v is not None)
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


def _dense_jvp(primals, tangents, *, activation, has_bias, has_residual):
    x, w, bias, residual = primals
    dx, dw, dbias, dresidual = tangents
    optional_bias = bias if has_bias else None
    if activation is not None and not has_residual:
        save, kernel = saved_derivative_choice(x, w, optional_bias, activation)
        if save:
            y, derivative = activation_and_derivative(x, w, optional_bias, activation, kernel)
            return y, derivative * _z_tangent(x, w, dx, dw, dbias, has_bias)
    if not _kernel_chosen(x, w, False, False):
        # The table sends the plain product to XLA (the fused kernel was picked for its
        # activation, a saving the derivative cannot use): differentiate jnp's own
        # computation, so a training step runs exactly what the user's jnp would.
        # Differentiated only in the operands with nonzero tangents (instantiating a zero
        # tangent would add a product of zeros).
        moving = [i for i, t in enumerate(tangents) if not isinstance(t, ad.Zero)]

        def like_jnp(*moved):
            args = list(primals)
            for i, v in zip(moving, moved):
                args[i] = v
            x, w, bias, residual = args
            return dense_like_jnp(x, w, bias if has_bias else None, residual if has_residual else None,
                                  activation=activation)

        if not moving:
            y = like_jnp()
            return y, jnp.zeros_like(y)
        return jax.jvp(like_jnp, [primals[i] for i in moving], [tangents[i] for i in moving])
    f32 = jnp.float32
    dz = _z_tangent(x, w, dx, dw, dbias, has_bias)
    if activation is None:
        y = fused_dense(x, w, optional_bias, residual if has_residual else None)
        dy = dz
    else:
        z = fused_dense(x, w, optional_bias, None)
        y, dy = jax.jvp(ACTIVATION_FNS[activation], (z.astype(f32),), (dz.astype(f32),))
        if has_residual:
            y = y + residual.astype(f32)
        y, dy = y.astype(x.dtype), dy.astype(x.dtype)
    if has_residual and not isinstance(dresidual, ad.Zero):
        dy = dy + dresidual
    return y, dy


ad.primitive_jvps[dense_p] = _dense_jvp


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
