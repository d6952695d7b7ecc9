"""Benchmark: jax_hopper against jnp.dot (and torch.matmul where importable), side by side.

    python -m jax_hopper.bench                       # 8192^3 and 4096^3, f16
    python -m jax_hopper.bench --shapes 8192 --stages 2,3,4   # the seed's depth table
    python -m jax_hopper.bench --dtype bf16 --shapes 4096x14336x4096 --json out.json
    python -m jax_hopper.bench --shapes 8192 --layouts nn,nt,tn --batched 8x2048x2048x2048
    python -m jax_hopper.bench --sweep --dtype f16,bf16 --json sweep.json --plot sweep.png
    python -m jax_hopper.bench --shapes= --mlp 8192x4096x16384,16384x8192x28672   # fused dense blocks
    python -m jax_hopper.bench --shapes= --dense 8192x4096x16384 --activations relu,gelu_tanh,silu
    python -m jax_hopper.bench --shapes= --chain 256,1024,1279   # the host's cost per call
    python -m jax_hopper.bench --shapes= --lm-head 16384x4096x128256   # f32 logits and their gradients
    python -m jax_hopper.bench --shapes 16x8192x8192 --kernels small_m --l2 cold   # weights streamed from DRAM

Protocol (../shared/GUIDE.md section 5): the seed's data (standard normal scaled by
K^-1/4, so C has unit variance); enough distinct input sets that they do not fit in L2,
used in rotation; warm-up; variants interleaved sample by sample; medians. Two figures:
kernel time (device time of the kernels one call launches, read through CUPTI by
jax.experimental.mosaic.gpu.profiler.measure; CUDA events for torch; measure's own
untimed call on the same inputs leaves them in L2 as far as they fit, unless --l2 cold
evicts them before each timed call) and sustained
throughput (back-to-back async dispatches, where the chip meets its power limit; each
loop after an untimed pre-heat of the same variant, after one untimed round that lets
the chip settle under the load; rounds in mirrored pairs, the order rotating from pair to
pair, and the mean over rounds, so neither the drift of the clock nor the variant before a
loop favours any variant). Ratios are jnp.dot time / ours: above 1 means ours is faster.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import math
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import jax_hopper
from jax_hopper import _dispatch, _ffi
from jax_hopper._fallback import (
    ACTIVATION_FNS,
    activation_derivative,
    activation_grad_like_jnp,
    activation_with_derivative,
    row_sum,
)
from jax_hopper._fused import fused_activation_grad, fused_dense_with_derivative
from jax_hopper._primitive import DEFAULT_KERNEL, KERNELS, gemm

L2_BYTES = 60 * 2**20  # H200
MAX_INPUT_SETS = 64
KERNEL_SAMPLES = 15  # kernel-time samples per variant
SUSTAINED_SECONDS = 0.4  # target length of one sustained loop
# Untimed load before each sustained loop, as a fraction of it: the power limiter's clock
# follows the recent load, so without it a loop inherits the clock the variant before it
# left (two runs of the same XLA dot differed by ~4% at 4096^3 depending on order).
SUSTAINED_PREHEAT = 0.5
# Rounds come in pairs, the second in the reverse order of the first (sustained_rounds):
# keep this even.
SUSTAINED_ROUNDS = 4
# Untimed rounds before the timed ones. The kernel-time samples leave the chip cool and
# at its top clock; the first sustained loop after them ran 1.2-3.1% faster than the same
# dot in later rounds (scripts/probe_sustained_order.py: 1965-1980 MHz, 47-54 C before it,
# 1395-1470 MHz, 57-66 C before the rest), and the pre-heat alone is too short to settle
# it. Without a settling round that loop was always the first variant's, and the
# dispatcher's XLA path read ~1% faster than jnp.dot, the same dot (the sweep at ef85790).
SUSTAINED_SETTLE_ROUNDS = 1
BREAKDOWN = False  # --breakdown: also each variant's kernels, one by one (mlp and dense steps)
# Kernel time with the operands cold in L2 (--l2 cold). profiler.measure makes an untimed
# call on the same operands right before the timed one, so whatever of them fits in L2 is
# warm for the timed call however the input sets rotate: all of 16x4096x4096's 33.5 MB of
# B, the last-touched part of larger ones (the sustained loops rotate sets back to back and
# are not affected). A model's decode step streams its weights from DRAM. Cold, each timed
# call is dispatched right after one that reads an L2_SCRUB_BYTES buffer (an XOR reduction
# to one word: AfterL2Scrub), and its kernels are left out of the time. Reads only: a
# rewrite (the first form) left L2 full of dirty lines, written back to DRAM under the
# timed kernel (16x8192x8192: 42.3 us against 36 us end to end in scripts/probe_timeline.cu,
# whose scrub reads; ncu's flush: 39.2).
# torch's column (CUDA events around back-to-back calls) stays warm.
COLD_L2 = False
L2_SCRUB_BYTES = 2 * L2_BYTES
_l2_scrub_buffer = None
_l2_scrub_kernels = None
DTYPES = {"f16": jnp.float16, "bf16": jnp.bfloat16}
# The shapes users run (issue 4's sweep): squares, LLM training shapes, decode shapes
# (small M against 8192x8192 weights), odd sizes (8191: rows TMA cannot describe).
SWEEP_SHAPES = ("1024,2048,4096,6144,8192,16384,4096x14336x4096,4096x4096x14336,16384x8192x8192,"
                "8192x8192x1024,16x8192x8192,64x8192x8192,128x8192x8192,256x8192x8192,"
                "1000,3000x5000x7000,8191,2047,4095")


# Extra kernel kinds (--kernels) compiled for bf16 as well (cuda/gemm/instances.def).
BF16_EXTRA_KERNELS = ("small_m",)


def parse_shape(text: str) -> tuple[int, int, int]:
    parts = [int(p) for p in text.lower().split("x")]
    if len(parts) == 1:
        return parts[0], parts[0], parts[0]
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"shape must be N or MxNxK, got {text!r}")
    return tuple(parts)


# Operand layouts: A stored [M, K] ("n") or [K, M] ("t"); B stored [K, N] ("n") or [N, K] ("t").
LAYOUT_FLAGS = {"nn": (False, False), "nt": (False, True), "tn": (True, False), "tt": (True, True)}


def stored_shapes(batch, m, n, k, layout):
    ta, tb = LAYOUT_FLAGS[layout]
    lead = (batch,) if batch else ()
    return lead + ((k, m) if ta else (m, k)), lead + ((n, k) if tb else (k, n))


def dimension_numbers(batch, layout):
    ta, tb = LAYOUT_FLAGS[layout]
    nb = 1 if batch else 0
    contract = ((nb + (0 if ta else 1),), (nb + (1 if tb else 0),))
    return contract, ((0,), (0,)) if batch else ((), ())


def make_inputs(a_shape, b_shape, k, dtype, n_sets, seed=0):
    scale = 1.0 / k**0.25  # the seed benchmark's data: C ~ unit variance
    sets = []
    for i in range(n_sets):
        ka, kb = jax.random.split(jax.random.key(seed + i))
        a = (jax.random.normal(ka, a_shape, jnp.float32) * scale).astype(dtype)
        b = (jax.random.normal(kb, b_shape, jnp.float32) * scale).astype(dtype)
        sets.append((a, b))
    jax.block_until_ready(sets)
    return sets


def input_set_count(a_shape, b_shape, itemsize) -> int:
    set_bytes = (math.prod(a_shape) + math.prod(b_shape)) * itemsize
    return max(2, min(MAX_INPUT_SETS, math.ceil(3 * L2_BYTES / set_bytes)))


class AfterL2Scrub:
    """jitted fn, each call dispatched after a separate call that reads the scrub buffer,
    so on the device's stream the product starts with L2 holding only clean lines of it.
    profiler.measure takes it for an already-jitted function (jax.stages.Wrapped is a
    runtime-checkable protocol) and calls it as it is, so both
    dispatches fall in its timed window, in stream order; one jitted program instead
    would leave XLA free to run the two independent ops in either order, or together."""

    def __init__(self, fn):
        self.fn = fn if isinstance(fn, jax.stages.Wrapped) else jax.jit(fn)  # a variant's own: compiled once
        if not isinstance(self, jax.stages.Wrapped):  # measure would jit both into one program
            raise RuntimeError("--l2 cold: profiler.measure would not take the scrub and the product as two calls")

    def __call__(self, *args):
        _read_l2_scrub(l2_scrub_buffer())
        return self.fn(*args)

    def trace(self, *args, **kwargs):
        return self.fn.trace(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self.fn.lower(*args, **kwargs)


# One program for every variant; a reduction, so nothing but one word is written.
_read_l2_scrub = jax.jit(lambda buf: jax.lax.reduce(buf, jnp.uint32(0), jax.lax.bitwise_xor, (0,)))


def l2_scrub_buffer():
    global _l2_scrub_buffer
    if _l2_scrub_buffer is None:
        _l2_scrub_buffer = jnp.zeros(L2_SCRUB_BYTES // 4, jnp.uint32)
    return _l2_scrub_buffer


def l2_scrub_kernels(measure) -> tuple[str, ...]:
    """The names of the scrub program's kernels, in launch order, as `measure` (jax's
    profiler.measure) lists them; learned once."""
    global _l2_scrub_kernels
    if _l2_scrub_kernels is None:
        _, timings = measure(_read_l2_scrub, aggregate=False)(l2_scrub_buffer())
        if not timings:
            raise RuntimeError("--l2 cold: the scrub launched no kernel")
        _l2_scrub_kernels = tuple(name for name, _ in timings)
    return _l2_scrub_kernels


def without_l2_scrub(timings, scrub_kernels):
    """The [(kernel, ms)] of a scrubbed call less the scrub's kernels, which come first."""
    n = len(scrub_kernels)
    if n == 0 or tuple(name for name, _ in timings[:n]) != tuple(scrub_kernels):
        raise RuntimeError(f"--l2 cold: the first kernels are not the L2 scrub's {list(scrub_kernels)}: "
                           f"{[name for name, _ in timings]}")
    return timings[n:]


