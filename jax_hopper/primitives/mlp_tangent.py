"""mlp_tangent_p: the MLP block's tangent map, whose transpose is the fused backward pass.

jax_hopper.mlp (layers.py) is a custom_jvp whose tangent map dy = T(dx, dw1, db1, dw2,
db2, dr) is this one primitive, linear in those tangents, with the forward's values (x,
w1, w2, kept, h) as constants. jax.jvp evaluates it (`_tangent`); reverse mode transposes
it (`_transpose`):

  dz1 = (dy w2^T) * act'(z1)    one launch of dense_grad_p reading w2 as stored, db1
  db1 = dz1's row sums          summed in its epilogue, where decide() picks it; else
                                the product, then act' and db1 by XLA
  dw2 = h^T dy, dw1 = x^T dz1, dx = dz1 w1^T   (products, decided)
  db2 = row sums of dy, dr = dy

`kept` is z1, or act'(z1) where the forward saved the derivative (then a multiply).
Only the cotangents reverse mode asks for are computed (a frozen bias: no db1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_hopper import _compat, _dispatch
from jax_hopper import _partitioning as part
from jax_hopper._problem import layer_problem
from jax_hopper._reference import ACTIVATION_FNS, row_sum
from jax_hopper.primitives import gemm
from jax_hopper.primitives.dense import z_tangent
from jax_hopper.primitives.dense_grad import fused_activation_grad

mlp_tangent_p = Primitive("jax_hopper_mlp_tangent")
TANGENT_NAMES = ("x", "w1", "b1", "w2", "b2", "residual")


def _tangent(x, w1, w2, kept, h, *tangents, activation, derivative, moving, out_aval):
    """The tangent map evaluated forward: dz1 = dx w1 + x dw1 + db1, dh = act'(z1) dz1,
    dy = dh w2 + h dw2 + db2 + dr, each product decided, in the operands' 16-bit type."""
    t = dict(zip(moving, tangents))
    dy = None
    if {"x", "w1", "b1"} & t.keys():
        absent = ad.Zero(jax.typeof(x))
        dz1 = z_tangent(x, w1, t.get("x", absent), t.get("w1", absent), t.get("b1", absent), "b1" in t)
        dh = dz1 * kept if derivative else jax.jvp(ACTIVATION_FNS[activation], (kept,), (dz1,))[1]
        dy = gemm.product(dh, w2)
    for name, term in (("w2", lambda d: gemm.product(h, d)), ("b2", lambda d: d), ("residual", lambda d: d)):
        if name in t:
            dy = term(t[name]) if dy is None else dy + term(t[name])
    return jnp.broadcast_to(dy, out_aval.shape)  # a bias's tangent alone spans every row


def _hidden_cotangent(dy, w2, kept, activation, derivative, bias_grad):
    """(dz1, db1 or None): the backward form where decide() picks it, else the product and,
    on its 16-bit result, the activation's VJP (jnp's two passes) or a multiply by the
    saved derivative, then the row sum."""
    if activation is not None:
        problem = layer_problem(dy.shape, w2.shape, dy.dtype, transpose_w=True, op="activation_grad",
                                activation=activation, bias_grad=bias_grad)
        explicit = any(part.explicitly_typed(v) for v in (dy, w2, kept))
        if not explicit and _dispatch.decide(problem).path == "kernel":
            fuse_db = bias_grad and not _compat.varying_axes(dy)  # inside shard_map, db1 by XLA
            out = fused_activation_grad(dy, w2, kept, activation=None if derivative else activation,
                                        bias_grad=fuse_db)
            dz1, db1 = out if fuse_db else (out, None)
            return dz1, row_sum(dz1, dy.dtype) if bias_grad and db1 is None else db1
    dh = gemm.product(dy, w2, transpose_b=True, like=kept)
    dz1 = dh * kept if derivative else jax.vjp(ACTIVATION_FNS[activation], kept)[1](dh)[0]
    return dz1, row_sum(dz1, dy.dtype) if bias_grad else None


def _like_primal(ct, primal):
    """A cotangent in its primal's type: inside shard_map summed over the manual axes it
    varies over and its primal does not (what jax's autodiff does for a weight it made
    varying); under explicit axes resharded to the primal's sharding."""
    extra = _compat.varying_axes(ct) - _compat.varying_axes(primal)
    return part.in_type_of(jax.lax.psum(ct, tuple(sorted(extra))) if extra else ct, primal)


def _transpose(ct, x, w1, w2, kept, h, *tangents, activation, derivative, moving, out_aval):
    del out_aval
    none = [None] * (5 + len(tangents))
    if isinstance(ct, ad.Zero):
        return none
    wanted = {name for name, t in zip(moving, tangents) if ad.is_undefined_primal(t)}
    dy = ct.astype(x.dtype)
    cts = {}
    if "w2" in wanted:
        cts["w2"] = gemm.contracting_leading_dims(h, dy, like=w2)
    if {"x", "w1", "b1"} & wanted:
        dz1, cts["b1"] = _hidden_cotangent(dy, w2, kept, activation, derivative, "b1" in wanted)
        if "w1" in wanted:
            cts["w1"] = gemm.contracting_leading_dims(x, dz1, like=w1)
        if "x" in wanted:
            cts["x"] = gemm.product(dz1, w1, transpose_b=True, like=x)
    if "b2" in wanted:
        cts["b2"] = row_sum(dy, x.dtype)
    if "residual" in wanted:
        cts["residual"] = dy
    return none[:5] + [_like_primal(cts[name], t) if name in wanted else None for name, t in zip(moving, tangents)]


def _jvp(primals, tangents, **params):
    """The tangent map's own derivative (jvp of jvp, grad of jvp): its forward evaluation's."""
    tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
    return jax.jvp(functools.partial(_tangent, **params), tuple(primals), tangents)


def _batch(args, dims, **params):
    return jax.vmap(functools.partial(_tangent, **params), in_axes=dims)(*args), 0


mlp_tangent_p.def_impl(_compat.eager_impl(mlp_tangent_p))
mlp_tangent_p.def_abstract_eval(lambda *args, out_aval, **params: out_aval)
mlir.register_lowering(mlp_tangent_p, mlir.lower_fun(_tangent, multiple_results=False))
ad.primitive_jvps[mlp_tangent_p] = _jvp
ad.primitive_transposes[mlp_tangent_p] = _transpose
batching.primitive_batchers[mlp_tangent_p] = _batch
_compat.require_devices_at_lowering(mlp_tangent_p)  # its products lower to custom_partitioning calls


def bind(x, w1, w2, kept, h, moving, *, activation, derivative, out_aval):
    """dy for the moving (name, tangent) pairs."""
    return mlp_tangent_p.bind(x, w1, w2, kept, h, *(t for _, t in moving), activation=activation,
                              derivative=derivative, moving=tuple(name for name, _ in moving), out_aval=out_aval)

