"""A whole MLP block, y = act(x w1 + b1) w2 + b2 + residual, whose backward pass fuses the
activation's derivative into the epilogue of the product that needs it.

In a block built from two `dense` calls, the hidden layer's cotangent is computed in two
passes: the second layer's transpose product dh = dy w2^T, then act'(z1) * dh (jnp's
block does the same: XLA does not fuse a derivative into cuBLASLt's epilogue). Only
code that sees both layers can put act'(z1) into that product's epilogue, so the block
is one custom_vjp:

  forward     z1 = x w1 + b1           (dense: bias fused; saved, in the operands' type)
              h  = act(z1)             (XLA, 16-bit, as jnp's block; saved)
              y  = h w2 + b2 + r       (dense: bias and residual fused)
  backward    dz1 = (dy w2^T) * act'(z1)    one launch of the backward form, reading
              db1 = dz1's row sums          w2 as stored, db1 summed in its epilogue
                                            (_fused.dense_grad_p); or the product, then
                                            act' and db1 by XLA (see below)
              dw2 = h^T dy, dw1 = x^T dz1, dx = dz1 w1^T   (products, dispatched)
              db2: row sums of dy (f32 sums, one XLA pass), dr = dy

Every product goes through the dispatcher as in `dense`. The backward form runs where
the dispatcher measured it ahead (_dispatch.choose_activation_grad: with a bias
gradient to sum, large layers, model width <= 8192) and under policy "kernel";
elsewhere dh is a product like any other and XLA applies act' and sums db1 in one
elementwise pass.
Without differentiation the block is the two fused `dense` calls (the activation then
fused into the first one's epilogue, on the f32 sum).

The saved-derivative form (exact GELU, tanh-GELU and SiLU by default, where the
dispatcher runs the derivative kind; _dispatch.saves_derivative):

  forward     h, d = act(z1), act'(z1)      one launch of the derivative kind, both from
                                            the f32 z1 (_fused.dense_derivative_p); saved
              y = h w2 + b2 + r
  backward    dz1 = (dy w2^T) * d           the backward form with no activation (a
                                            multiply epilogue, db1 summed too), or a
                                            product and XLA's multiply

The backward pass no longer recomputes act' (for exact GELU an erf per element): the
training step measured 1.04-1.05x jnp's block at 8192x4096x16384, 1.06x with the
backward form summing db1; tanh-GELU and SiLU 1.02-1.03x (BENCHMARKS.md).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jax_hopper import _dispatch
from jax_hopper._autodiff import (
    _contracting_leading_dims,
    _explicitly_typed,
    _product,
    activation_and_derivative,
    saved_derivative_choice,
)
from jax_hopper._fallback import ACTIVATION_FNS, row_sum
from jax_hopper._fused import fused_activation_grad
from jax_hopper._primitive import PRODUCT_NAME, _varying_axes


def _dense(x, w, b, activation=None, residual=None):
    from jax_hopper.ops import dense

    return dense(x, w, b, activation=activation, residual=residual)


def _hidden_cotangent(dy, w2, kept, activation, derivative, bias_grad):
    """(dz1, db1): dz1 = (dy w2^T) * act'(z1), `kept` being z1 or (`derivative`)
    act'(z1), and with bias_grad db1, its row sum (else None). The backward form, whose
    epilogue sums db1 too, where the dispatcher picks it; else the product (dispatched
    like any other) and, on its 16-bit result, the activation's VJP (jnp's own two
    passes) or a multiply by the saved derivative, then the row sum (XLA folds it into
    that elementwise pass)."""
    if activation is not None:
        rows = math.prod(dy.shape[:-1])
        problem = _dispatch.problem_of((rows, dy.shape[-1]), w2.shape, dy.dtype, dy.dtype, False, True)
        explicit = any(_explicitly_typed(v) for v in (dy, w2, kept))
        if not explicit and _dispatch.choose_activation_grad(problem, activation, bias_grad=bias_grad)[0] == "kernel":
            # Inside shard_map, db1 by XLA: the primitive types db without manual axes (_fused).
            fuse_db = bias_grad and not _varying_axes(dy)
            out = fused_activation_grad(dy, w2, kept, activation=None if derivative else activation,
                                        bias_grad=fuse_db)
            dz1, db1 = out if fuse_db else (out, None)
            return dz1, row_sum(dz1, dy.dtype) if bias_grad and db1 is None else db1
    dh = _product(dy, w2, transpose_b=True, like=kept)
    dz1 = dh * kept if derivative else jax.vjp(ACTIVATION_FNS[activation], kept)[1](dh)[0]
    return dz1, row_sum(dz1, dy.dtype) if bias_grad else None


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def mlp_block(x, w1, b1, w2, b2, residual, activation):
    """The block for validated operands of one 16-bit type (ops.mlp); b1, b2 and residual
    may be None."""
    h = _dense(x, w1, b1, activation)
    return _dense(h, w2, b2, residual=residual)


def _forward(x, w1, b1, w2, b2, residual, activation):
    # The saved-derivative form keeps act'(z1) instead of z1: the backward pass then
    # multiplies instead of recomputing act' (_dispatch.saves_derivative).
    derivative, kernel = saved_derivative_choice(x, w1, b1, activation)
    if derivative:
        h, kept = activation_and_derivative(x, w1, b1, activation, kernel)
    else:
        kept = _dense(x, w1, b1)
        h = ACTIVATION_FNS[activation](kept)
    # Named, so a remat policy can keep what the backward pass needs (ops.PRODUCT_NAME).
    h, kept = checkpoint_name(h, PRODUCT_NAME), checkpoint_name(kept, PRODUCT_NAME)
    y = _dense(h, w2, b2, residual=residual)
    # Which optional operands there were, as empty arrays (residuals must be arrays);
    # inside shard_map, empty slices of them, which keep the manual axes the operand
    # varies over (its cotangent must match them). The last marks the saved-derivative form.
    def marker(v):
        if v is None:
            return None
        return jnp.ravel(v)[:0] if _varying_axes(v) else jnp.zeros((0,), v.dtype)

    present = (marker(b1), marker(b2), marker(residual), jnp.zeros((0,), x.dtype) if derivative else None)
    return y, (x, w1, w2, kept, h, present)


def _like_primal(ct, primal):
    """Inside shard_map, a cotangent summed over the manual axes it varies over and its
    primal does not (a weight replicated over the axes x is split on): what jax's own
    autodiff does where it made the weight varying (the transpose of that cast is a psum).
    A custom VJP must return its cotangents with its primals' types."""
    if ct is None:
        return None
    extra = _varying_axes(ct) - _varying_axes(primal)
    return jax.lax.psum(ct, tuple(sorted(extra))) if extra else ct


def _backward(activation, saved, dy):
    x, w1, w2, kept, h, (has_b1, has_b2, has_residual, derivative) = saved
    dy = dy.astype(x.dtype)
    dw2 = _contracting_leading_dims(h, dy, like=w2)
    # With act'(z1) saved, the backward form multiplies (its activation None).
    dz1, db1 = _hidden_cotangent(dy, w2, kept, activation, derivative is not None, has_b1 is not None)
    dw1 = _contracting_leading_dims(x, dz1, like=w1)
    dx = _product(dz1, w1, transpose_b=True, like=x)
    db2 = None if has_b2 is None else row_sum(dy, x.dtype)
    cts = (dx, dw1, db1, dw2, db2, None if has_residual is None else dy)
    return tuple(_like_primal(ct, p) for ct, p in zip(cts, (x, w1, has_b1, w2, has_b2, has_residual)))


mlp_block.defvjp(_forward, _backward)