class JaxVariant:
    def __init__(self, name, fn):
        self.name = name
        self.fn = jax.jit(fn)
        self.cold_l2 = COLD_L2
        try:
            from jax.experimental.mosaic.gpu import profiler

            self._profiler = profiler
            if self.cold_l2:
                self._measure = profiler.measure(AfterL2Scrub(self.fn), aggregate=False)
            else:
                self._measure = profiler.measure(self.fn)
            self.clock = "cupti"
        except Exception as e:  # no CUPTI: fall back to wall clock around one blocked call
            if "--l2 cold" in str(e):  # a cold protocol that cannot work is an error, not a warm time
                raise
            self._measure = None
            self.clock = "wall"

    def kernel_ms(self, *args) -> float:
        if self._measure is not None:
            try:
                if self.cold_l2:
                    _, timings = self._measure(*args)
                    scrub = l2_scrub_kernels(self._profiler.measure)
                    ms = sum(t for _, t in without_l2_scrub(timings, scrub)) if timings else None
                else:
                    _, ms = self._measure(*args)
            except RuntimeError as e:  # CUPTI unavailable here (e.g. the CPU fallback)
                if "--l2 cold" in str(e):
                    raise
                self._measure, self.clock = None, "wall"
            else:
                if ms is not None:
                    return float(ms)
        t0 = time.perf_counter()
        jax.block_until_ready(self.fn(*args))
        return (time.perf_counter() - t0) * 1e3

    def dispatch(self, a, b):
        return self.fn(a, b)

    def sync(self, out):
        jax.block_until_ready(out)


class TorchVariant:
    """torch.matmul (cuBLAS directly) on the same device buffers, shared through dlpack.

    Its kernel time is read with CUDA events around TORCH_BURST back-to-back calls,
    divided by TORCH_BURST: one call between two events on an idle GPU also times the
    launch latency.
    """

    name = "torch.matmul"
    clock = "cuda-events"
    TORCH_BURST = 10

    def __init__(self, torch, transpose_a, transpose_b):
        self.torch = torch
        self.ta, self.tb = transpose_a, transpose_b

    def convert(self, sets):
        def view(x, t):  # a transposed view: cuBLAS reads it in place
            x = self.torch.from_dlpack(x)
            return x.transpose(-1, -2) if t else x

        return [(view(a, self.ta), view(b, self.tb)) for a, b in sets]

    def kernel_ms(self, a, b) -> float:
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.TORCH_BURST):
            torch.matmul(a, b)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / self.TORCH_BURST

    def dispatch(self, a, b):
        return self.torch.matmul(a, b)

    def sync(self, out):
        self.torch.cuda.synchronize()


def relative_error(c, a, b, dims) -> float:
    ref = jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dims,
                              precision=jax.lax.Precision.HIGHEST)
    diff = c.astype(jnp.float32) - ref
    return float(jnp.linalg.norm(diff) / jnp.linalg.norm(ref))


def sustained_ms(variant, sets, kernel_ms_estimate) -> float:
    iters = int(min(2000, max(20, SUSTAINED_SECONDS * 1e3 / max(kernel_ms_estimate, 1e-3))))
    out = None
    for i in range(max(len(sets), int(iters * SUSTAINED_PREHEAT))):  # the dispatch path and the clock
        out = variant.dispatch(*sets[i % len(sets)])
    variant.sync(out)
    t0 = time.perf_counter()
    for i in range(iters):
        out = variant.dispatch(*sets[i % len(sets)])
    variant.sync(out)
    return (time.perf_counter() - t0) * 1e3 / iters


