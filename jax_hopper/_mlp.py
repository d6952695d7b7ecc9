"""A whole MLP block, y = act(x w1 + b1) w2 + b2 + residual, whose backward pass fuses the
activation's derivative into the epilogue of the product that needs it.

In a block built from two `dense` calls, the hidden layer's cotangent is computed in two
passes: the second layer's transpose product dh = dy w2^T, then act'(z1) * dh (jnp's
block does the same: XLA does not fuse a derivative into cuBLASLt's epilogue). Only
code that sees both layers can put act'(z1) into that product's epilogue, so the block
is one custom_jvp whose tangent map is one linear primitive (block_tangent_p), the
backward pass below being that primitive's transpose rule:

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
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_hopper import _dispatch
from jax_hopper._autodiff import (
    _contracting_leading_dims,
    _explicitly_typed,
    _in_type_of,
    _product,
    _z_tangent,
    activation_and_derivative,
    saved_derivative_choice,
)
from jax_hopper._fallback import ACTIVATION_FNS, row_sum
from jax_hopper._fused import fused_activation_grad
from jax_hopper._primitive import PRODUCT_NAME, _varying_axes, eager_impl, require_devices_at_lowering


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


@functools.partial(jax.custom_jvp, nondiff_argnums=(6,))
def mlp_block(x, w1, b1, w2, b2, residual, activation):
    """The block for validated operands of one 16-bit type (ops.mlp); b1, b2 and residual
    may be None."""
    h = _dense(x, w1, b1, activation)
    return _dense(h, w2, b2, residual=residual)


def _forward(x, w1, b1, w2, b2, residual, activation):
    """(y, kept, h, derivative): the block's value and what its tangent map needs, z1 or
    (`derivative`) act'(z1) as `kept`, and h = act(z1)."""
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
    return _dense(h, w2, b2, residual=residual), kept, h, derivative


# The block's tangent map, dy = T(dx, dw1, db1, dw2, db2, dr), is one primitive, linear in
# those tangents, with the forward's values (x, w1, w2, kept, h) as constants. jax.jvp
# evaluates it (_tangent: the tangent products, dispatched like any product, and act' in
# XLA's pass); reverse mode (jax.grad, jax.vjp) transposes it, and its transpose rule is
# the module docstring's fused backward pass. jax's own custom_vjp works the same way (a
# linear primitive whose transpose is the bwd) except that its primitive cannot be
# evaluated forward, so a custom_vjp block refused jax.jvp, jacfwd and Hessian-vector
# products. The lowered reverse-mode programs are those of the custom_vjp form the block
# had before (compared for 396 configurations), except that an operand not being
# differentiated gets no cotangent computed: a fixed b1 has no db1 summed, and the
# dispatcher then judges the backward form without one.
block_tangent_p = Primitive("jax_hopper_mlp_tangent")
TANGENT_NAMES = ("x", "w1", "b1", "w2", "b2", "residual")


def _block_jvp(activation, primals, tangents):
    y, kept, h, derivative = _forward(*primals, activation)
    x, w1, _, w2, _, _ = primals
    # The tangents that are not (symbolic) zeros, and not of an absent operand.
    moving = tuple((name, t) for name, p, t in zip(TANGENT_NAMES, primals, tangents)
                   if p is not None and not isinstance(t, SymbolicZero))
    if not moving:
        return y, jnp.zeros_like(y)
    dy = block_tangent_p.bind(x, w1, w2, kept, h, *(t for _, t in moving), activation=activation,
                              derivative=derivative, moving=tuple(name for name, _ in moving),
                              out_aval=jax.typeof(y))
    return y, dy


mlp_block.defjvp(_block_jvp, symbolic_zeros=True)


