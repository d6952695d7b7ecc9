"""Fused layers: `dense` (act(x @ w + bias) + residual in one launch) and `mlp` (a
two-layer block whose backward pass fuses act' into the product that needs it).

Both validate and broadcast their operands as jnp would, promote them to jnp's result
type, and compute with our primitives where every operand is of one 16-bit type and the
dispatcher picks our kernel; anything else is jnp's own computation, so the result is
what the user's jnp would give (docs/numerics.md says where the rounding differs).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero

from jax_hopper import _kernels
from jax_hopper._problem import numeric
from jax_hopper._reference import ACTIVATION_FNS, dense_like_jnp
from jax_hopper.ops import check, converts_exactly, describe, is_array, matmul, plain_precision
from jax_hopper.primitives import dense as dense_primitive
from jax_hopper.primitives import gemm, mlp_tangent

KERNEL_DTYPES = gemm.KERNEL_DTYPES


# ---- validation shared by dense and mlp ----------------------------------------------------
def _check_operands(op, operands, activation) -> str:
    """Arrays (or None) and a known activation; a bias or residual may also be a scalar,
    as in jnp's x @ w + 0.5. Returns the operands described for later error messages."""
    for name, v in operands.items():
        scalar_ok = name not in ("x", "w", "w1", "w2") and isinstance(v, (int, float, complex, np.generic))
        if v is not None and not (is_array(v) or scalar_ok):
            raise TypeError(f"jax_hopper.{op}: {name} must be a jax or numpy array, got {type(v).__name__}")
    if not (activation is None or isinstance(activation, str)) or activation not in _kernels.ACTIVATION_IDS:
        raise ValueError(f"jax_hopper.{op}: activation must be None or one of "
                         f"{sorted(a for a in _kernels.ACTIVATION_IDS if a)}, got {activation!r}")
    return ", ".join(f"{n} {describe(v)}" for n, v in operands.items() if v is not None)


def _broadcast_epilogue(op, rows_shape, n, bias, residual, names, described, width="N"):
    """jnp's broadcasting of ``act(rows @ w + bias) + residual`` (the product is
    rows_shape + (n,)). Returns (bias, jnp_only, result shape): a bias [1, N] or [1, 1, N]
    reshaped to [N] (the epilogue's); jnp_only where only jnp's computation has jnp's
    result (it broadcasts to a larger result, a bias varies along rows or is a scalar, a
    residual is not of the result's shape). Shapes jnp would refuse raise a ValueError."""
    product = tuple(rows_shape) + (n,)
    full = product
    for name, v, want in ((names[0], bias, f"[{width}] = [{n}]"), (names[1], residual, str(list(product)))):
        if v is None:
            continue
        try:
            full = tuple(jnp.broadcast_shapes(full, np.shape(v)))
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
    """(type, weak) of a layer: jnp's promotion of all its operands, floating or complex."""
    dtype, weak = jax.dtypes.result_type(*(v for v in operands.values() if v is not None),
                                         return_weak_type_flag=True)
    if not jnp.issubdtype(dtype, jnp.inexact):
        raise TypeError(f"jax_hopper.{op}: floating-point or complex operands only; got {described}")
    return dtype, weak


def _multiplied_as_floats(x, w) -> bool:
    """Whether jnp multiplies x and w in a floating type (an integer pair is multiplied as
    integers, wrapping, and only then promoted by a floating bias)."""
    return bool(jnp.issubdtype(jnp.result_type(x, w), jnp.floating))


def _ours(dtype, weak, *factors) -> bool:
    """Whether a layer of this type may run on our primitives: one 16-bit type that holds
    the factors exactly, multiplied as floats, at a plain default precision. Elsewhere jnp
    multiplies in its own way (a weak result, an f32 bias rounding x @ w first, ...)."""
    return (not weak and jnp.dtype(dtype) in KERNEL_DTYPES and converts_exactly(dtype, *factors) and
            _multiplied_as_floats(*factors[:2]) and plain_precision(None))