def sustained_rounds(timers, progress=None, *, rounds=None, settle=None) -> dict[str, list[float]]:
    """{name: sustained ms per round} for timers {name: () -> ms}, `rounds` rounds
    (default SUSTAINED_ROUNDS) after `settle` untimed ones (default
    SUSTAINED_SETTLE_ROUNDS: the chip's clock and temperature settle under the load
    first).

    Rounds come in pairs: round 2p runs the variants rotated by p, round 2p + 1 the same
    order reversed. Within a pair every variant's places add up to the same number, and
    the loop before each one is once its predecessor and once its successor; over an even
    number of rounds a clock that drifts linearly in time therefore moves every variant's
    mean (sustained_mean) by the same amount. What order can do, this undoes; it did not
    undo the whole of the dispatcher's XLA path's lead over jnp.dot, the same dot, over
    the sweep's large rows: 0.45% at 27c1162 (rotation, medians of 3 rounds), 0.6% at
    997945a (this order), where that column led in every round, before jnp.dot or after it
    (BENCHMARKS.md, session of 2026-12-03 08:02)."""
    names = list(timers)
    for _ in range(SUSTAINED_SETTLE_ROUNDS if settle is None else settle):
        for name in names:
            timers[name]()
    times = {name: [] for name in names}
    for r in range(SUSTAINED_ROUNDS if rounds is None else rounds):
        shift = (r // 2) % len(names)
        order = names[shift:] + names[:shift]
        for name in (order[::-1] if r % 2 else order):
            times[name].append(timers[name]())
        if progress is not None:
            progress()
    return times


def sustained_mean(times) -> dict[str, float]:
    """{name: mean ms} of sustained_rounds' result: the mean, not the median, because the
    balance of its order holds for sums."""
    return {name: statistics.fmean(ts) for name, ts in times.items()}


def bench_case(batch, m, n, k, layout, dtype_name, stages_list, use_torch, progress, kernels=()):
    dtype = DTYPES[dtype_name]
    a_shape, b_shape = stored_shapes(batch, m, n, k, layout)
    n_sets = input_set_count(a_shape, b_shape, jnp.dtype(dtype).itemsize)
    sets = make_inputs(a_shape, b_shape, k, dtype, n_sets)
    ta, tb = LAYOUT_FLAGS[layout]
    dims = dimension_numbers(batch, layout)
    # The default call (the dispatcher picks our kernel or XLA's dot) and, when it
    # picked XLA, our kernel forced (the kind policy "kernel" runs: the small-M kind for
    # decode shapes), so every row shows what the kernel does.
    path, rule = jax_hopper.dispatch_path(*sets[0], dims)
    variants = [JaxVariant("jax_hopper", functools.partial(jax_hopper.dot_general, dimension_numbers=dims))]
    # The kind our kernel path runs (the default path's, or forced), recorded in each row.
    kind = _dispatch.kernel_for(_dispatch.problem_of(a_shape, b_shape, dtype, dtype, ta, tb))
    kinds = {"jax_hopper": kind if path == "kernel" else None}
    if path != "kernel":
        name = "kernel" if kind == DEFAULT_KERNEL else f"kernel {kind}"
        variants.append(JaxVariant(name, functools.partial(gemm, transpose_a=ta, transpose_b=tb, kernel=kind)))
        kinds[name] = kind
    if layout == "nn" and not batch:  # the seed's V5 is compiled for jnp.dot's layout
        variants += [JaxVariant(f"V5 s={s}", functools.partial(gemm, kernel="v5", stages=s)) for s in stages_list]
        kinds.update({f"V5 s={s}": "v5" for s in stages_list})
        # The default's ablations are compiled for f16 only; the small-M kind for both.
        variants += [JaxVariant(name, functools.partial(gemm, kernel=name)) for name in kernels
                     if dtype_name == "f16" or name in BF16_EXTRA_KERNELS]
        kinds.update({name: name for name in kernels})
    # The baseline: what jnp.dot / lax.dot_general lowers to (cuBLASLt on the H200).
    variants.append(JaxVariant("jnp.dot", functools.partial(jax.lax.dot_general, dimension_numbers=dims)))
    variant_sets = {v.name: sets for v in variants}
    torch = None
    if use_torch:
        try:
            import torch as torch_module

            if torch_module.cuda.is_available():
                torch = TorchVariant(torch_module, ta, tb)
                variants.append(torch)
                variant_sets[torch.name] = torch.convert(sets)
        except ImportError:
            pass

    errors = {}
    for v in variants:
        if isinstance(v, JaxVariant):
            errors[v.name] = relative_error(v.fn(*sets[0]), *sets[0], dims)

    kernel = {v.name: [] for v in variants}
    for v in variants:  # warm-up: compile, first launch, CUPTI init
        v.kernel_ms(*variant_sets[v.name][0])
    for i in range(KERNEL_SAMPLES):  # interleaved: one sample of each variant per round
        for v in variants:
            kernel[v.name].append(v.kernel_ms(*variant_sets[v.name][i % n_sets]))
        progress()
    kernel_med = {name: statistics.median(xs) for name, xs in kernel.items()}

    sustained = sustained_rounds({v.name: functools.partial(sustained_ms, v, variant_sets[v.name], kernel_med[v.name])
                                  for v in variants}, progress)
    sustained_avg = sustained_mean(sustained)

    flops = 2.0 * max(batch, 1) * m * n * k
    rows = []
    for v in variants:
        rows.append({
            "batch": batch, "m": m, "n": n, "k": k, "layout": layout, "dtype": dtype_name, "variant": v.name,
            "clock": v.clock,
            "kernel_ms": kernel_med[v.name], "kernel_tflops": flops / kernel_med[v.name] / 1e9,
            "kernel_ratio_vs_jnp": kernel_med["jnp.dot"] / kernel_med[v.name],
            "kernel_spread_ms": [min(kernel[v.name]), max(kernel[v.name])],
            "sustained_ms": sustained_avg[v.name], "sustained_tflops": flops / sustained_avg[v.name] / 1e9,
            "sustained_ratio_vs_jnp": sustained_avg["jnp.dot"] / sustained_avg[v.name],
            "sustained_rounds_ms": sustained[v.name],
            "rel_error": errors.get(v.name), "input_sets": n_sets,
            "path": path if v.name == "jax_hopper" else None, "rule": rule if v.name == "jax_hopper" else None,
            "kind": kinds.get(v.name),
        })
    del sets, variant_sets
    return rows


def case_label(r) -> str:
    shape = f"{r['m']}x{r['n']}x{r['k']}"
    return (f"{r['batch']}x" if r["batch"] else "") + shape + f" {r['layout'].upper()}"


def print_table(rows, file=None):
    head = (f"{'case (BxMxNxK layout)':>26} {'dtype':>5} {'variant':>16} {'kernel ms':>10} {'TF/s':>6} {'ratio':>6}"
            f" {'sust. TF/s':>10} {'ratio':>6} {'rel err':>9}  path")
    print(head, file=file)
    print("-" * len(head), file=file)
    for r in rows:
        err = f"{r['rel_error']:.2e}" if r["rel_error"] is not None else "-"
        print(f"{case_label(r):>26} {r['dtype']:>5} {r['variant']:>16} {r['kernel_ms']:>10.4f}"
              f" {r['kernel_tflops']:>6.0f} {r['kernel_ratio_vs_jnp']:>6.3f} {r['sustained_tflops']:>10.0f}"
              f" {r['sustained_ratio_vs_jnp']:>6.3f} {err:>9}  {_path_label(r)}", file=file)


def geometric_means(rows):
    """Issue 4's headline over the product cases among `rows` (not MLP, dense or chain
    steps): the geometric mean of the ratio vs jnp.dot, by kernel time and sustained,
    of "jax_hopper" (the dispatcher's path) and of our kernel (the "kernel" row forced
    where the dispatcher picked XLA, else the dispatcher's kernel row). None without
    product cases."""
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


def print_geometric_means(rows, file=None):
    g = geometric_means(rows)
    if g is None:
        return
    d, k = g["jax_hopper"], g["kernel"]
    print(f"geometric mean over {g['cases']} product cases, ratio vs jnp.dot (kernel time / sustained):\n"
          f"  jax_hopper (the dispatcher's path): {d['kernel']:.3f} / {d['sustained']:.3f}"
          f" (lowest case {d['min']['kernel']:.3f} / {d['min']['sustained']:.3f})\n"
          f"  our kernel (forced where the dispatcher picked XLA): {k['kernel']:.3f} / {k['sustained']:.3f}",
          file=file)


def _path_label(r) -> str:
    if r.get("path"):
        return f"{r['path']} ({r['rule']})"
    return "kernel (forced)" if r["variant"].split()[0] == "kernel" else ""


def bench_tp_mlp(tokens, d_model, d_ff, dtype_name, n_devices, progress):
    """A tensor-parallel MLP block on n_devices: x @ W1 (column parallel: W1 split on its
    output dim), GELU, @ W2 (row parallel: W2 split on its input dim, so XLA adds a psum).
    Ours and jnp.matmul in the same jitted block; sustained timing (wall clock of back-to-back
    dispatches: per-kernel CUPTI time does not cover the collective across devices)."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_hopper.ops import matmul

    dtype = DTYPES[dtype_name]
    devices = jax.devices()[:n_devices]
    if len(devices) < n_devices:
        raise SystemExit(f"--tp-mlp needs {n_devices} devices, found {len(devices)}")
    mesh = jax.make_mesh((n_devices,), ("tp",), axis_types=(AxisType.Auto,), devices=devices)
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.device_put(jax.random.normal(keys[0], (tokens, d_model), jnp.float32).astype(dtype),
                       NamedSharding(mesh, P()))
    w1 = jax.device_put((jax.random.normal(keys[1], (d_model, d_ff), jnp.float32) / d_model**0.5).astype(dtype),
                        NamedSharding(mesh, P(None, "tp")))
    w2 = jax.device_put((jax.random.normal(keys[2], (d_ff, d_model), jnp.float32) / d_ff**0.5).astype(dtype),
                        NamedSharding(mesh, P("tp", None)))

    def block(mm):
        return jax.jit(lambda a, b, c: mm(jax.nn.gelu(mm(a, b)), c))

    # Our kernel on every shard, whatever the table says: the policy entered inside the
    # outer jit's trace (it is in jax's jit key: a call outside it would trace the block
    # again under the default; entered per call, it would add microseconds per call).
    variants = {"jax_hopper": jax.jit(_kernel_forced(block(matmul))), "jnp.dot": block(jnp.matmul)}
    outs = {name: f(x, w1, w2) for name, f in variants.items()}
    ref = outs["jnp.dot"].astype(jnp.float32)
    err = float(jnp.linalg.norm(outs["jax_hopper"].astype(jnp.float32) - ref) / jnp.linalg.norm(ref))

    class Wrapped:
        def __init__(self, f):
            self.dispatch, self.sync = f, jax.block_until_ready

    times = sustained_rounds({name: functools.partial(sustained_ms, Wrapped(lambda a, b, f=f: f(a, b, w2)),
                                                      [(x, w1)], 1.0)
                              for name, f in variants.items()}, progress)
    avg = sustained_mean(times)
    flops = 2.0 * 2 * tokens * d_model * d_ff
    return [{
        "batch": 0, "m": tokens, "n": d_ff, "k": d_model, "layout": f"tp-mlp x{n_devices}", "dtype": dtype_name,
        "variant": name, "clock": "wall", "kernel_ms": avg[name], "kernel_tflops": flops / avg[name] / 1e9,
        "kernel_ratio_vs_jnp": avg["jnp.dot"] / avg[name], "kernel_spread_ms": [min(times[name]), max(times[name])],
        "sustained_ms": avg[name], "sustained_tflops": flops / avg[name] / 1e9,
        "sustained_ratio_vs_jnp": avg["jnp.dot"] / avg[name],
        "rel_error": err if name == "jax_hopper" else 0.0, "input_sets": 1,
    } for name in variants]


def bench_mlp(tokens, d_model, d_ff, dtype_name, progress, activation="gelu_tanh", only=None):
    """A transformer MLP block, y = act(x W1 + b1) W2 + b2 + x, as jax_hopper.dense
    (bias, activation and residual fused into the kernel; our kernel forced) and as
    jax_hopper.mlp (the same, plus act' fused into the backward pass's dh product)
    against the same block in plain jnp (XLA fuses what it can into cuBLASLt's
    epilogues). Forward alone, a training step (gradients of all parameters), the
    forward's parts one by one (each dense with its epilogue, each product with no
    epilogue: what the fused epilogue costs on top of the plain kernel) and the
    backward form alone (`only`: the names of the steps to run, default all). Kernel
    time (all kernels of the call) and sustained."""
    dtype = DTYPES[dtype_name]
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (tokens, d_model), jnp.float32).astype(dtype)
    params = ((jax.random.normal(keys[1], (d_model, d_ff), jnp.float32) / d_model**0.5).astype(dtype),
              (0.1 * jax.random.normal(keys[2], (d_ff,), jnp.float32)).astype(dtype),
              (jax.random.normal(keys[3], (d_ff, d_model), jnp.float32) / d_ff**0.5).astype(dtype),
              (0.1 * jax.random.normal(keys[4], (d_model,), jnp.float32)).astype(dtype))
    act = ACTIVATION_FNS[activation]
    pre = x @ params[0] + params[1]  # the first layer's pre-activation (the backward form's z)
    hidden = act(pre)  # the second dense's input, for its own rows

    def block(x, p):
        h = jax_hopper.dense(x, p[0], p[1], activation=activation)
        return jax_hopper.dense(h, p[2], p[3], residual=x)

    def mlp_op(x, p):
        return jax_hopper.mlp(x, p[0], p[1], p[2], p[3], activation=activation, residual=x)

    def plain(x, p):
        return act(x @ p[0] + p[1]) @ p[2] + p[3] + x

    def train(block, with_dx=False):
        # 0.5 * sum(y^2): dy = y, unit scale (a mean would scale dy by 1/(tokens d_model),
        # below the 16-bit range, and compare underflow with underflow). with_dx: the
        # input's gradient too, as a block inside a network needs (one more product).
        return jax.grad(lambda x, p: 0.5 * jnp.sum(block(x, p).astype(jnp.float32) ** 2),
                        argnums=(0, 1) if with_dx else 1)

    # step: ({variant: function}, first argument, products in the step). "jax_hopper" forces
    # our kernel on every product, the backward ones included (the policy is read while
    # jit traces, the derivative too); "jax_hopper auto" is what a user gets by default:
    # the dispatcher's choice for each product.
    dense1 = lambda xh, p: jax_hopper.dense(xh[0], p[0], p[1], activation=activation)  # noqa: E731
    dense2 = lambda xh, p: jax_hopper.dense(xh[1], p[2], p[3], residual=xh[0])  # noqa: E731
    steps = {
        "forward": ({"jax_hopper": _kernel_forced(block), "jax_hopper auto": _auto(block), "jnp": plain}, x, 2),
        "train": ({"jax_hopper": _kernel_forced(train(block)), "jax_hopper auto": _auto(train(block)),
                   "jnp": train(plain)}, x, 5),  # + dW2, dh and dW1 (no gradient for x)
        "train mlp op": ({"jax_hopper": _kernel_forced(train(mlp_op)), "jax_hopper auto": _auto(train(mlp_op)),
                          "jnp": train(plain)}, x, 5),
        # A block inside a network: + dx = dz1 W1^T, a sixth product in both.
        "train mlp op with dx": ({"jax_hopper": _kernel_forced(train(mlp_op, True)),
                                  "jax_hopper auto": _auto(train(mlp_op, True)), "jnp": train(plain, True)}, x, 6),
        # The saved-derivative form: the forward saves act'(z1) instead of z1 (the
        # derivative kind where the dispatcher picks it), the backward multiplies.
        "train mlp op saved act'": ({"jax_hopper": _saved_derivative(activation, _kernel_forced(train(mlp_op))),
                                     "jax_hopper auto": _saved_derivative(activation, _auto(train(mlp_op))),
                                     "jnp": train(plain)}, x, 5),
        # The dispatcher's choice of form against z1 kept, interleaved in one process (the
        # A/B of a saved-derivative rule: the two differ only where the rule runs).
        "train mlp op auto vs z1 kept": ({"jax_hopper auto": _auto(train(mlp_op)),
                                          "auto, z1 kept": _saved_derivative(None, _auto(train(mlp_op))),
                                          "jnp": train(plain)}, x, 5),
        # The multiply alone: dz1 = (dy W2^T) * act'(z1) with act'(z1) saved (our backward
        # form with no activation; jnp: the product, then a multiply pass).
        "dz1 times saved act'": ({"jax_hopper": lambda dz, p: fused_activation_grad(dz[0], p[2], dz[1],
                                                                                    activation=None),
                                  "jnp": lambda dz, p: activation_grad_like_jnp(dz[0], p[2], dz[1],
                                                                                activation=None)},
                                 (x, activation_derivative(pre, activation)), 1),
        # dz1 = (dy W2^T) * act'(z1): the backward form (one launch) against jnp's product and
        # elementwise pass; x stands in for dy (same shape, unit scale), z1 is the real one.
        "dz1 backward form": ({"jax_hopper": lambda dz, p: fused_activation_grad(dz[0], p[2], dz[1],
                                                                                 activation=activation),
                               "jnp": lambda dz, p: activation_grad_like_jnp(dz[0], p[2], dz[1],
                                                                             activation=activation)},
                              (x, pre), 1),
        # The same two with the first layer's bias gradient db1 = sum of dz1's rows: summed
        # in our epilogue (XLA adding the M/64 partial rows), against jnp's product and one
        # pass computing dz1 and db1.
        "dz1 and db1 times saved act'": (
            {"jax_hopper": lambda dz, p: fused_activation_grad(dz[0], p[2], dz[1], activation=None, bias_grad=True),
             "jnp": lambda dz, p: _and_row_sum(activation_grad_like_jnp(dz[0], p[2], dz[1], activation=None))},
            (x, activation_derivative(pre, activation)), 1),
        "dz1 and db1 backward form": (
            {"jax_hopper": lambda dz, p: fused_activation_grad(dz[0], p[2], dz[1], activation=activation,
                                                               bias_grad=True),
             "jnp": lambda dz, p: _and_row_sum(activation_grad_like_jnp(dz[0], p[2], dz[1], activation=activation))},
            (x, pre), 1),
        # act(z1) and act'(z1) of z1 = x W1 + b1: the derivative kind (one launch, both from
        # the f32 z1) against jnp's product and one pass computing both.
        "dense1 act and act'": ({"jax_hopper": lambda xh, p: fused_dense_with_derivative(xh[0], p[0], p[1],
                                                                                         activation=activation),
                                 "jnp": lambda xh, p: activation_with_derivative(xh[0] @ p[0] + p[1], activation)},
                                (x, hidden), 1),
        "dense1 bias+act": ({"jax_hopper": _kernel_forced(dense1), "jax_hopper auto": _auto(dense1),
                                       "jnp": lambda xh, p: act(xh[0] @ p[0] + p[1])}, (x, hidden), 1),
        "dense2 bias+resid": ({"jax_hopper": _kernel_forced(dense2),
                               "jnp": lambda xh, p: xh[1] @ p[2] + p[3] + xh[0]}, (x, hidden), 1),
        "x@W1 no epilogue": ({"jax_hopper": _kernel_forced(lambda xh, p: jax_hopper.matmul(xh[0], p[0])),
                              "jnp": lambda xh, p: xh[0] @ p[0]}, (x, hidden), 1),
        "h@W2 no epilogue": ({"jax_hopper": _kernel_forced(lambda xh, p: jax_hopper.matmul(xh[1], p[2])),
                              "jnp": lambda xh, p: xh[1] @ p[2]}, (x, hidden), 1),
    }
    rows = []
    unknown = set(only or ()) - set(steps)
    if unknown:
        raise SystemExit(f"unknown --mlp-steps {sorted(unknown)}; choose from {sorted(steps)}")
    for step, (fns, first, products) in steps.items():
        if only and step not in only:
            continue
        meta = {"batch": 0, "m": tokens, "n": d_ff, "k": d_model, "layout": f"mlp {step} [{activation}]",
                "dtype": dtype_name}
        rows += _time_variants(fns, first, params, 2.0 * tokens * d_model * d_ff * products, meta, progress)
    return rows


def _policy(policy, f):
    def run(*args):
        with jax_hopper.dispatch(policy):  # read while jit traces (the derivative included)
            return f(*args)
    return run


def _saved_derivative(activation, f):
    """f with exactly `activation` (None: no activation) saving act'(z1) on either path."""
    def run(*args):
        with _dispatch.saved_derivative(() if activation is None else {activation}):  # read while jit traces
            return f(*args)
    return run


