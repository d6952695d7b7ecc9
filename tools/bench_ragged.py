#!/usr/bin/env python3
"""Grouped products (ragged_dot) side by side in one process: jax_hopper's grouped kernel
against jax.lax.ragged_dot (XLA's lowering), its Pallas Triton lowering, and the Pallas
Mosaic-GPU Hopper kernel (ragged_dot_mgpu, the best of a few block configurations), for
the forward product and its two gradient products (d lhs: the cotangent against rhs
read transposed; d rhs: the ragged contraction, against jax's ragged_dot_general and,
for the Mosaic kernel, transposed_ragged_dot). Kernel time (CUPTI, median) and
sustained time (back-to-back dispatches, mean over rounds), per tools/bench_protocol.py;
the dense kernel on the same FLOPs gives the balanced cases' throughput reference.

    python3 tools/bench_ragged.py --json out.json [--cases mixtral_up,olmoe] [--products fwd,dlhs,drhs]
    python3 tools/bench_ragged.py --moe 8192x4096x14336x8x2 --json moe.json   # the MoE layer's training step
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import statistics
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_protocol as bp  # noqa: E402

import jax_hopper  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    m: int  # routed rows
    k: int
    n: int
    groups: int
    skew: str = "balanced"


CASES = (
    Case("mixtral_up", 16384, 4096, 14336, 8),
    Case("mixtral_down", 16384, 14336, 4096, 8),
    Case("deepseek_up", 65536, 7168, 2048, 256),
    Case("deepseek_down", 65536, 2048, 7168, 256),
    Case("deepseek_up_skewed", 65536, 7168, 2048, 256, "skewed"),
    Case("deepseek_down_skewed", 65536, 2048, 7168, 256, "skewed"),
    Case("olmoe", 16384, 2048, 1024, 64),
    Case("jax_example", 16384, 2048, 16384, 16),
)


def group_sizes(case: Case):
    """Balanced: M split evenly. Skewed: routing by a Zipf-like popularity (group g drawn
    with weight 1 / (g + 1)), the same draw every run."""
    if case.skew == "balanced":
        sizes = np.full(case.groups, case.m // case.groups)
        sizes[: case.m % case.groups] += 1
    else:
        rng = np.random.default_rng(0)
        weights = 1.0 / np.arange(1, case.groups + 1)
        sizes = rng.multinomial(case.m, weights / weights.sum())
    return jnp.asarray(sizes, jnp.int32)


def operands(case: Case, dtype):
    kl, kr, kc = jax.random.split(jax.random.key(0), 3)
    lhs = (jax.random.normal(kl, (case.m, case.k), jnp.float32) / case.k**0.25).astype(dtype)
    rhs = (jax.random.normal(kr, (case.groups, case.k, case.n), jnp.float32) / case.k**0.25).astype(dtype)
    ct = jax.random.normal(kc, (case.m, case.n), jnp.float32).astype(dtype)
    return lhs, rhs, ct


def ours(fn):
    def call(*args):
        with jax_hopper.dispatch("kernel"):
            return fn(*args)
    return call


# ragged_dot_mgpu's block configurations, the best of each product kept: of (128, 128, 4, 1),
# (128, 128, 4, 4), (64, 128, 5, 2) and (128, 192, 4, 1) (block_m, block_n, steps, grid_block_n),
# the second or the fourth was the fastest on every shape and product here (H100).
MGPU_CONFIGS = [dict(block_m=bm, block_n=bn, block_k=64, max_concurrent_steps=s, grid_block_n=gb)
                for bm, bn, s, gb in ((128, 128, 4, 4), (128, 192, 4, 1))]
# transposed_ragged_dot_mgpu (the weight gradient): its block_m and block_n must divide K and N.
MGPU_TRANSPOSED_CONFIGS = [dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=gb)
                           for gb in (1, 4)]


def variants_for(product: str, sizes):
    """[(name, fn(lhs, rhs, ct))] for one product."""
    rows = lambda lhs, rhs, ct: jax.lax.ragged_dot(lhs, rhs, sizes)  # noqa: E731
    # d lhs = ct [M, N] against rhs [G, K, N] contracting N: rhs read as [G, N', K'].
    dims_t = jax.lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), [0], [0])
    dlhs = lambda lhs, rhs, ct: jax.lax.ragged_dot_general(ct, rhs, sizes, dims_t)  # noqa: E731
    dims_c = jax.lax.RaggedDotDimensionNumbers((([0], [0]), ([], [])), [0], [])
    drhs = lambda lhs, rhs, ct: jax.lax.ragged_dot_general(lhs, ct, sizes, dims_c)  # noqa: E731
    ours_rows = lambda lhs, rhs, ct: jax_hopper.ragged_dot(lhs, rhs, sizes)  # noqa: E731
    ours_dlhs = lambda lhs, rhs, ct: jax_hopper.ragged_dot_general(ct, rhs, sizes, dims_t)  # noqa: E731
    ours_drhs = lambda lhs, rhs, ct: jax_hopper.ragged_dot_general(lhs, ct, sizes, dims_c)  # noqa: E731
    jax_fn, our_fn = {"fwd": (rows, ours_rows), "dlhs": (dlhs, ours_dlhs), "drhs": (drhs, ours_drhs)}[product]
    # The Triton lowering is a lowering-time option (and part of jit's key): time_variant sets it.
    # Released jax wheels (0.10 to 0.11.2) lack the module it imports (jax-ml/jax#40888): the
    # record then holds its ModuleNotFoundError.
    # XLA's own lowering last: it may be slow enough to use up a bounded run.
    out, last = [("jax_hopper", ours(our_fn))], [("pallas_triton", jax_fn), ("jax.lax", jax_fn)]
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
    except ImportError:
        return out + last
    for i, cfg in enumerate(MGPU_CONFIGS if product != "drhs" else MGPU_TRANSPOSED_CONFIGS):
        if product == "fwd":
            f = functools.partial(ragged_dot_mgpu.ragged_dot, group_sizes=sizes, **cfg)
            out.append((f"mgpu[{i}]", lambda lhs, rhs, ct, f=f: f(lhs, rhs)))
        elif product == "dlhs":
            f = functools.partial(ragged_dot_mgpu.ragged_dot, group_sizes=sizes, transpose_rhs=True, **cfg)
            out.append((f"mgpu[{i}]", lambda lhs, rhs, ct, f=f: f(ct, rhs)))
        else:
            f = functools.partial(transposed_ragged_dot_mgpu.transposed_ragged_dot, group_sizes=sizes, **cfg)
            out.append((f"mgpu_transposed[{i}]", lambda lhs, rhs, ct, f=f: f(lhs, ct)))
    return out + last


TRITON_OPTION = "jax_ragged_dot_use_gpu_pallas_triton_lowering"
SUSTAINED_ROUNDS = 2  # each variant's, one after the other, no settle round


def _protocol(samples):
    return dataclasses.replace(bp.Protocol(), kernel_samples=samples, sustained_seconds=0.2,
                               sustained_rounds=SUSTAINED_ROUNDS, sustained_settle_rounds=0)


def time_variant(name, fn, args, protocol):
    triton = name == "pallas_triton"
    try:
        if triton:
            jax.config.update(TRITON_OPTION, True)
        v = bp.JaxVariant(name, fn)
        v.kernel_ms(*args)  # compile
        kernel = statistics.median(v.kernel_ms(*args) for _ in range(protocol.kernel_samples))
        sustained = statistics.mean(bp.sustained_ms(v, [args], kernel, protocol) for _ in range(SUSTAINED_ROUNDS))
        return {"kernel_ms": kernel, "sustained_ms": sustained}
    except Exception as e:  # a variant that cannot take the shape (block sizes, shared memory)
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    finally:
        if triton:
            jax.config.update(TRITON_OPTION, False)


def gpu_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout.strip()
    except FileNotFoundError:
        return str(jax.devices()[0])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(c.name for c in CASES))
    ap.add_argument("--products", default="fwd,dlhs,drhs")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--samples", type=int, default=7)
    ap.add_argument("--no-alternatives", action="store_true", help="only ours and jax.lax")
    ap.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    ap.add_argument("--moe", default="", help="TOKENSxDxHxE[xTOPK]: the flax MoE layer's training step instead, "
                    "on jax_hopper.ragged_dot (policy kernel) against the same layer on jax.lax.ragged_dot")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.moe:
        return moe_step(args)
    protocol = _protocol(args.samples)
    dtype = jnp.dtype(args.dtype)
    chosen = [c for c in CASES if c.name in args.cases.split(",")]
    results, records = [], []
    gpu = gpu_name()
    for case in chosen:
        lhs, rhs, ct = operands(case, dtype)
        sizes = group_sizes(case)
        flops = 2.0 * case.m * case.k * case.n
        dense = None
        if case.skew == "balanced":  # the dense kernel on the same FLOPs
            w = rhs[0]
            dense = time_variant("dense", ours(lambda a, b, c: jax_hopper.matmul(a, b)), (lhs, w, ct), protocol)
        for product in args.products.split(","):
            row = {"case": case.name, "product": product, "m": case.m, "k": case.k, "n": case.n,
                   "groups": case.groups, "skew": case.skew, "dtype": dtype.name, "flops": flops, "variants": {}}
            for name, fn in variants_for(product, sizes):
                if args.no_alternatives and name not in ("jax_hopper", "jax.lax"):
                    continue
                row["variants"][name] = time_variant(name, fn, (lhs, rhs, ct), protocol)
            if dense is not None and product != "drhs":
                row["dense_same_flops"] = dense
            timed = {k: v for k, v in row["variants"].items() if "kernel_ms" in v}
            ours_t = timed.get("jax_hopper")
            others = {k: v for k, v in timed.items() if k != "jax_hopper"}
            if ours_t and others:
                best_name = min(others, key=lambda k: others[k]["kernel_ms"])
                row["best_alternative"] = best_name
                row["speedup_kernel"] = others[best_name]["kernel_ms"] / ours_t["kernel_ms"]
                best_s = min(others, key=lambda k: others[k]["sustained_ms"])
                row["speedup_sustained"] = others[best_s]["sustained_ms"] / ours_t["sustained_ms"]
            if ours_t:
                row["tflops"] = flops / ours_t["kernel_ms"] / 1e9
                if dense is not None and "kernel_ms" in dense and product != "drhs":
                    row["of_dense"] = dense["kernel_ms"] / ours_t["kernel_ms"]
            results.append(row)
            records.extend(_records_of(row))
            summary = " ".join(f"{k}={v.get('kernel_ms', float('nan')):.3f}" for k, v in row["variants"].items())
            print(f"{case.name:22s} {product:5s} {summary} speedup={row.get('speedup_kernel', float('nan')):.3f} "
                  f"of_dense={row.get('of_dense', float('nan')):.3f}", flush=True)
            dump(args.json, gpu, args.commit, protocol, results, records)  # a killed run keeps its rows
    geo = dump(args.json, gpu, args.commit, protocol, results, records)
    print(f"geometric mean speedup (kernel time) over the best alternative: {geo}")


def moe_step(args):
    """The MoE layer's training step (value and gradients of all parameters of
    mean(y^2)), the same layer and parameters on both grouped products."""
    from jax_hopper.nn import MoE

    protocol = _protocol(args.samples)
    rows = []
    for spec in args.moe.split(","):
        dims = [int(v) for v in spec.split("x")]
        tokens, d, h, e, top_k = dims + [2] * (5 - len(dims))
        x = jax.random.normal(jax.random.key(0), (tokens, d), jnp.float32).astype(args.dtype)
        layers = {"jax_hopper": MoE(e, h, top_k), "jax.lax": MoE(e, h, top_k, ragged_dot=jax.lax.ragged_dot)}
        params = layers["jax_hopper"].init(jax.random.key(1), x)
        row = {"case": f"moe {spec}", "tokens": tokens, "d": d, "h": h, "experts": e, "top_k": top_k,
               "variants": {}}
        for name, layer in layers.items():
            def step(p, x, layer=layer):
                return jax.value_and_grad(lambda q: jnp.square(layer.apply(q, x).astype(jnp.float32)).mean())(p)
            row["variants"][name] = time_variant(name, ours(step) if name == "jax_hopper" else step,
                                                 (params, x), protocol)
        t = row["variants"]
        if all("kernel_ms" in v for v in t.values()):
            row["speedup_kernel"] = t["jax.lax"]["kernel_ms"] / t["jax_hopper"]["kernel_ms"]
            row["speedup_sustained"] = t["jax.lax"]["sustained_ms"] / t["jax_hopper"]["sustained_ms"]
        rows.append(row)
        print(row, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu_name(), "commit": args.commit, "jax": jax.__version__,
                       "date": datetime.date.today().isoformat(), "protocol": dataclasses.asdict(protocol),
                       "moe": rows, "rows": [r for row in rows for r in _moe_records(row, args.dtype)]}, f, indent=1)


def _records_of(row):
    """The row as the benchmark's flat records (tools/perf_tables.py reads them): one per
    variant that ran, and "best_alternative" (the fastest of jax's, by each clock), with
    batch = the groups, layout = the product. The ratios (`*_ratio_vs_jnp`, the tables'
    comparison) are against the best alternative, the `*_ratio_vs_lax` ones against
    jax.lax.ragged_dot where it ran."""
    timed = {k: v for k, v in row["variants"].items() if "kernel_ms" in v}
    base = timed.get("jax.lax")
    others = {k: v for k, v in timed.items() if k != "jax_hopper"}
    best = None
    if others:
        best = {clock: min(v[clock] for v in others.values()) for clock in ("kernel_ms", "sustained_ms")}
        timed = dict(timed, best_alternative=best)
    out = []
    for name, t in timed.items():
        record = {"variant": name, "batch": row["groups"], "m": row["m"], "n": row["n"], "k": row["k"],
                  "layout": row["product"], "dtype": "bf16" if row["dtype"] == "bfloat16" else "f16",
                  "skew": row["skew"], **t}
        for clock, ms in (("kernel", "kernel_ms"), ("sustained", "sustained_ms")):
            if best:
                record[f"{clock}_ratio_vs_jnp"] = best[ms] / t[ms]
            if base:
                record[f"{clock}_ratio_vs_lax"] = base[ms] / t[ms]
        out.append(record)
    return out


def _moe_records(row, dtype):
    """The MoE step as flat records: batch = experts, m = tokens, n = the hidden width,
    k = the model width, layout "moe_step"; ratios against the layer on jax.lax.ragged_dot."""
    t = row["variants"]
    base = t.get("jax.lax", {})
    out = []
    for name, v in t.items():
        if "kernel_ms" not in v:
            continue
        record = {"variant": name, "batch": row["experts"], "m": row["tokens"], "n": row["h"], "k": row["d"],
                  "layout": "moe_step", "dtype": "bf16" if jnp.dtype(dtype) == jnp.bfloat16 else "f16",
                  "top_k": row["top_k"], **v}
        if "kernel_ms" in base:
            record["kernel_ratio_vs_jnp"] = base["kernel_ms"] / v["kernel_ms"]
            record["sustained_ratio_vs_jnp"] = base["sustained_ms"] / v["sustained_ms"]
        out.append(record)
    return out


def dump(path, gpu, commit, protocol, results, records):
    speedups = [r["speedup_kernel"] for r in results if "speedup_kernel" in r]
    geo = math.exp(statistics.mean(math.log(s) for s in speedups)) if speedups else None
    if path:
        with open(path, "w") as f:
            json.dump({"gpu": gpu, "jax": jax.__version__, "commit": commit,
                       "date": datetime.date.today().isoformat(), "protocol": dataclasses.asdict(protocol),
                       "geomean_speedup_kernel": geo, "results": results, "rows": records}, f, indent=1)
    return geo


if __name__ == "__main__":
    main()
