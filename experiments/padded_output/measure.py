"""Experiment: an output whose rows TMA cannot store (N not a multiple of 8).

Today such a product (8191^3, an LM head with an odd vocabulary) pads B's rows, and the
kernel writes C [M, N] from registers (no TMA store, no deferred store). The alternative:
write C [M, N8] (N8 = N rounded up to 8; B's zero padding makes the extra columns 0)
through the TMA-store epilogue, then slice. Kernel time (CUPTI, every kernel of the
call: pads, product, slice), median of interleaved samples.
"""
import statistics
import sys

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import profiler

import jax_hopper
from jax_hopper._primitive import gemm

SHAPES = [(8191, 8191, 8191), (4095, 4095, 4095), (2047, 2047, 2047), (8192, 50257, 4096), (4096, 8191, 4096)]
SAMPLES = 9
if len(sys.argv) > 1:  # shapes MxNxK,... (f16 only), with a per-kernel breakdown
    SHAPES = [tuple(int(x) for x in t.split("x")) for t in sys.argv[1].split(",")]
BREAKDOWN = len(sys.argv) > 1


def padded_out(a, b):
    n = b.shape[1]
    n8 = -(-n // 8) * 8
    return gemm(a, jnp.pad(b, ((0, 0), (0, n8 - n))))[:, :n]


def current(a, b):
    with jax_hopper.dispatch("kernel"):
        return jax_hopper.matmul(a, b)


def main():
    for dtype in (jnp.float16, jnp.bfloat16):
        for m, n, k in SHAPES:
            if dtype == jnp.bfloat16 and (BREAKDOWN or (m, n, k) != (8191, 8191, 8191)):
                continue
            ka, kb = jax.random.split(jax.random.key(0))
            a = (jax.random.normal(ka, (m, k), jnp.float32) / k**0.25).astype(dtype)
            b = (jax.random.normal(kb, (k, n), jnp.float32) / k**0.25).astype(dtype)
            fns = {"jnp": jax.jit(jnp.dot), "current": jax.jit(current), "padded_out": jax.jit(padded_out)}
            ref = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32), precision="highest")
            errs = {}
            for name, f in fns.items():
                out = f(a, b)
                assert out.shape == (m, n), (name, out.shape)
                errs[name] = float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
            meas = {name: profiler.measure(f) for name, f in fns.items()}
            times = {name: [] for name in fns}
            for name in fns:
                meas[name](a, b)
            for _ in range(SAMPLES):
                for name in fns:
                    times[name].append(meas[name](a, b)[1])
            med = {name: statistics.median(t) for name, t in times.items()}
            flops = 2.0 * m * n * k
            for name in fns:
                print(f"{m}x{n}x{k} {jnp.dtype(dtype).name:8s} {name:10s} {med[name]:8.4f} ms "
                      f"{flops / med[name] / 1e9:6.0f} TF/s  vs jnp {med['jnp'] / med[name]:5.3f}  "
                      f"rel err {errs[name]:.2e}", flush=True)
            if BREAKDOWN:
                for name, f in fns.items():
                    per = profiler.measure(f, aggregate=False)
                    per(a, b)
                    runs = [per(a, b)[1] for _ in range(5)]
                    print(f"  {name}:", "; ".join(f"{kn[:40]} {statistics.median(r[i][1] for r in runs):.4f}"
                                                    for i, (kn, _) in enumerate(runs[0])), flush=True)
            del a, b, ref


if __name__ == "__main__":
    sys.exit(main())
