"""Probe: what an f32 cotangent of f16 products costs, and what rounding it would save.

An LM head with f32 logits (h [T, D] f16, W [D, V] f16, preferred_element_type=f32)
gets an f32 cotangent; jax's rule (and ours since fed83cc) multiplies it against the f16
operand in f32 (a mixed dot_general). The variants below write the same gradients by
hand, in plain jnp (no jax_hopper), to see what XLA runs for each and at what speed:
  jnp            jax.grad of the loss (jax's rule)
  f32 mixed      by hand, the same mixed f32 x f16 products (checks the hand-written grad)
  f16 rounded    the cotangent rounded to f16 (fast, but overflows / underflows)
  f16 scaled     rounded after one power-of-two scale (max |ct| in [2^14, 2^15)), undone
                 on the f32 products: jax_hopper's rule since this probe
  f16 per slice  the same with one scale per row of ct (for dh) and per column (for dW)
    python scripts/probe_f32_cotangent.py 16384x4096x128256 8192x4096x50304
"""

import sys

import jax
import jax.numpy as jnp
from jax import lax

from jax_hopper import bench

F16 = jnp.float16
F32 = jnp.float32
F16_SCALED_EXP = 15  # max |scaled cotangent| < 2^15 < 65504


def pow2(e):
    """2.0^e, exactly, for integer e in f32's normal range."""
    return lax.bitcast_convert_type((e + 127).astype(jnp.int32) << 23, F32)


def scaled(ct, axis=None):
    """(ct * 2^s rounded to f16, 2^-s) with s per slice along `axis` reduced (None: one)."""
    amax = jnp.max(jnp.abs(ct), axis=axis, keepdims=True)
    _, e = jnp.frexp(amax)
    s = jnp.clip(F16_SCALED_EXP - e, -100, 100)
    return (ct * pow2(s)).astype(F16), pow2(-s)


def make(mode, tokens, vocab):
    def loss(h, p):
        logits = jnp.dot(h, p[0], preferred_element_type=F32)
        picked = jnp.take_along_axis(logits, p[1][:, None], axis=-1)[:, 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)

    if mode == "jnp":
        return lambda h, p: jax.grad(lambda h, w: loss(h, (w, p[1])), argnums=(0, 1))(h, p[0])

    def manual(h, p):
        w, labels = p
        logits = jnp.dot(h, w, preferred_element_type=F32)
        ct = (jax.nn.softmax(logits, axis=-1) - jax.nn.one_hot(labels, vocab, dtype=F32)) / tokens
        if mode == "f32 mixed":
            dh = jnp.dot(ct, w.T, preferred_element_type=F32).astype(F16)
            dw = jnp.dot(h.T, ct, preferred_element_type=F32).astype(F16)
        elif mode == "f16 rounded":
            c = ct.astype(F16)
            dh = jnp.dot(c, w.T, preferred_element_type=F32).astype(F16)
            dw = jnp.dot(h.T, c, preferred_element_type=F32).astype(F16)
        elif mode == "f16 scaled":
            c, undo = scaled(ct)
            dh = (jnp.dot(c, w.T, preferred_element_type=F32) * undo).astype(F16)
            dw = (jnp.dot(h.T, c, preferred_element_type=F32) * undo).astype(F16)
        else:
            c_rows, undo_rows = scaled(ct, 1)
            c_cols, undo_cols = scaled(ct, 0)
            dh = (jnp.dot(c_rows, w.T, preferred_element_type=F32) * undo_rows).astype(F16)
            dw = (jnp.dot(h.T, c_cols, preferred_element_type=F32) * undo_cols).astype(F16)
        return dh, dw

    return manual


def main(argv):
    bench.BREAKDOWN = True
    bench.KERNEL_SAMPLES = 9
    bench.SUSTAINED_ROUNDS = 2
    rows = []
    for text in argv or ["16384x4096x128256"]:
        tokens, d_model, vocab = (int(x) for x in text.split("x"))
        keys = jax.random.split(jax.random.key(3), 3)
        h = jax.random.normal(keys[0], (tokens, d_model), F32).astype(F16)
        params = ((jax.random.normal(keys[1], (d_model, vocab), F32) / d_model**0.5).astype(F16),
                  jax.random.randint(keys[2], (tokens,), 0, vocab))
        fns = {m: make(m, tokens, vocab) for m in ("jnp", "f32 mixed", "f16 rounded", "f16 scaled", "f16 per slice")}
        meta = {"batch": 0, "m": tokens, "n": vocab, "k": d_model, "layout": "lm head train by hand", "dtype": "f16"}
        rows += bench._time_variants(fns, h, params, 6.0 * tokens * d_model * vocab, meta, lambda: None)
        bench.print_table(rows)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
