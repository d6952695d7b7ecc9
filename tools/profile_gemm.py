"""Launches of our kernel and jnp.dot (cuBLASLt) on the same operands, for Nsight Compute.

Every function is compiled and run once first (XLA's autotuning launches many candidate
kernels then); only the launches after that sit inside the profiler window
(cuProfilerStart / cuProfilerStop), so run ncu with --profile-from-start off, e.g.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \
        --section LaunchStats python3 tools/profile_gemm.py --kernel persistent 8192x8192x8192

and the report holds exactly the kernels that run in steady state: cuBLASLt's pick (its
name gives tile, stages and cluster) and ours. Options: --kernel KIND[,KIND...] (default
"persistent"; "small_m" for decode shapes), --ours-only, --dtype f16|bf16.
--sustain SECONDS (no ncu) instead runs each function back to back for that long while
nvidia-smi samples power and SM clock: whether ours and cuBLASLt's kernel run at the same
clock under the power cap. Inputs: the seed's data (standard normal / K^(1/4)), made on the host."""

import argparse
import ctypes
import os
import statistics
import subprocess
import time

# ncu saves and restores all device memory between the replay passes of a kernel; with
# jax's default preallocation (75% of the GPU) a multi-pass metric set took minutes.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_hopper.primitives.gemm import gemm  # noqa: E402

LAUNCHES = 2  # per function inside the window: the second shows a warm L2/TLB


def _cuda_profiler():
    lib = ctypes.CDLL("libcuda.so.1")  # the driver API: present wherever a GPU is

    def call(name):
        rc = getattr(lib, name)()
        if rc != 0:
            raise RuntimeError(f"{name} returned CUDA error {rc}")

    return lambda: call("cuProfilerStart"), lambda: call("cuProfilerStop")


SMI_PERIOD_MS = 50


def _sustained(fn, a, b, seconds, flops):
    """Back-to-back launches for `seconds`; median power (W) and SM clock (MHz) meanwhile."""
    smi = subprocess.Popen(
        [
            "nvidia-smi",
            "-i",
            "0",
            "--query-gpu=power.draw,clocks.sm",
            "--format=csv,noheader,nounits",
            f"-lms={SMI_PERIOD_MS}",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            out = fn(a, b)
        calls += 10
        out.block_until_ready()
    elapsed = time.perf_counter() - t0
    smi.terminate()
    rows = [line.split(",") for line in smi.communicate()[0].splitlines() if "," in line]
    rows = rows[len(rows) // 4 :]  # the first quarter: clocks still settling
    power = statistics.median(float(r[0]) for r in rows)
    clock = statistics.median(float(r[1]) for r in rows)
    return calls * flops / elapsed / 1e12, power, clock


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shapes", nargs="*", default=["8192x8192x8192"], help="MxNxK")
    p.add_argument("--kernel", default="persistent")
    p.add_argument("--dtype", default="f16", choices=["f16", "bf16"])
    p.add_argument("--ours-only", action="store_true")
    p.add_argument("--sustain", type=float, default=0.0, metavar="SECONDS")
    args = p.parse_args()
    dtype = {"f16": np.float16, "bf16": jnp.bfloat16}[args.dtype]
    start, stop = _cuda_profiler()
    for spec in args.shapes:
        m, n, k = (int(v) for v in spec.split("x"))
        rng = np.random.default_rng(0)
        scale = k**-0.25
        a = jnp.asarray((rng.standard_normal((m, k), np.float32) * scale).astype(dtype))
        b = jnp.asarray((rng.standard_normal((k, n), np.float32) * scale).astype(dtype))
        names = args.kernel.split(",")
        fns = [jax.jit(lambda x, y, kind=kind: gemm(x, y, kernel=kind)) for kind in names]
        if not args.ours_only:
            names.append("jnp.dot")
            fns.append(jax.jit(jnp.dot))
        for fn in fns:  # compile, autotune, first launch: outside the window
            fn(a, b).block_until_ready()
        if args.sustain:
            for name, fn in zip(names, fns):
                tflops, power, clock = _sustained(fn, a, b, args.sustain, 2 * m * n * k)
                print(
                    f"{spec} {args.dtype} {name:16s} sustained {tflops:6.1f} TF/s  "
                    f"power {power:5.0f} W  SM clock {clock:5.0f} MHz",
                    flush=True,
                )
            continue
        start()
        for fn in fns:
            for _ in range(LAUNCHES):
                out = fn(a, b)
            out.block_until_ready()
        stop()
        if not args.ours_only:
            ref = fns[-1](a, b).astype(jnp.float32)
            for name, fn in zip(names[:-1], fns[:-1]):
                err = float(jnp.linalg.norm(fn(a, b).astype(jnp.float32) - ref))
                print(f"{spec} {args.dtype}: |{name} - jnp.dot|_F = {err:.3e}", flush=True)


if __name__ == "__main__":
    main()
