"""How the benchmark shows and keeps its rows: rich tables (one per case, one per mode in
the summary), geometric means, the kernel breakdown, a plot, and the results file (rows,
geometric means and meta: GPU, date, commit, jax version, the protocol, the command line).
"""

from __future__ import annotations

import collections
import datetime
import json
import math
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import time

import jax
from bench_cases import LAYOUT_FLAGS
from rich import box
from rich.console import Console
from rich.table import Table

import jax_hopper

# Where output is not a terminal (a device log), rich would wrap at 80 columns: the
# widest table (a layer step's label and its rule) fits this.
LOG_WIDTH = 250


def console(stderr: bool = False) -> Console:
    """A console on sys.stdout (or sys.stderr) as it is at each write. No markup: labels
    such as "[gelu_tanh]" are text."""
    c = Console(stderr=stderr, markup=False, highlight=False, emoji=False)
    if not c.is_terminal:
        c.width = LOG_WIDTH
    return c


# ---- tables -----------------------------------------------------------------------------------
def case_label(r) -> str:
    shape = f"{r['m']}x{r['n']}x{r['k']}"
    return (f"{r['batch']}x" if r["batch"] else "") + shape + f" {r['layout'].upper()}"


def path_label(r) -> str:
    if r.get("path"):
        return f"{r['path']} ({r['rule']})"
    return "kernel (forced)" if r["variant"].split()[0] == "kernel" else ""


def _number(x, fmt):
    return "-" if x is None else format(x, fmt)


def rows_table(rows) -> Table:
    """Case, dtype, variant, kernel time, its TF/s and ratio vs jnp, sustained TF/s and
    ratio, relative error, the dispatcher's path; a chain's rows add the time per product."""
    chain = any("kernel_us_per_product" in r for r in rows)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    table.add_column("case (BxMxNxK layout)", justify="right")
    table.add_column("dtype", justify="right")
    table.add_column("variant", justify="right")
    for name in ("kernel ms", "TF/s", "ratio", "sust. TF/s", "ratio", "rel err"):
        table.add_column(name, justify="right")
    if chain:
        table.add_column("kernel us/product", justify="right")
        table.add_column("sust. us/product", justify="right")
    table.add_column("path")
    for r in rows:
        cells = [case_label(r), r["dtype"], r["variant"], f"{r['kernel_ms']:.4f}", f"{r['kernel_tflops']:.0f}",
                 f"{r['kernel_ratio_vs_jnp']:.3f}", f"{r['sustained_tflops']:.0f}",
                 f"{r['sustained_ratio_vs_jnp']:.3f}", _number(r.get("rel_error"), ".2e")]
        if chain:
            cells += [_number(r.get("kernel_us_per_product"), ".2f"), _number(r.get("sustained_us_per_product"), ".2f")]
        table.add_row(*cells, path_label(r))
    return table


def print_rows(out: Console, rows, heading: str | None = None) -> None:
    if heading:
        out.print(heading)
    out.print(rows_table(rows))


def print_breakdown(out: Console, rows) -> None:
    """Each step's kernels one by one, for the rows that carry them (--breakdown on CUPTI)."""
    steps = collections.defaultdict(list)
    for r in rows:
        if r.get("kernels"):
            steps[f"{r['layout']} {r['dtype']}"].append(r)
    for step, step_rows in steps.items():
        out.print(f"kernels of {step} (CUPTI, median per kernel):")
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
        table.add_column("variant")
        table.add_column("ms", justify="right")
        table.add_column("kernel")
        for r in step_rows:
            kernels = r["kernels"]
            table.add_row(r["variant"], f"{sum(ms for _, ms in kernels):.4f}", f"{len(kernels)} kernels")
            for name, ms in kernels:
                table.add_row("", f"{ms:.4f}", name)
        out.print(table)