# ---- dense -----------------------------------------------------------------------------------
def dense(x, w, bias=None, *, activation=None, residual=None):
    """A dense layer, ``act(x @ w + bias) + residual``, with the bias add, the activation
    and the residual add fused into our kernel's epilogue.

    x [..., K], w [K, N], bias [N] or None, residual [..., N] or None; activation None,
    "relu", "gelu_tanh" (jax.nn.gelu's default), "gelu_exact" or "silu". A bias or
    residual of another shape broadcasts as in jnp: a bias [1, N] is the fused [N];
    anything else is jnp's layer. On the kernel path: f32 products and sums, bias,
    activation and residual in f32, one rounding to the result type (jnp's promotion of
    all operands). Eligible when all operands share one 16-bit type; the dispatcher then
    picks the fused kernel or jnp's computation (the same answers as the user's jnp, at
    its speed). Differentiable (each product of the derivative is decided like a plain
    product) and vmappable. With no bias, activation or residual it is ``matmul(x, w)``.
    """
    operands = {"x": x, "w": w, "bias": bias, "residual": residual}
    described = _check_operands("dense", operands, activation)
    if np.ndim(x) < 1 or np.ndim(w) != 2 or np.shape(x)[-1] != np.shape(w)[0]:
        raise ValueError(f"jax_hopper.dense: needs x [..., K] and w [K, N]; got {described}")
    n = np.shape(w)[1]
    bias, jnp_only, _ = _broadcast_epilogue("dense", np.shape(x)[:-1], n, bias, residual, ("bias", "residual"),
                                            described)
    dtype, weak = _layer_type("dense", operands, described)
    if jnp_only or not _ours(dtype, weak, x, w):
        return dense_like_jnp(x, w, bias, residual, activation=activation)
    x, w = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
    check("dense", jnp.matmul, x, w)  # jax's own checks of x @ w (a K sharded on explicit mesh axes)
    if bias is None and residual is None and activation is None:
        return matmul(x, w)  # nothing to fuse: our plain product, transposable as such
    bias = None if bias is None else jnp.asarray(bias, dtype)
    residual = None if residual is None else jnp.asarray(residual, dtype)
    return dense_primitive.layer(x, w, bias, residual, activation)


