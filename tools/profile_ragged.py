"""Launches of our grouped kernel (ragged_dot, its d lhs and d rhs products) and of our dense
kernel on the same FLOPs, for Nsight Compute: the benchmark's shapes (tools/bench_ragged.py
CASES), each function compiled and run once first, then LAUNCHES launches inside the
profiler window (cuProfilerStart / cuProfilerStop). Run ncu with --profile-from-start off:

    NCU_SCRIPT=tools/profile_ragged.py bash tools/ncu_gemm.sh clock --cases jax_example --products fwd,dlhs

The report then holds, per case, the dense kernel's launches (balanced cases only) and the
grouped kernel's, in that order."""

import argparse
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # see profile_gemm.py

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_ragged as br  # noqa: E402
from profile_gemm import LAUNCHES, _cuda_profiler  # noqa: E402

import jax_hopper  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="jax_example", help="comma-separated names from bench_ragged.CASES")
    p.add_argument("--products", default="fwd,dlhs,drhs")
    p.add_argument("--dtype", default="bf16", choices=["f16", "bf16"])
    args = p.parse_args()
    dtype = {"f16": jnp.float16, "bf16": jnp.bfloat16}[args.dtype]
    cases = {c.name: c for c in br.CASES}
    unknown = [c for c in args.cases.split(",") if c not in cases]
    if unknown:
        p.error(f"unknown case(s) {unknown}; known: {sorted(cases)}")
    start, stop = _cuda_profiler()
    for name in args.cases.split(","):
        case = cases[name]
        lhs, rhs, ct = br.operands(case, dtype)
        sizes = br.group_sizes(case)
        fns = []
        if case.skew == "balanced":
            fns.append(("dense", jax.jit(br.ours(lambda a, b, c: jax_hopper.matmul(a, b[0])))))
        for product in args.products.split(","):
            fn = dict(br.variants_for(product, sizes))["jax_hopper"]
            fns.append((product, jax.jit(fn)))
        for _, fn in fns:  # compile and first launch: outside the window
            jax.block_until_ready(fn(lhs, rhs, ct))
        start()
        for label, fn in fns:
            for _ in range(LAUNCHES):
                out = fn(lhs, rhs, ct)
            jax.block_until_ready(out)
        stop()
        print(f"{name}: profiled {', '.join(label for label, _ in fns)} ({LAUNCHES} launches each)", flush=True)


if __name__ == "__main__":
    main()