def _and_row_sum(dz):
    """(dz, db) as jnp's backward pass computes db from its 16-bit dz."""
    return dz, row_sum(dz, dz.dtype)


def _kernel_forced(f):
    return _policy("kernel", f)


def _auto(f):
    """What a user gets by default, whatever JAX_HOPPER_DISPATCH this process has."""
    return _policy("auto", f)


def kernel_breakdown(fn, args, samples):
    """The kernels one call of jitted `fn` launches, in launch order, as [(name, ms)]: each
    kernel's CUPTI time, median over `samples` calls (the per-op breakdown of a step)."""
    from jax.experimental.mosaic.gpu import profiler

    measure = profiler.measure(fn, aggregate=False)
    measure(*args)  # warm-up
    runs = [measure(*args)[1] or [] for _ in range(samples)]
    sequences = collections.Counter(tuple(name for name, _ in r) for r in runs)
    names = list(sequences.most_common(1)[0][0])  # the usual launch sequence, should one call differ
    runs = [r for r in runs if [name for name, _ in r] == names]
    return [(short_kernel_name(name), statistics.median(r[i][1] for r in runs)) for i, name in enumerate(names)]


def short_kernel_name(name: str) -> str:
    """Our kernels by kind number (mangled C++ otherwise), everything else as named."""
    kind = re.search(r"jax_hopper.*KernelKindE(\d+)", name)
    return f"jax_hopper gemm_kernel kind {kind.group(1)}" if kind else name[:72]


