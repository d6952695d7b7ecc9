"""One steady-state launch of each of a layer's kernels, for Nsight Compute
(tools/ncu_fused.sh runs it), e.g.

    ncu --profile-from-start off --section WarpStateStats --section SourceCounters \\
        -o /tmp/fused python3 tools/profile_fused.py gelu_exact 8192x8192x32768 plain,both

Arguments: activation, shape TOKENSxDMODELxDFF (default the MLP benchmark's
8192x4096x16384), forms (comma-separated, default plain,act,both):
  plain     our plain product x [tokens, d_model] @ w1 [d_model, d_ff] (the first layer)
  act       the fused kernel, act(x w1 + b) (kind 5)
  both      the derivative kind, act and act' (kind 11)
  plain_nt  our plain product g [tokens, d_model] @ w2 [d_ff, d_model]^T, read in place
            (the shape and layout of the backward form's product, dh = dy W2^T)
  mul       the backward form multiplying by a saved act' (kind 10, no activation)
  mul_db    the same, with the bias gradient summed in its epilogue (the default step's)
  grad      the backward form computing act'(z1) from z1 (kind 10 with the activation)
f16. The plain products are the reference for what each epilogue costs: at d_model 4096
the derivative kind costs 0.12-0.15 ms over the plain product and the backward form
about 0.1 ms (the session log, BENCHMARKS.md in git history)."""

import ctypes
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_hopper  # noqa: E402
from jax_hopper.primitives.dense_derivative import fused_dense_with_derivative  # noqa: E402
from jax_hopper.primitives.dense_grad import fused_activation_grad  # noqa: E402

activation = sys.argv[1] if len(sys.argv) > 1 else "gelu_exact"
shape = sys.argv[2] if len(sys.argv) > 2 else "8192x4096x16384"
forms = (sys.argv[3] if len(sys.argv) > 3 else "plain,act,both").split(",")
tokens, d_model, d_ff = (int(v) for v in shape.lower().split("x"))
keys = jax.random.split(jax.random.key(0), 5)
f16 = jnp.float16
x = jax.random.normal(keys[0], (tokens, d_model), jnp.float32).astype(f16)
w1 = (jax.random.normal(keys[1], (d_model, d_ff), jnp.float32) / d_model**0.5).astype(f16)
b = (0.1 * jax.random.normal(keys[2], (d_ff,), jnp.float32)).astype(f16)
w2 = (jax.random.normal(keys[3], (d_ff, d_model), jnp.float32) / d_model**0.5).astype(f16)
z1 = jax.random.normal(keys[4], (tokens, d_ff), jnp.float32).astype(f16)  # stands in for z1 or act'(z1)
contract_last = (((1,), (1,)), ((), ()))
kernels = {
    "plain": (lambda: jax_hopper.matmul(x, w1)),
    "act": (lambda: jax_hopper.dense(x, w1, b, activation=activation)),
    "both": (lambda: fused_dense_with_derivative(x, w1, b, activation=activation)),
    "plain_nt": (lambda: jax_hopper.dot_general(x, w2, contract_last)),
    "mul": (lambda: fused_activation_grad(x, w2, z1, activation=None)),
    "mul_db": (lambda: fused_activation_grad(x, w2, z1, activation=None, bias_grad=True)),
    "grad": (lambda: fused_activation_grad(x, w2, z1, activation=activation)),
}
unknown = set(forms) - set(kernels)
if unknown:
    raise SystemExit(f"unknown forms {sorted(unknown)}; choose from {sorted(kernels)}")
# Every call under the policy: it is in jax's jit key, so a call outside would trace (and
# compile, inside the profiler's window) again under the default policy.
with jax_hopper.dispatch("kernel"):
    jitted = [jax.jit(kernels[f]) for f in forms]
    jax.block_until_ready([f() for f in jitted])
    lib = ctypes.CDLL("libcuda.so.1")
    assert lib.cuProfilerStart() == 0
    for f in jitted:
        jax.block_until_ready(f())
    assert lib.cuProfilerStop() == 0
print("done", activation, shape, ",".join(forms))