# ---- mlp ---------------------------------------------------------------------------------------
def mlp(x, w1, b1, w2, b2, *, activation="gelu_tanh", residual=None):
    """A transformer MLP block, ``act(x @ w1 + b1) @ w2 + b2 + residual``, whose backward
    pass fuses the activation's derivative into the epilogue of the product that produces
    the hidden layer's cotangent (dh = dy w2^T; cuBLASLt's DGELU epilogue, which jnp's
    block does not get).

    x [..., D], w1 [D, F], b1 [F] or None, w2 [F, N], b2 [N] or None, residual [..., N]
    or None (other shapes broadcast as in `dense`); activation as in `dense`.
    Undifferentiated it is ``dense(dense(x, w1, b1, activation=...), w2, b2,
    residual=residual)``. In reverse mode the forward saves z1 = x w1 + b1 and act(z1)
    in the operands' type, as jnp's block does, or, where the derivative kind runs (exact
    GELU, tanh-GELU, SiLU: rules "fused-activation" and "saved-derivative"), act'(z1)
    written by the same launch as act(z1); the backward form runs where the dispatcher
    picks it (rule "backward-form-with-bias-gradient"; policy "kernel"), on one device.
    Forward mode (jax.jvp, Hessian-vector products) computes the tangent with decided
    products and act' by XLA. Operands of one 16-bit type use this path; anything else
    is computed as jnp would.
    """
    operands = {"x": x, "w1": w1, "b1": b1, "w2": w2, "b2": b2, "residual": residual}
    described = _check_operands("mlp", operands, activation)
    if (np.ndim(x) < 1 or np.ndim(w1) != 2 or np.ndim(w2) != 2 or np.shape(x)[-1] != np.shape(w1)[0] or
            np.shape(w1)[1] != np.shape(w2)[0]):
        raise ValueError(f"jax_hopper.mlp: needs x [..., D], w1 [D, F] and w2 [F, N]; got {described}")
    f, n = np.shape(w2)
    out_shape = tuple(np.shape(x)[:-1]) + (n,)
    b1, hidden_jnp_only, hidden = _broadcast_epilogue("mlp", np.shape(x)[:-1], f, b1, None, ("b1", None), described,
                                                      width="F")
    b2, jnp_only, _ = _broadcast_epilogue("mlp", hidden[:-1], n, b2, residual, ("b2", "residual"), described)
    dtype, weak = _layer_type("mlp", operands, described)
    if (hidden_jnp_only or jnp_only or not _ours(dtype, weak, x, w1, w2) or
            not numeric(*np.shape(x), *np.shape(w1), *np.shape(w2)) or
            0 in np.shape(x) + np.shape(w2) + (np.shape(w1)[0],)):
        h = dense_like_jnp(x, w1, b1, None, activation=activation)
        return dense_like_jnp(h, w2, b2, residual, activation=None)
    x, w1, w2 = (jnp.asarray(v, dtype) for v in (x, w1, w2))
    b1, b2, residual = (None if v is None else jnp.asarray(v, dtype) for v in (b1, b2, residual))
    if x.ndim == 1:  # one row: the block's products take x [..., M, D]
        rows = lambda v: None if v is None else v.reshape(1, -1)  # noqa: E731
        return mlp_block(rows(x), w1, b1, w2, b2, rows(residual), activation).reshape(out_shape)
    return mlp_block(x, w1, b1, w2, b2, residual, activation)


def _dense(x, w, b, activation=None, residual=None):
    """The block's layers: operands of one 16-bit type, checked by jax as x @ w (under
    explicit mesh axes the hidden layer's sharding can make jnp refuse the second)."""
    check("dense", jnp.matmul, x, w)
    if b is None and residual is None and activation is None:
        return gemm.matmul_rows(x, w)
    return dense_primitive.layer(x, w, b, residual, activation)


@functools.partial(jax.custom_jvp, nondiff_argnums=(6,))
def mlp_block(x, w1, b1, w2, b2, residual, activation):
    """The block for validated operands of one 16-bit type; b1, b2, residual may be None."""
    h = _dense(x, w1, b1, activation)
    return _dense(h, w2, b2, residual=residual)


def _forward(x, w1, b1, w2, b2, residual, activation):
    """(y, kept, h, derivative): the value and what the tangent map needs, z1 or
    (`derivative`) act'(z1) as `kept`, and h = act(z1)."""
    derivative, kernel = dense_primitive.saved_derivative_choice(x, w1, b1, activation)
    if derivative:
        h, kept = dense_primitive.activation_and_derivative(x, w1, b1, activation, kernel)
    else:
        kept = _dense(x, w1, b1)
        h = ACTIVATION_FNS[activation](kept)
    # Named, so a remat policy can keep what the backward pass needs.
    h, kept = checkpoint_name(h, gemm.PRODUCT_NAME), checkpoint_name(kept, gemm.PRODUCT_NAME)
    return _dense(h, w2, b2, residual=residual), kept, h, derivative


def _block_jvp(activation, primals, tangents):
    y, kept, h, derivative = _forward(*primals, activation)
    x, w1, _, w2, _, _ = primals
    moving = tuple((name, t) for name, p, t in zip(mlp_tangent.TANGENT_NAMES, primals, tangents)
                   if p is not None and not isinstance(t, SymbolicZero))
    if not moving:
        return y, jnp.zeros_like(y)
    return y, mlp_tangent.bind(x, w1, w2, kept, h, moving, activation=activation, derivative=derivative,
                               out_aval=jax.typeof(y))


mlp_block.defjvp(_block_jvp, symbolic_zeros=True)