def print_breakdown(step, breakdown, file=None):
    print(f"kernels of {step} (CUPTI, median per kernel):", file=file)
    for variant, kernels in breakdown.items():
        total = sum(ms for _, ms in kernels)
        print(f"  {variant} ({len(kernels)} kernels, {total:.4f} ms)", file=file)
        for name, ms in kernels:
            print(f"    {ms:8.4f}  {name}", file=file)


def _time_variants(fns, first, params, flops, meta, progress, auto_path=None):
    """Rows for variants {name: f(first, params)} of one step, "jnp" the baseline: the
    relative error of each output against jnp's, kernel time (samples interleaved) and
    sustained time. auto_path: the dispatcher's (path, rule) for "jax_hopper auto"."""
    paths = {"jax_hopper": ("kernel", "forced"), "jax_hopper auto": auto_path}
    variants = [JaxVariant(name, fn) for name, fn in fns.items()]
    ref = jax.tree.leaves(next(v for v in variants if v.name == "jnp").fn(first, params))  # jitted, as timed
    errors = {}
    for v in variants:
        out = jax.tree.leaves(v.fn(first, params))
        errors[v.name] = max(float(jnp.linalg.norm(o.astype(jnp.float32) - r.astype(jnp.float32)) /
                                   jnp.linalg.norm(r.astype(jnp.float32))) for o, r in zip(out, ref))
    kernel = {v.name: [] for v in variants}
    for v in variants:
        v.kernel_ms(first, params)
    for _ in range(KERNEL_SAMPLES):
        for v in variants:
            kernel[v.name].append(v.kernel_ms(first, params))
        progress()
    kernel_med = {n: statistics.median(ts) for n, ts in kernel.items()}
    sustained_rounds_ms = sustained_rounds(
        {v.name: functools.partial(sustained_ms, v, [(first, params)], kernel_med[v.name]) for v in variants})
    sustained = sustained_mean(sustained_rounds_ms)
    breakdown = {}
    if BREAKDOWN and all(v.clock == "cupti" for v in variants):
        breakdown = {v.name: kernel_breakdown(v.fn, (first, params), KERNEL_SAMPLES) for v in variants}
        print_breakdown(f"{meta['layout']} {meta['dtype']}", breakdown)
    return [{
        **meta, "variant": v.name, "clock": v.clock, "kernel_ms": kernel_med[v.name],
        **({"kernels": breakdown[v.name]} if breakdown else {}),
        "kernel_tflops": flops / kernel_med[v.name] / 1e9,
        "kernel_ratio_vs_jnp": kernel_med["jnp"] / kernel_med[v.name],
        "kernel_spread_ms": [min(kernel[v.name]), max(kernel[v.name])],
        "sustained_ms": sustained[v.name], "sustained_tflops": flops / sustained[v.name] / 1e9,
        "sustained_ratio_vs_jnp": sustained["jnp"] / sustained[v.name],
        "sustained_rounds_ms": sustained_rounds_ms[v.name],
        "rel_error": errors[v.name] if v.name != "jnp" else None, "input_sets": 1,
        "path": (paths.get(v.name) or (None, None))[0], "rule": (paths.get(v.name) or (None, None))[1],
    } for v in variants]


