"""What tracing one product costs on the host: ``jax.make_jaxpr`` of a chain of dependent
products, each drop-in against the jax function it replaces, per policy.

    python3 tools/trace_cost.py                       # print the table
    python3 tools/trace_cost.py --json out.json       # and keep it

A product is traced once per call site; a model with thousands of products pays this at
every retrace. Each chain is a fresh function (jax caches a trace by function), timed
`--repeats` times; the minimum is reported.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import pathlib
import platform
import sys
import time

import jax
import jax.numpy as jnp
from bench_report import commit_of
from jax import lax

import jax_hopper

ROOT = pathlib.Path(__file__).resolve().parents[1]
DIMS = (((1,), (0,)), ((), ()))
PAIRS = (
    ("dot_general", functools.partial(lax.dot_general, dimension_numbers=DIMS),
     functools.partial(jax_hopper.dot_general, dimension_numbers=DIMS)),
    ("dot", jnp.dot, jax_hopper.dot),
    ("matmul", jnp.matmul, jax_hopper.matmul),
)


def chain(fn, length):
    def run(a, w):
        for _ in range(length):
            a = fn(a, w)
        return a

    return run


def per_product_us(fn, operand, length, repeats) -> float:
    jax.make_jaxpr(chain(fn, length))(operand, operand)  # first-use costs (imports, caches of jax's own)
    times = []
    for _ in range(repeats):
        traced = chain(fn, length)
        start = time.perf_counter()
        jax.make_jaxpr(traced)(operand, operand)
        times.append(time.perf_counter() - start)
    return min(times) / length * 1e6


def measured_commit() -> str:
    """The commit of the jax_hopper measured: its own checkout's where it is imported from
    one, else this checkout's (an installed build of it)."""
    own = commit_of(pathlib.Path(jax_hopper.__file__).resolve().parent)
    return own if own != "unknown" else commit_of(ROOT)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256, help="square operands of this size")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--length", type=int, default=200, help="products per chain")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--policies", default="auto,kernel")
    parser.add_argument("--json", type=pathlib.Path, help="write the rows and the run's facts here")
    args = parser.parse_args(argv)

    operand = jax.ShapeDtypeStruct((args.size, args.size), jnp.dtype(args.dtype))
    rows = []
    for policy in args.policies.split(","):
        with jax_hopper.dispatch(policy):
            for name, theirs, ours in PAIRS:
                jax_us = per_product_us(theirs, operand, args.length, args.repeats)
                ours_us = per_product_us(ours, operand, args.length, args.repeats)
                path = jax_hopper.dispatch_path(operand, operand, DIMS)[0]
                rows.append({"function": name, "policy": policy, "path": path, "jax_us": round(jax_us, 1),
                             "ours_us": round(ours_us, 1), "ratio": round(ours_us / jax_us, 2)})
                print(f"{policy:7s} {name:12s} {path:7s} jax {jax_us:7.1f} us  ours {ours_us:7.1f} us  "
                      f"ours/jax {ours_us / jax_us:5.2f}")
    if args.json:
        meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "commit": measured_commit(), "package": jax_hopper.__file__, "jax": jax.__version__,
                "python": platform.python_version(),
                "machine": platform.processor() or platform.machine(), "backend": jax.default_backend(),
                "command": " ".join(["tools/trace_cost.py", *(argv if argv is not None else sys.argv[1:])]),
                "operands": f"{args.size}x{args.size} {args.dtype}", "products_per_chain": args.length,
                "repeats": args.repeats, "statistic": "minimum over repeats of make_jaxpr time / products"}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
