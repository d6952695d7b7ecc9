"""One steady-state launch each of our plain product, the fused kernel (act only) and
the derivative kind (act and act') of one layer, for Nsight Compute
(scripts/ncu_fused.sh runs it), e.g.

    ncu --profile-from-start off --section WarpStateStats --section SourceCounters \
        -o /tmp/fused python3 scripts/profile_fused.py gelu_exact 8192x8192x32768

Shape (TOKENSxDMODELxDFF, default the MLP benchmark's 8192x4096x16384): the first
layer, x [tokens, d_model] @ w [d_model, d_ff], f16. The plain product is the
reference for what the epilogues cost: at d_model 4096 the derivative kind costs
0.15 ms over it, at 8192 nothing measurable (BENCHMARKS.md, 2026-12-02 01:54)."""

import ctypes
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_hopper  # noqa: E402
from jax_hopper._fused import fused_dense_with_derivative  # noqa: E402

activation = sys.argv[1] if len(sys.argv) > 1 else "gelu_exact"
shape = sys.argv[2] if len(sys.argv) > 2 else "8192x4096x16384"
tokens, d_model, d_ff = (int(v) for v in shape.lower().split("x"))
keys = jax.random.split(jax.random.key(0), 3)
x = jax.random.normal(keys[0], (tokens, d_model), jnp.float32).astype(jnp.float16)
w = (jax.random.normal(keys[1], (d_model, d_ff), jnp.float32) / d_model**0.5).astype(jnp.float16)
b = (0.1 * jax.random.normal(keys[2], (d_ff,), jnp.float32)).astype(jnp.float16)
with jax_hopper.dispatch("kernel"):
    plain = jax.jit(lambda x, w: jax_hopper.matmul(x, w))
    act_only = jax.jit(lambda x, w, b: jax_hopper.dense(x, w, b, activation=activation))
    both = jax.jit(lambda x, w, b: fused_dense_with_derivative(x, w, b, activation=activation))
    jax.block_until_ready((plain(x, w), act_only(x, w, b), both(x, w, b)))
lib = ctypes.CDLL("libcuda.so.1")
assert lib.cuProfilerStart() == 0
jax.block_until_ready(plain(x, w))
jax.block_until_ready(act_only(x, w, b))
jax.block_until_ready(both(x, w, b))
assert lib.cuProfilerStop() == 0
print("done", activation, shape)