def bench_dense(tokens, d_in, d_out, dtype_name, activation, progress):
    """One dense layer, act(x W + b), as jax_hopper.dense (our fused kernel forced, and
    the dispatcher's choice) against plain jnp (XLA fuses the bias and what it can of
    the activation into cuBLASLt's epilogue). The evidence for the dispatcher's fused-
    activation rule."""
    dtype = DTYPES[dtype_name]
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (tokens, d_in), jnp.float32).astype(dtype)
    params = ((jax.random.normal(keys[1], (d_in, d_out), jnp.float32) / d_in**0.5).astype(dtype),
              (0.1 * jax.random.normal(keys[2], (d_out,), jnp.float32)).astype(dtype))
    act = ACTIVATION_FNS[activation]
    ours = lambda x, p: jax_hopper.dense(x, p[0], p[1], activation=activation)  # noqa: E731
    fns = {"jax_hopper": _kernel_forced(ours), "jax_hopper auto": _auto(ours),
           "jnp": lambda x, p: act(x @ p[0] + p[1])}  # as a user writes it (jax.nn.gelu etc. on the 16-bit sum)
    meta = {"batch": 0, "m": tokens, "n": d_out, "k": d_in, "layout": f"dense bias+{activation or 'linear'}",
            "dtype": dtype_name}
    problem = _dispatch.problem_of((tokens, d_in), (d_in, d_out), dtype, dtype, False, False)
    return _time_variants(fns, x, params, 2.0 * tokens * d_in * d_out, meta, progress,
                          auto_path=_dispatch.choose_dense(problem, activation, policy="auto"))


