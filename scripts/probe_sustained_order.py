"""Probe: does the benchmark's sustained figure depend on a variant's place in the order?

An A/A check of `bench.sustained_rounds`: variants that run the same computation should
read 1.000 against each other. In the sweep at ef85790 the dispatcher's XLA path (the
same dot as jnp.dot) read 1.001-1.015x jnp.dot sustained in all 20 rows of at least
4096^3's work where both ran XLA, with kernel times equal. Three line-ups, each for SETTLE rounds
and then ROUNDS rounds in the benchmark's order (bench.sustained_rounds):
  same     three jnp.dot variants (separate jits of one function)
  mixed    jnp.dot "A", our kernel, jnp.dot "C": does the loop after ours differ?
  path     the sweep's line-up: jax_hopper.dot_general "A" (the dispatcher's XLA path, the same
           dot), our kernel, jnp.dot "C": at 997945a (mirrored rounds) the sweep still read
           its A 0.2-1.4% ahead of C (mean 0.6%) over 10 rows; is that A's program or its place?
Every loop is timed and printed with its round, place and predecessor, and the SM clock,
power and temperature that nvidia-smi reads just before it (outside the timed part); the
means leave out the SETTLE rounds, as the benchmark does. Run at 9560b60 (rotated order,
before the settling round, medians of all 6 rounds): identical dots 0.9995-1.0013 apart;
the first loop of round 0, after the kernel-time samples, 1.2-3.1% faster than the rest.
    python scripts/probe_sustained_order.py [MxNxK ...]     (default 8192 4096; JSON to $OUT or .)
"""

import functools
import json
import os
import statistics
import subprocess
import sys

import jax

import jax_hopper
from jax_hopper import bench
from jax_hopper._primitive import gemm

ROUNDS = 6  # three mirrored pairs
SETTLE = 1  # leading rounds, logged but left out of the means (bench.SUSTAINED_SETTLE_ROUNDS' role)
SMI_FIELDS = "clocks.sm,power.draw,temperature.gpu"
NN = (((1,), (0,)), ((), ()))  # jnp.dot's layout


def smi():
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10).stdout
        return [float(x) for x in out.strip().split(",")]
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def run(shape, lineup):
    m, n, k = shape
    sets = bench.make_inputs((m, k), (k, n), k, bench.DTYPES["f16"], bench.input_set_count((m, k), (k, n), 2))
    dot = functools.partial(jax.lax.dot_general, dimension_numbers=NN)
    names = ["A", "B", "C"] if lineup == "same" else ["A", "ours", "C"]
    fns = {name: gemm if name == "ours" else dot for name in names}
    if lineup == "path":
        fns["A"] = functools.partial(jax_hopper.dot_general, dimension_numbers=NN)
    variants = {name: bench.JaxVariant(name, fn) for name, fn in fns.items()}
    kernel = {}
    for name, v in variants.items():
        v.kernel_ms(*sets[0])  # compile and warm up
        kernel[name] = statistics.median(v.kernel_ms(*sets[i % len(sets)]) for i in range(7))
    log = []
    previous = [None]

    def timer(name):
        state = smi()
        ms = bench.sustained_ms(variants[name], sets, kernel[name])
        log.append({"name": name, "after": previous[0], "smi_before": state, "ms": ms})
        previous[0] = name
        return ms

    # Every loop timed and logged, the settling rounds' too (in the benchmark's order for them).
    for _ in range(SETTLE):
        for name in names:
            timer(name)
    times = bench.sustained_rounds({name: functools.partial(timer, name) for name in names}, rounds=ROUNDS, settle=0)
    for i, rec in enumerate(log):
        rec["round"], rec["place"] = divmod(i, len(names))
    mean = bench.sustained_mean(times)
    label = f"{m}x{n}x{k} {lineup}"
    for name in names:
        print(f"{label:>22} {name:>5}: kernel {kernel[name]:.4f} ms, sustained mean {mean[name]:.4f} ms, "
              f"C / it {mean['C'] / mean[name]:.4f}; rounds {' '.join(f'{t:.4f}' for t in times[name])}")
    for rec in log:
        where = f"round {rec['round']} place {rec['place']} {rec['name']:>5} after {rec['after'] or '-':>5}"
        print(f"{label:>22}   {where}: {rec['ms']:.4f} ms  smi before (MHz, W, C) {rec['smi_before']}")
    return {"shape": shape, "lineup": lineup, "kernel_ms": kernel, "loops": log}


def main(argv):
    shapes = [bench.parse_shape(s) for s in (argv or ["8192", "4096"])]
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}  preheat {bench.SUSTAINED_PREHEAT}")
    results = [run(shape, lineup) for shape in shapes for lineup in ("same", "mixed", "path")]
    path = os.path.join(os.environ.get("OUT", "."), "probe_sustained_order.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
