#!/usr/bin/env python3
"""Benchmark: jax_hopper against jnp.dot (and torch.matmul where importable), side by side
in one process; ratios are jnp's time over ours (above 1: ours is faster).

    python3 tools/bench.py                       # 8192^3 and 4096^3, f16
    python3 tools/bench.py --shapes 8192 --stages 2,3,4   # the seed's depth table (an experimental build)
    python3 tools/bench.py --dtype bf16 --shapes 4096x14336x4096 --json out.json
    python3 tools/bench.py --shapes 8192 --layouts nn,nt,tn --batched 8x2048x2048x2048
    python3 tools/bench.py --sweep --dtype f16,bf16 --json sweep.json --plot sweep.png
    python3 tools/bench.py --shapes= --mlp 8192x4096x16384,16384x8192x28672   # fused dense blocks
    python3 tools/bench.py --shapes= --dense 8192x4096x16384 --activations relu,gelu_tanh,silu
    python3 tools/bench.py --shapes= --chain 256,1024,1279   # the host's cost per call
    python3 tools/bench.py --shapes= --lm-head 16384x4096x128256   # f32 logits and their gradients
    python3 tools/bench.py --shapes 16x8192x8192 --kernels small_m --l2 cold   # weights streamed from DRAM

It imports the installed jax_hopper (the source tree has no compiled extension) and
refuses to run on a GPU where the kernel is missing. Protocol (bench_protocol.py): the
seed's data (standard normal scaled by K^-1/4); enough distinct input sets that they do
not fit in L2, used in rotation; warm-up; variants interleaved sample by sample; kernel
time by CUPTI (median; --l2 cold evicts the operands before each timed call); sustained
throughput over back-to-back dispatches in mirrored, rotated rounds after a settling
round (mean). What each mode measures: bench_cases.py. The results file (--json) holds
every row, the geometric means, and the GPU, date, commit, protocol and command line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import sys

TOOLS = pathlib.Path(__file__).resolve().parent
REPO = TOOLS.parent
# The installed jax_hopper, never the source tree (which has no compiled extension), and
# the library modules beside this file.
sys.path[:] = [str(TOOLS)] + [p for p in sys.path
                              if pathlib.Path(p or os.curdir).resolve() not in (REPO, TOOLS)]

import bench_cases as cases  # noqa: E402
import bench_report as report  # noqa: E402
import jax  # noqa: E402
from bench_protocol import Progress, Protocol, Runner  # noqa: E402
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn  # noqa: E402
from rich.progress import Progress as RichProgress  # noqa: E402

import jax_hopper  # noqa: E402
from jax_hopper import _ffi, _kernels  # noqa: E402
from jax_hopper._reference import ACTIVATION_FNS  # noqa: E402

DEFAULT_STAGES = "4"


def parser_for(build: cases.Build) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = Protocol()
    p.add_argument("--shapes", default="8192,4096", help="comma-separated N (cube) or MxNxK")
    p.add_argument("--dtype", default="f16", help="comma-separated: f16, bf16")
    p.add_argument("--layouts", default="nn", help="comma-separated operand layouts: nn (jnp.dot's), nt, tn, tt")
    p.add_argument("--batched", default="", help="comma-separated BxMxNxK batched products (NN layout)")
    p.add_argument("--stages", default=None, help=f"comma-separated pipeline depths of the seed's V5 kernel to time "
                   f"(NN); empty for none; default {DEFAULT_STAGES} where compiled. This build: "
                   f"{build.v5_stages() or 'none'}")
    p.add_argument("--kernels", default="", help="comma-separated extra kernel kinds to time (NN), e.g. the "
                   f"default's ablations (experimental: {cases.EXPERIMENTAL_OPTION}). This build: "
                   f"{', '.join(build.extra_kinds()) or 'none'}")
    p.add_argument("--samples", type=int, default=default.kernel_samples,
                   help="kernel-time samples per variant (median)")
    p.add_argument("--rounds", type=int, default=default.sustained_rounds,
                   help="sustained-throughput rounds (mean; even: they pair up in mirrored orders), after "
                   f"{default.sustained_settle_rounds} untimed settling round(s)")
    p.add_argument("--sustained-seconds", type=float, default=default.sustained_seconds,
                   help="target length in seconds of one sustained loop (each after an untimed pre-heat "
                   f"{default.sustained_preheat:g} times as long)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch.matmul column")
    p.add_argument("--l2", choices=("warm", "cold"), default="warm", help="kernel time with the operands as an "
                   "untimed call on them leaves L2 (warm, profiler.measure's warm-up) or evicted from it by a "
                   "scrub kernel before each timed call (cold; torch's column stays warm)")
    p.add_argument("--sweep", action="store_true", help="the shapes users run (replaces --shapes; adds NT and TN "
                   "at 8192^3)")
    p.add_argument("--tp-mlp", default="", help="comma-separated TOKENSxDMODELxDFF tensor-parallel MLP blocks "
                   "(column- then row-parallel) over --devices devices, ours vs jnp, sustained time")
    p.add_argument("--devices", type=int, default=2, help="devices for --tp-mlp")
    p.add_argument("--mlp", default="", help="comma-separated TOKENSxDMODELxDFF MLP blocks (dense + bias + GELU + "
                   "dense + bias + residual), fused jax_hopper.dense vs plain jnp, forward and training step")
    p.add_argument("--mlp-activations", default="gelu_tanh", help="comma-separated activations of the --mlp "
                   f"block: {', '.join(a for a in ACTIVATION_FNS if a)}")
    p.add_argument("--mlp-steps", default="", help="comma-separated --mlp steps to run (default all), e.g. "
                   f"'train,dz1 backward form'; of: {', '.join(cases.MLP_STEPS)}")
    p.add_argument("--dense", default="", help="comma-separated TOKENSxINxOUT dense layers act(x W + b): our fused "
                   "kernel and the dispatcher's choice vs plain jnp, for each of --activations")
    p.add_argument("--activations", default="gelu_tanh", help="comma-separated activations for --dense: none, relu, "
                   "gelu_tanh, gelu_exact, silu")
    p.add_argument("--breakdown", action="store_true", help="for layer steps (--mlp, --dense, --lm-head, --chain), "
                   "also time each variant's kernels one by one (CUPTI, median per kernel) and print them")
    p.add_argument("--lm-head", default="", help="comma-separated TOKENSxDMODELxVOCAB output layers: 16-bit "
                   "h and W, f32 logits, cross-entropy; the loss and its training step (gradients of h and W)")
    p.add_argument("--chain", default="", help="comma-separated sizes N or MxN: one jitted chain of "
                   "--chain-length dependent products x[M, N] @ W[N, N] (M = N by default), ours vs jnp.dot; with "
                   "short kernels its sustained time is the host's cost per product (MxN with a small M: decode)")
    p.add_argument("--chain-length", type=int, default=32, help="products per --chain program")
    p.add_argument("--json", help="write all rows and the run's meta to this results file (after every case)")
    p.add_argument("--plot", help="write a PNG bar chart of TF/s per case to this file")
    p.add_argument("--commit", help="the commit recorded in the results file (default: git's HEAD of the "
                   "repository this tool sits in, else 'unknown')")
    return p


def sizes(text: str, form: str, flag: str, p, cube: bool = False) -> tuple[int, ...]:
    """The sizes of `form` (e.g. "MxNxK") in `text`, or a parser error; with `cube`, one N
    stands for NxNxN."""
    count = form.count("x") + 1
    try:
        parts = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        parts = ()
    if cube and len(parts) == 1:
        parts *= count
    if len(parts) != count:
        p.error(f"{flag} takes {'N or ' if cube else ''}{form}, got {text!r}")
    return parts


def listed(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def extras(args, build: cases.Build, dtypes, p, say) -> tuple[list[int], list[str]]:
    """The V5 depths and extra kinds asked for, each compiled for at least one dtype (an
    explicit request that is not is an error; the default depth is left out with a note)."""
    stages = [int(s) for s in listed(DEFAULT_STAGES if args.stages is None else args.stages)]
    kernels = listed(args.kernels)
    unknown = sorted(set(kernels) - set(_kernels.GEMM_KINDS))
    if unknown:
        p.error(f"unknown --kernels {unknown}; this build times: {build.extra_kinds() or 'none'}")
    for s in list(stages):
        why = build.missing("v5", s, dtypes)
        if why and args.stages is None:
            say(f"note: V5 s={s} not timed: {why}")
            stages.remove(s)
        elif why:
            p.error(f"--stages {s}: {why}" + (f" ({build.note})" if build.note else ""))
    for kind in kernels:
        why = build.missing(kind, None, dtypes)
        if why:
            p.error(f"--kernels {kind}: {why}" + (f" ({build.note})" if build.note else ""))
    return stages, kernels


def cases_of(args, build: cases.Build, p, say) -> list:
    """The case specs the command line asks for, in the order they run."""
    dtypes = listed(args.dtype)
    if set(dtypes) - set(cases.DTYPES):
        p.error(f"unknown --dtype {sorted(set(dtypes) - set(cases.DTYPES))}; choose from {sorted(cases.DTYPES)}")
    layouts = listed(args.layouts)
    if set(layouts) - set(cases.LAYOUT_FLAGS):
        p.error(f"unknown --layouts {sorted(set(layouts) - set(cases.LAYOUT_FLAGS))}")
    activations = [None if a == "none" else a for a in listed(args.activations)]
    mlp_activations = listed(args.mlp_activations)
    for flag, acts, allowed in (("--activations", activations, ACTIVATION_FNS),
                                ("--mlp-activations", mlp_activations, [a for a in ACTIVATION_FNS if a])):
        if set(acts) - set(allowed):
            p.error(f"unknown {flag} {sorted(map(str, set(acts) - set(allowed)))}")
    mlp_steps = tuple(listed(args.mlp_steps))
    if set(mlp_steps) - set(cases.MLP_STEPS):
        p.error(f"unknown --mlp-steps {sorted(set(mlp_steps) - set(cases.MLP_STEPS))}; choose from "
                f"{list(cases.MLP_STEPS)}")
    if args.tp_mlp and len(jax.devices()) < args.devices:
        p.error(f"--tp-mlp needs {args.devices} devices, found {len(jax.devices())}")
    stages, kernels = extras(args, build, dtypes, p, say)

    shapes = [sizes(s, "MxNxK", "--shapes", p, cube=True)
              for s in listed(cases.SWEEP_SHAPES if args.sweep else args.shapes)]
    products = [(0, *shape, lay) for shape in shapes for lay in layouts]
    if args.sweep:
        products += [(0, 8192, 8192, 8192, lay) for lay in ("nt", "tn") if lay not in layouts]
    products += [(*sizes(t, "BxMxNxK", "--batched", p), "nn") for t in listed(args.batched)]
    specs = [cases.ProductCase(*c, d, tuple(s for s in stages if build.has("v5", d, s)),
                               tuple(kind for kind in kernels if build.has(kind, d)), not args.no_torch)
             for c in products for d in dtypes]
    specs += [cases.MlpCase(*sizes(t, "TOKENSxDMODELxDFF", "--mlp", p), d, a, mlp_steps)
              for t in listed(args.mlp) for d in dtypes for a in mlp_activations]
    specs += [cases.DenseCase(*sizes(t, "TOKENSxINxOUT", "--dense", p), d, a)
              for t in listed(args.dense) for d in dtypes for a in activations]
    specs += [cases.LmHeadCase(*sizes(t, "TOKENSxDMODELxVOCAB", "--lm-head", p), d)
              for t in listed(args.lm_head) for d in dtypes]
    specs += [cases.ChainCase(n, args.chain_length, d, rows=m)
              for t in listed(args.chain) for m, n in [sizes(t, "MxN", "--chain", p, cube=True)] for d in dtypes]
    specs += [cases.TpMlpCase(*sizes(t, "TOKENSxDMODELxDFF", "--tp-mlp", p), d, args.devices)
              for t in listed(args.tp_mlp) for d in dtypes]
    return specs


def require_kernel(device) -> None:
    """On a GPU without our extension every "jax_hopper" or "kernel" row would time XLA's
    dot under our name (a repository checkout's jax_hopper has no extension): stop."""
    if device.platform == "gpu" and not jax_hopper.kernel_available():
        raise SystemExit(f"jax_hopper's kernel is not available here ({_ffi.missing_kernel_reason()}; imported "
                         f"from {jax_hopper.__file__}): the benchmark would time XLA's dot under our name. Run it "
                         f"with the package installed (pip install .), not from the source tree.")


class Bar(Progress):
    """A rich progress bar on stderr: the cases done, and the current case's kernel-time
    samples and sustained rounds. Where stderr is not a terminal (a device log), one line
    per case instead, so a log cut short shows which case ran."""

    def __init__(self, err, n_cases: int):
        self.err, self.n_cases = err, n_cases
        self.live = err.is_terminal
        self.bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=err, transient=True, disable=not self.live)
        self.cases = self.bar.add_task("cases", total=n_cases)
        self.task, self.total = None, 0

    @contextlib.contextmanager
    def case(self, index: int, label: str):
        if not self.live:
            self.err.print(f"[{index + 1}/{self.n_cases}] {label}")
        self.task, self.total = self.bar.add_task(label, total=None), 0
        yield
        self.bar.remove_task(self.task)
        self.bar.advance(self.cases)

    def expect(self, steps: int) -> None:
        self.total += steps
        self.bar.update(self.task, total=self.total)

    def advance(self) -> None:
        self.bar.advance(self.task)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    device = jax.devices()[0]
    build = cases.Build.current(device.platform)
    p = parser_for(build)
    args = p.parse_args(argv)
    out, err = report.console(), report.console(stderr=True)
    out.print(f"device: {device.device_kind}  jax {jax.__version__}  platform {device.platform}")
    if device.platform != "gpu":
        out.print("warning: no GPU; these numbers time the fallback")
    require_kernel(device)
    if build.note:
        out.print(f"note: compiled kernels: {build.note}")
    specs = cases_of(args, build, p, out.print)
    protocol = Protocol(kernel_samples=max(args.samples, 1), sustained_rounds=max(args.rounds, 1),
                        sustained_seconds=args.sustained_seconds, kernel_time_l2=args.l2, breakdown=args.breakdown)
    meta = report.meta(argv, args.commit or report.commit_of(REPO), build.describe())
    rows, by_mode = [], {}
    with run_display(out, err, len(specs)) as (bar, shown):
        runner = Runner(protocol, bar)
        for i, spec in enumerate(specs):
            with bar.case(i, spec.label):
                case_rows = [{**r, "mode": spec.mode} for r in spec.run(runner)]
            report.print_rows(shown, case_rows, spec.label)
            report.print_breakdown(shown, case_rows)
            rows += case_rows
            by_mode.setdefault(spec.mode, []).extend(case_rows)
            if args.json:  # after every case too, so a run cut short keeps what it measured
                report.write_results(args.json, meta, protocol.as_json(runner.scrub), rows)
    report.print_summary(out, by_mode)
    if args.plot:
        report.plot(rows, args.plot)
    if args.json:
        report.write_results(args.json, meta, protocol.as_json(runner.scrub), rows)
    return rows


@contextlib.contextmanager
def run_display(out, err, n_cases):
    """(the progress bar, the console tables go to while it runs): where stdout and stderr
    are one terminal, the bar's own console, which prints above the bar."""
    bar = Bar(err, n_cases)
    with bar.bar:
        yield bar, (err if bar.live and out.is_terminal else out)


if __name__ == "__main__":
    main()
