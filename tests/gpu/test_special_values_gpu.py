"""NaN and ±Inf through the fused epilogues (Hopper only; skipped with a reason elsewhere):
jax_hopper.mlp under policy "kernel", forward and backward, puts NaN, +Inf and -Inf
exactly where jnp's block does, for every activation, with z1 saved or act'(z1) saved.

Each case plants special values where they reach one part of the epilogues: an operand
row, the pre-activation (through the bias: act(±Inf), act(NaN) and their derivatives),
the output bias, and an Inf in w2 that the backward form's product meets in the rows
past M of its last tile (where A is zero-filled: 0 * Inf), with a cotangent and act'
of one sign, so jnp's bias gradient is a clean Inf there. Finite values stay small, so
no finite sum overflows in jnp's 16-bit block or in our f32 epilogue.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ACTIVATIONS
from layer_cases import block_operands, ours, plain_block

import jax_hopper
from jax_hopper import _dispatch

F16 = jnp.float16
M, D, F = 200, 264, 520  # M: the last 64-row block of each tile reaches past M
NAN, INF = float("nan"), float("inf")


def _x_row_specials(x, w1, b1, w2, b2, ct):
    return (x.at[3, 5].set(NAN).at[7, 0].set(INF).at[11, 1].set(-INF), w1, b1, w2, b2, ct)


def _pre_activation_specials(x, w1, b1, w2, b2, ct):
    return (x, w1, b1.at[30].set(INF).at[31].set(-INF).at[32].set(NAN), w2, b2, ct)


def _output_bias_specials(x, w1, b1, w2, b2, ct):
    return (x, w1, b1, w2, b2.at[3].set(NAN).at[4].set(INF).at[5].set(-INF), ct)


def _w2_inf_past_m(x, w1, b1, w2, b2, ct):
    # z1[:, 9] within 1% of 1: act' > 0 for every activation, and every term of jnp's
    # 16-bit derivative is finite and nonzero there; ct[:, 7] > 0: dh[:, 9] = +Inf in every
    # row, so jnp's db1[9] is +Inf (0 * Inf past M must stay out of the sum).
    return (x, w1.at[:, 9].set(1e-3), b1.at[9].set(1.0), w2.at[9, 7].set(INF), b2,
            ct.at[:, 7].set(jnp.abs(ct[:, 7]) + 0.25))


CASES = {"x rows": _x_row_specials, "z1 columns": _pre_activation_specials, "b2": _output_bias_specials,
         "w2 Inf, rows past M": _w2_inf_past_m}


def _masks(v):
    v = np.asarray(jnp.asarray(v).astype(jnp.float32))
    return {"NaN": np.isnan(v), "+Inf": np.isposinf(v), "-Inf": np.isneginf(v)}


def _values_and_grads(block, operands, ct):
    y, vjp = jax.vjp(block, *operands)
    return (y, *vjp(ct))


# Each activation with z1 saved, and each but None (nothing to save) with act'(z1) saved.
FORMS = [(a, False) for a in ACTIVATIONS] + [(a, True) for a in ACTIVATIONS if a is not None]


@pytest.mark.parametrize("activation,saved", FORMS, ids=[f"{a}-{'saved' if s else 'z1'}" for a, s in FORMS])
@pytest.mark.parametrize("case", list(CASES))
def test_special_values_land_where_jnp_puts_them(hopper, case, activation, saved):
    x, w1, b1, w2, b2 = block_operands((M,), D, F, F16, seed=len(case))
    ct = jax.random.normal(jax.random.key(7), (M, D), jnp.float32).astype(F16)
    *operands, ct = CASES[case](x, w1, b1, w2, b2, ct)
    with jax_hopper.dispatch("kernel"), _dispatch.saved_derivative({activation} if saved else ()):
        mine = jax.jit(lambda *o: _values_and_grads(ours(activation), o, ct))(*operands)
        hlo = jax.jit(lambda *o: _values_and_grads(ours(activation), o, ct)).lower(*operands).compile().as_text()
    assert 'custom_call_target="jax_hopper_gemm_fused' in hlo
    if activation is not None:  # the backward form (and the derivative kind where saved) ran
        assert 'custom_call_target="jax_hopper_gemm_fused_grad"' in hlo
        assert ('custom_call_target="jax_hopper_gemm_fused_derivative"' in hlo) == saved
    theirs = jax.jit(lambda *o: _values_and_grads(plain_block(activation), o, ct))(*operands)
    special = 0
    for name, a, b in zip(("y", "dx", "dw1", "db1", "dw2", "db2"), mine, theirs):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        ma, mb = _masks(a), _masks(b)
        for what in ma:
            where = np.argwhere(ma[what] != mb[what])
            assert where.size == 0, (f"{name}: {what} differs from jnp's block at {len(where)} elements, e.g. "
                                     f"{where[:5].tolist()}")
            special += int(mb[what].sum())
    assert special > 0, "the case put no special value into jnp's results"