def geometric_means(rows):
    """The headline over the product cases among `rows` (not layer, chain or
    tensor-parallel steps): the geometric mean of the ratio vs jnp.dot, by kernel time and
    sustained, of "jax_hopper" (the dispatcher's path) and of our kernel (the "kernel" row
    forced where the dispatcher picked XLA, else the dispatcher's kernel row). None
    without product cases."""
    cases = collections.defaultdict(dict)
    for r in rows:
        if r["layout"] in LAYOUT_FLAGS:
            cases[(r["batch"], r["m"], r["n"], r["k"], r["layout"], r["dtype"])][r["variant"]] = r
    cases = [v for v in cases.values() if "jax_hopper" in v]
    if not cases:
        return None

    def forced(v):
        return next((r for name, r in v.items() if name.split()[0] == "kernel"), v["jax_hopper"])

    def gmean(values):
        return math.exp(statistics.fmean(math.log(x) for x in values))

    out = {"cases": len(cases)}
    for label, picked in (("jax_hopper", lambda v: v["jax_hopper"]), ("kernel", forced)):
        out[label] = {clock: gmean(picked(v)[f"{clock}_ratio_vs_jnp"] for v in cases)
                      for clock in ("kernel", "sustained")}
    out["jax_hopper"]["min"] = {clock: min(v["jax_hopper"][f"{clock}_ratio_vs_jnp"] for v in cases)
                                for clock in ("kernel", "sustained")}
    return out


def print_geometric_means(out: Console, rows) -> None:
    g = geometric_means(rows)
    if g is None:
        return
    d, k = g["jax_hopper"], g["kernel"]
    out.print(f"geometric mean over {g['cases']} product cases, ratio vs jnp.dot (above 1: ours is faster):")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for name, justify in (("", "left"), ("kernel time", "right"), ("sustained", "right"),
                          ("lowest case (kernel / sustained)", "right")):
        table.add_column(name, justify=justify)
    table.add_row("jax_hopper (the dispatcher's path)", f"{d['kernel']:.3f}", f"{d['sustained']:.3f}",
                  f"{d['min']['kernel']:.3f} / {d['min']['sustained']:.3f}")
    table.add_row("our kernel (forced where the dispatcher picked XLA)", f"{k['kernel']:.3f}",
                  f"{k['sustained']:.3f}", "")
    out.print(table)


def print_summary(out: Console, rows_by_mode: dict[str, list[dict]]) -> None:
    """The line "summary" (scripts read the log from it), one table per mode, the
    geometric means."""
    out.print("summary")
    for mode, rows in rows_by_mode.items():
        if rows:
            print_rows(out, rows, f"summary: {mode}")
    print_geometric_means(out, [r for rows in rows_by_mode.values() for r in rows])


# ---- the results file -------------------------------------------------------------------------
def commit_of(repo: pathlib.Path) -> str:
    """The short commit of the repository at `repo`, "unknown" where git cannot say."""
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def meta(argv, commit: str, build_info: dict) -> dict:
    """What a results file says about its run (the protocol is added as it is written)."""
    device = jax.devices()[0]
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "gpu": device.device_kind, "device": device.device_kind, "platform": device.platform,
        "device_count": jax.device_count(),
        "date": now.isoformat(timespec="seconds"), "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": commit, "jax": jax.__version__, "jaxlib": getattr(jax.lib, "__version__", None),
        "python": platform.python_version(),
        "jax_hopper": {"file": jax_hopper.__file__, "kernel_available": jax_hopper.kernel_available(),
                       "compiled": build_info},
        "command": shlex.join(["tools/bench.py", *argv]), "argv": list(argv),
    }


def write_results(path, meta_: dict, protocol_json: dict, rows) -> None:
    """Rows, geometric means and meta as JSON; written whole, then renamed over `path`, so
    a run cut short leaves the last complete file."""
    data = {"meta": {**meta_, "protocol": protocol_json}, "rows": rows, "geometric_means": geometric_means(rows)}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def plot(rows, path) -> None:
    """TF/s (kernel time) per case and variant, like the seed's plot; needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}", file=sys.stderr)
        return
    labels = list(dict.fromkeys(f"{case_label(r)} {r['dtype']}" for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(labels) * len(variants)), 5))
    for i, v in enumerate(variants):
        tf = {f"{case_label(r)} {r['dtype']}": r["kernel_tflops"] for r in rows if r["variant"] == v}
        ax.bar([x + i * width for x in range(len(labels))], [tf.get(lab, 0) for lab in labels], width, label=v)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("TFLOP/s (kernel time)")
    ax.set_title(f"{jax.devices()[0].device_kind}: jax_hopper vs jnp.dot")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