def bench_lm_head(tokens, d_model, vocab, dtype_name, progress):
    """A language model's output layer as mixed-precision models write it: 16-bit hidden
    states h and weights W, f32 logits (``preferred_element_type=f32``), mean cross-entropy
    against random labels. The loss alone and a training step (gradients of h and W, whose
    cotangent is f32: the backward products take it against a 16-bit operand), through
    jax_hopper.dot (the dispatcher's choice, and our kernel forced) against jnp.dot."""
    dtype = DTYPES[dtype_name]
    keys = jax.random.split(jax.random.key(3), 3)
    h = jax.random.normal(keys[0], (tokens, d_model), jnp.float32).astype(dtype)
    params = ((jax.random.normal(keys[1], (d_model, vocab), jnp.float32) / d_model**0.5).astype(dtype),
              jax.random.randint(keys[2], (tokens,), 0, vocab))

    def loss(dot):
        def run(h, p):
            logits = dot(h, p[0], preferred_element_type=jnp.float32)
            picked = jnp.take_along_axis(logits, p[1][:, None], axis=-1)[:, 0]
            return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)
        return run

    def train(dot):  # gradients of h and W (not of the integer labels)
        return lambda h, p: jax.grad(lambda h, w: loss(dot)(h, (w, p[1])), argnums=(0, 1))(h, p[0])

    problem = _dispatch.problem_of((tokens, d_model), (d_model, vocab), dtype, jnp.float32, False, False)
    auto_path = _dispatch.choose(problem, policy="auto")
    rows = []
    for step, fn, products in (("forward", loss, 1), ("train", train, 3)):
        fns = {"jax_hopper": _kernel_forced(fn(jax_hopper.dot)), "jax_hopper auto": _auto(fn(jax_hopper.dot)),
               "jnp": fn(jnp.dot)}
        meta = {"batch": 0, "m": tokens, "n": vocab, "k": d_model, "layout": f"lm head {step} [f32 logits]",
                "dtype": dtype_name}
        rows += _time_variants(fns, h, params, 2.0 * tokens * d_model * vocab * products, meta, progress,
                               auto_path=auto_path)
    return rows


def bench_chain(size, length, dtype_name, progress):
    """The host side per call: one jitted program of `length` dependent products
    x <- x @ W_i (size^3 each, so every kernel waits for the previous one), ours (kernel
    forced, and the dispatcher's choice) against jnp.dot. Kernel time is the sum of the
    chain's kernels (CUPTI); sustained time is wall time over back-to-back calls, so
    where the kernels are short it shows what each product costs the host (the FFI
    handler: tensor maps, the ticket counter's memset, the launch) -- the part the
    other modes cannot see, because there one Python dispatch per product dominates."""
    dtype = DTYPES[dtype_name]
    keys = jax.random.split(jax.random.key(2), length + 1)
    x = jax.random.normal(keys[0], (size, size), jnp.float32).astype(dtype)
    # Unit-variance weights over sqrt(size) keep x at unit variance down the chain.
    weights = tuple((jax.random.normal(kk, (size, size), jnp.float32) / size**0.5).astype(dtype)
                    for kk in keys[1:])

    def chain(dot):
        def run(x, ws):
            for w in ws:
                x = dot(x, w)
            return x
        return run

    ours = chain(jax_hopper.matmul)
    fns = {"jax_hopper": _kernel_forced(ours), "jax_hopper auto": _auto(ours), "jnp": chain(jnp.dot)}
    meta = {"batch": 0, "m": size, "n": size, "k": size, "layout": f"chain of {length}", "dtype": dtype_name}
    problem = _dispatch.problem_of((size, size), (size, size), dtype, dtype, False, False)
    rows = _time_variants(fns, x, weights, 2.0 * length * size**3, meta, progress,
                          auto_path=_dispatch.choose(problem, policy="auto"))
    for r in rows:  # per product, in microseconds
        r["kernel_us_per_product"] = r["kernel_ms"] * 1e3 / length
        r["sustained_us_per_product"] = r["sustained_ms"] * 1e3 / length
    return rows


def plot(rows, path):
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