def _tangent(x, w1, w2, kept, h, *tangents, activation, derivative, moving, out_aval):
    """The tangent map evaluated forward (jax.jvp): dz1 = dx w1 + x dw1 + db1, dh =
    act'(z1) dz1, dy = dh w2 + h dw2 + db2 + dr, each product dispatched, in the operands'
    16-bit type as jnp's block computes its tangents."""
    t = dict(zip(moving, tangents))
    dy = None
    if {"x", "w1", "b1"} & t.keys():
        absent = ad.Zero(jax.typeof(x))
        dz1 = _z_tangent(x, w1, t.get("x", absent), t.get("w1", absent), t.get("b1", absent), "b1" in t)
        dh = dz1 * kept if derivative else jax.jvp(ACTIVATION_FNS[activation], (kept,), (dz1,))[1]
        dy = _product(dh, w2)
    for name, term in (("w2", lambda d: _product(h, d)), ("b2", lambda d: d), ("residual", lambda d: d)):
        if name in t:
            dy = term(t[name]) if dy is None else dy + term(t[name])
    # A bias's tangent alone spans every row. (The result's type, sharding included, is the
    # primitive's out_aval, y's.)
    return jnp.broadcast_to(dy, out_aval.shape)


def _tangent_transpose(ct, x, w1, w2, kept, h, *tangents, activation, derivative, moving, out_aval):
    """The backward pass: cotangents of the moving tangents from dy's (the module
    docstring's), only those reverse mode asks for (a frozen bias: no db1)."""
    del out_aval
    none = [None] * (5 + len(tangents))
    if isinstance(ct, ad.Zero):
        return none
    wanted = {name for name, t in zip(moving, tangents) if ad.is_undefined_primal(t)}
    dy = ct.astype(x.dtype)
    cts = {}
    if "w2" in wanted:
        cts["w2"] = _contracting_leading_dims(h, dy, like=w2)
    if {"x", "w1", "b1"} & wanted:
        # With act'(z1) saved, the backward form multiplies (its activation None).
        dz1, cts["b1"] = _hidden_cotangent(dy, w2, kept, activation, derivative, "b1" in wanted)
        if "w1" in wanted:
            cts["w1"] = _contracting_leading_dims(x, dz1, like=w1)
        if "x" in wanted:
            cts["x"] = _product(dz1, w1, transpose_b=True, like=x)
    if "b2" in wanted:
        cts["b2"] = row_sum(dy, x.dtype)
    if "residual" in wanted:
        cts["residual"] = dy
    return none[:5] + [_like_primal(cts[name], t) if name in wanted else None for name, t in zip(moving, tangents)]


def _like_primal(ct, primal):
    """A cotangent in its primal's type (here its tangent's, which is the primal's), as
    jax requires. Inside shard_map, summed over the manual axes it varies over and its
    primal does not (a weight replicated over the axes x is split on): what jax's own
    autodiff does where it made the weight varying (the transpose of that cast is a psum).
    Under explicit mesh axes, resharded to the primal's sharding (a replicated residual
    next to a sharded x: its cotangent dy has y's sharding; b2's sum keeps y's columns')."""
    extra = _varying_axes(ct) - _varying_axes(primal)
    return _in_type_of(jax.lax.psum(ct, tuple(sorted(extra))) if extra else ct, primal)


def _tangent_jvp(primals, tangents, **params):
    """The tangent map's own derivative (jvp of jvp, grad of jvp): that of its forward
    evaluation."""
    tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
    return jax.jvp(functools.partial(_tangent, **params), tuple(primals), tangents)


def _tangent_batch(args, dims, **params):
    return jax.vmap(functools.partial(_tangent, **params), in_axes=dims)(*args), 0


block_tangent_p.def_impl(eager_impl(block_tangent_p))
block_tangent_p.def_abstract_eval(lambda *args, out_aval, **params: out_aval)
mlir.register_lowering(block_tangent_p, mlir.lower_fun(_tangent, multiple_results=False))
ad.primitive_jvps[block_tangent_p] = _tangent_jvp
ad.primitive_transposes[block_tangent_p] = _tangent_transpose
batching.primitive_batchers[block_tangent_p] = _tangent_batch
# Its products lower to custom_partitioning calls that need the device assignment.
require_devices_at_lowering(block_tangent_p)
