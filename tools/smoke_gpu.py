"""Seconds-long GPU smoke test run before the full suite: each kernel kind on a few
shapes against jnp.dot. A hang or a wrong answer here stops the device run early."""

import sys

import jax
import jax.numpy as jnp

from jax_hopper.primitives.gemm import gemm

ok = True
for kernel in ("persistent", "v5"):
    for m, n, k in [(256, 512, 128), (129, 257, 72), (1000, 3000, 520), (384, 256, 4096)]:
        ka, kb = jax.random.split(jax.random.key(m + n + k))
        a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.float16)
        b = jax.random.normal(kb, (k, n), jnp.float32).astype(jnp.float16)
        ref = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32), precision="highest")
        out = jax.jit(lambda x, y: gemm(x, y, kernel=kernel))(a, b).astype(jnp.float32)
        err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
        good = err < 1e-3 and not bool(jnp.isnan(out).any())
        ok &= good
        print(f"smoke {kernel:>10} {m}x{n}x{k}: rel err {err:.2e} {'ok' if good else 'WRONG'}", flush=True)
sys.exit(0 if ok else 1)
