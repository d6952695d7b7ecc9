"""A few launches of the decode-shaped products for Nsight Compute: our small_m kind and
jnp.dot (cuBLASLt) on the same operands, one shape at a time. Inputs come from the host
so that no other kernel runs; run under ncu, e.g.

    XLA_FLAGS=--xla_gpu_autotune_level=0 ncu --clock-control none --section SpeedOfLight \
        --section MemoryWorkloadAnalysis python3 scripts/profile_decode.py 16x8192x8192

Each shape runs ours then jnp.dot, LAUNCHES times each (the first of each compiles);
--ours-only leaves jnp.dot out (XLA's autotuning launches many candidate kernels)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_hopper._primitive import gemm

LAUNCHES = 2

ours_only = "--ours-only" in sys.argv
for spec in [a for a in sys.argv[1:] if not a.startswith("--")] or ["16x8192x8192"]:
    m, n, k = (int(v) for v in spec.split("x"))
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((m, k), np.float32).astype(np.float16))
    b = jnp.asarray(rng.standard_normal((k, n), np.float32).astype(np.float16))
    ours = jax.jit(lambda x, y: gemm(x, y, kernel="small_m"))
    ref = jax.jit(jnp.dot)
    for fn in (ours,) if ours_only else (ours, ref):
        for _ in range(LAUNCHES):
            out = fn(a, b)
        out.block_until_ready()
    if not ours_only:
        err = float(jnp.linalg.norm(ours(a, b).astype(jnp.float32) - ref(a, b).astype(jnp.float32)))
        print(f"{spec}: |ours - jnp.dot| = {err:.3e}", flush=True)
