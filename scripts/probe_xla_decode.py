"""What XLA runs for a decode-shaped jnp.dot, and how long each of its kernels takes with
the weights cold in L2 (the benchmark's `--l2 cold` protocol, kernel by kernel).

Prints, per shape, the fusions of the compiled program with their backend configs (the
Triton GEMM's block sizes, split K, stages and warps) and the median CUPTI time of every
kernel of one call. Needs only jax (not the library). Not part of the library:

    python3 scripts/probe_xla_decode.py 16x8192x8192 16x4096x4096
"""

import os
import re
import statistics
import sys

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import profiler

SCRUB_BYTES = 120 << 20  # 2x the H200's L2
SAMPLES = 7

_scrub = jax.jit(lambda buf: jax.lax.reduce(buf, jnp.uint32(0), jax.lax.bitwise_xor, (0,)))


class Cold:
    """The product dispatched after a read of SCRUB_BYTES, as bench.AfterL2Scrub does."""

    def __init__(self, fn, buf):
        self.fn, self.buf = fn, buf

    def __call__(self, *args):
        _scrub(self.buf)
        return self.fn(*args)

    def trace(self, *args, **kwargs):
        return self.fn.trace(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self.fn.lower(*args, **kwargs)


def main(argv):
    buf = jnp.zeros(SCRUB_BYTES // 4, jnp.uint32)
    _, scrub_timings = profiler.measure(_scrub, aggregate=False)(buf)
    n_scrub = len(scrub_timings)
    key = jax.random.PRNGKey(0)
    for text in argv:
        m, n, k = (int(x) for x in text.split("x"))
        ka, kb = jax.random.split(jax.random.fold_in(key, m * n * k))
        a = jax.random.normal(ka, (m, k), jnp.float16)
        b = (jax.random.normal(kb, (k, n), jnp.float32) / k**0.5).astype(jnp.float16)
        dot = jax.jit(jnp.dot)
        hlo = dot.lower(a, b).compile().as_text()
        print(f"== {text}")
        if os.environ.get("HLO_DIR"):  # HLO_DIR=dir: the whole optimized program too
            with open(os.path.join(os.environ["HLO_DIR"], f"hlo_{text}.txt"), "w") as f:
                f.write(hlo)
        for line in hlo.splitlines():
            if "fusion" in line and ("backend_config" in line or "calls=" in line) and "ROOT" not in line[:8]:
                line = re.sub(r"metadata=\{[^}]*\}", "", line.strip())
                print("  " + line[:900])
        measure = profiler.measure(Cold(dot, buf), aggregate=False)
        per_kernel = {}
        for _ in range(SAMPLES):
            _, timings = measure(a, b)
            for i, (name, t) in enumerate(timings[n_scrub:]):
                per_kernel.setdefault((i, name), []).append(t * 1e3)
        total = 0.0
        for (i, name), ts in sorted(per_kernel.items()):
            med = statistics.median(ts)
            total += med
            print(f"  kernel {i} {name[:60]:60s} {med:7.2f} us (min {min(ts):.2f})")
        print(f"  sum of medians {total:.2f} us")


if __name__ == "__main__":
    main(sys.argv[1:])