def main(argv=None):
    global KERNEL_SAMPLES, SUSTAINED_ROUNDS, BREAKDOWN, COLD_L2  # the protocol, set from the command line
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="8192,4096", help="comma-separated N (cube) or MxNxK")
    p.add_argument("--dtype", default="f16", help="comma-separated: f16, bf16")
    p.add_argument("--layouts", default="nn", help="comma-separated operand layouts: nn (jnp.dot's), nt, tn, tt")
    p.add_argument("--batched", default="", help="comma-separated BxMxNxK batched products (NN layout)")
    p.add_argument("--stages", default="4", help="comma-separated pipeline depths of the seed's V5 kernel to time "
                   "(2, 3, 4 are compiled for f16; 4 for bf16); empty for none")
    p.add_argument("--kernels", default="", help="comma-separated extra kernel kinds to time (NN; f16, and bf16 "
                   "for small_m), e.g. the default's ablations persistent_basic,persistent_tma,persistent_immediate,"
                   "persistent_static,persistent_wait0")
    p.add_argument("--samples", type=int, default=KERNEL_SAMPLES, help="kernel-time samples per variant (median)")
    p.add_argument("--rounds", type=int, default=SUSTAINED_ROUNDS, help="sustained-throughput rounds (mean; even: "
                   "they pair up in mirrored orders), after "
                   f"{SUSTAINED_SETTLE_ROUNDS} untimed settling round(s)")
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
                   "'train,dz1 backward form'")
    p.add_argument("--dense", default="", help="comma-separated TOKENSxINxOUT dense layers act(x W + b): our fused "
                   "kernel and the dispatcher's choice vs plain jnp, for each of --activations")
    p.add_argument("--activations", default="gelu_tanh", help="comma-separated activations for --dense: none, relu, "
                   "gelu_tanh, gelu_exact, silu")
    p.add_argument("--breakdown", action="store_true", help="for --mlp and --dense steps, also time each "
                   "variant's kernels one by one (CUPTI, median per kernel) and print them")
    p.add_argument("--lm-head", default="", help="comma-separated TOKENSxDMODELxVOCAB output layers: 16-bit "
                   "h and W, f32 logits, cross-entropy; the loss and its training step (gradients of h and W)")
    p.add_argument("--chain", default="", help="comma-separated sizes N: one jitted chain of --chain-length "
                   "dependent NxNxN products, ours vs jnp.dot; with short kernels its sustained time is the "
                   "host's cost per product")
    p.add_argument("--chain-length", type=int, default=32, help="products per --chain program")
    p.add_argument("--json", help="write all rows to this JSON file")
    p.add_argument("--plot", help="write a PNG bar chart of TF/s per case to this file")
    args = p.parse_args(argv)

    shapes = [parse_shape(s) for s in (SWEEP_SHAPES if args.sweep else args.shapes).split(",") if s]
    layouts = args.layouts.split(",")
    cases = [(0, *s, lay) for s in shapes for lay in layouts]
    if args.sweep:
        cases += [(0, 8192, 8192, 8192, lay) for lay in ("nt", "tn") if lay not in layouts]
    for text in filter(None, args.batched.split(",")):
        b, m, n, k = (int(x) for x in text.lower().split("x"))
        cases.append((b, m, n, k, "nn"))
    dtypes = args.dtype.split(",")
    stages = [int(s) for s in args.stages.split(",") if s]
    KERNEL_SAMPLES, SUSTAINED_ROUNDS = max(args.samples, 1), max(args.rounds, 1)
    BREAKDOWN = args.breakdown
    COLD_L2 = args.l2 == "cold"
    kernels = [x for x in args.kernels.split(",") if x]
    unknown = sorted(set(kernels) - set(KERNELS))
    if unknown:
        p.error(f"unknown --kernels {unknown}; choose from {sorted(KERNELS)}")
    activations = [None if a == "none" else a for a in args.activations.split(",") if a]
    if set(activations) - set(ACTIVATION_FNS):
        p.error(f"unknown --activations {sorted(set(activations) - set(ACTIVATION_FNS))}")
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind}  jax {jax.__version__}  platform {dev.platform}", flush=True)
    if dev.platform != "gpu":
        print("warning: no GPU; these numbers time the fallback", flush=True)
    elif not jax_hopper.kernel_available():
        # Every "jax_hopper" or "kernel" row would time XLA's dot under our name: this
        # happened once, from a repository checkout, whose jax_hopper has no extension.
        raise SystemExit(f"jax_hopper's kernel is not available here ({_ffi.missing_kernel_reason()}; imported "
                         f"from {jax_hopper.__file__}): the benchmark would time XLA's dot under our name. Run it "
                         f"outside the source tree, with the package installed.")

    rows = []

    def save_json():  # after every case too, so a run cut short keeps what it measured
        if args.json:
            meta = {"device": dev.device_kind, "jax": jax.__version__,
                    "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                    "protocol": {"kernel_samples": KERNEL_SAMPLES, "sustained_rounds": SUSTAINED_ROUNDS,
                                 "sustained_preheat": SUSTAINED_PREHEAT, "sustained_order": "mirrored pairs, rotated",
                                 "sustained_statistic": "mean",
                                 "sustained_settle_rounds": SUSTAINED_SETTLE_ROUNDS,
                                 "kernel_time_l2": "cold" if COLD_L2 else "warm",
                                 # what was left out of each cold call's time (None: never learned)
                                 "l2_scrub_kernels": list(_l2_scrub_kernels) if COLD_L2 and _l2_scrub_kernels
                                 else None}}
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)

    jobs = [(c, d) for c in cases for d in dtypes]
    for idx, ((batch, m, n, k, layout), d) in enumerate(jobs):
        done = [0]

        def progress():
            done[0] += 1
            print(f"\r[{idx + 1}/{len(jobs)}] {batch}x{m}x{n}x{k} {layout} {d}: round {done[0]}", end="",
                  file=sys.stderr, flush=True)

        shape_rows = bench_case(batch, m, n, k, layout, d, stages, not args.no_torch, progress, kernels)
        print(file=sys.stderr)
        print_table(shape_rows)
        sys.stdout.flush()
        rows.extend(shape_rows)
        save_json()

    mlp_activations = [a.strip() for a in args.mlp_activations.split(",") if a.strip()]
    bad = sorted(set(mlp_activations) - {a for a in ACTIVATION_FNS if a})
    if bad:
        p.error(f"unknown --mlp-activations {bad}")
    mlp_steps = [x.strip() for x in args.mlp_steps.split(",") if x.strip()]
    for text in filter(None, args.mlp.split(",")):
        tokens, d_model, d_ff = (int(x) for x in text.lower().split("x"))
        for d in dtypes:
            for activation in mlp_activations:
                mlp_rows = bench_mlp(tokens, d_model, d_ff, d,
                                     lambda: print(".", end="", file=sys.stderr, flush=True), activation, mlp_steps)
                print(file=sys.stderr)
                print_table(mlp_rows)
                rows.extend(mlp_rows)
                save_json()

    for text in filter(None, args.dense.split(",")):
        tokens, d_in, d_out = (int(x) for x in text.lower().split("x"))
        for d in dtypes:
            for act in activations:
                dense_rows = bench_dense(tokens, d_in, d_out, d, act,
                                         lambda: print(".", end="", file=sys.stderr, flush=True))
                print(file=sys.stderr)
                print_table(dense_rows)
                rows.extend(dense_rows)
                save_json()

    for text in filter(None, args.lm_head.split(",")):
        tokens, d_model, vocab = (int(x) for x in text.lower().split("x"))
        for d in dtypes:
            head_rows = bench_lm_head(tokens, d_model, vocab, d,
                                      lambda: print(".", end="", file=sys.stderr, flush=True))
            print(file=sys.stderr)
            print_table(head_rows)
            rows.extend(head_rows)
            save_json()

    for size in (int(t) for t in filter(None, args.chain.split(","))):
        for d in dtypes:
            chain_rows = bench_chain(size, args.chain_length, d,
                                     lambda: print(".", end="", file=sys.stderr, flush=True))
            print(file=sys.stderr)
            print_table(chain_rows)
            for r in chain_rows:
                print(f"  {r['variant']:16s} per product: kernel {r['kernel_us_per_product']:7.2f} us, "
                      f"sustained {r['sustained_us_per_product']:7.2f} us")
            rows.extend(chain_rows)
            save_json()

    for idx, text in enumerate(filter(None, args.tp_mlp.split(","))):
        tokens, d_model, d_ff = (int(x) for x in text.lower().split("x"))
        for d in dtypes:
            tp_rows = bench_tp_mlp(tokens, d_model, d_ff, d, args.devices,
                                   lambda: print(".", end="", file=sys.stderr, flush=True))
            print(file=sys.stderr)
            print_table(tp_rows)
            rows.extend(tp_rows)
            save_json()

    print("\nsummary")
    print_table(rows)
    print_geometric_means(rows)
    if args.plot:
        plot(rows, args.plot)
    save_json()


if __name__ == "__main__":
    main()
