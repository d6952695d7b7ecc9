"""How the benchmark times: input sets, kernel time, the cold-L2 scrub, sustained rounds
and their statistics, all set by one frozen Protocol.

Kernel time is the device time of the kernels one call launches, read through CUPTI by
jax.experimental.mosaic.gpu.profiler.measure (CUDA events for torch). measure's own
untimed call on the same inputs leaves them in L2 as far as they fit, unless the protocol
asks for a cold L2: then a scrub evicts them before each timed call. Sustained throughput
is back-to-back async dispatches, where the chip meets its power limit: each loop after
an untimed pre-heat of the same variant, after untimed rounds that let the chip settle
under the load; rounds in mirrored pairs, the order rotating from pair to pair, and the
mean over rounds, so neither the drift of the clock nor the variant before a loop favours
any variant. Medians for kernel time, means for sustained time.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re
import statistics
import time

import jax
import jax.numpy as jnp

L2_BYTES = 60 * 2**20  # H200


@dataclasses.dataclass(frozen=True)
class Protocol:
    """Every setting of the timing protocol; recorded in each results file."""

    kernel_samples: int = 15  # kernel-time samples per variant (median)
    # Rounds come in pairs, the second in the reverse order of the first
    # (sustained_rounds): keep this even.
    sustained_rounds: int = 4
    # Untimed rounds before the timed ones. The kernel-time samples leave the chip cool and
    # at its top clock; the first sustained loop after them runs 1.2-3.1% faster than the
    # same dot in later rounds (tools/probe_sustained_order.py: 1965-1980 MHz, 47-54 C
    # before it, 1395-1470 MHz, 57-66 C before the rest), and the pre-heat alone is too
    # short to settle it. Without a settling round that loop is always the first
    # variant's, and the dispatcher's XLA path reads ~1% faster than jnp.dot, the same dot.
    sustained_settle_rounds: int = 1
    sustained_seconds: float = 0.4  # target length of one sustained loop
    sustained_min_iters: int = 20
    sustained_max_iters: int = 2000
    # Untimed load before each sustained loop, as a fraction of it: the power limiter's
    # clock follows the recent load, so without it a loop inherits the clock the variant
    # before it left (two runs of the same XLA dot differ by ~4% at 4096^3 by order).
    sustained_preheat: float = 0.5
    # "warm": as profiler.measure's untimed call leaves L2. "cold": each timed call is
    # dispatched right after one that reads an l2_scrub_bytes buffer (L2Scrub), whose
    # kernels are left out of the time -- what a model's decode step sees, streaming its
    # weights from DRAM. torch's column (CUDA events) stays warm.
    kernel_time_l2: str = "warm"
    l2_bytes: int = L2_BYTES
    l2_scrub_bytes: int = 2 * L2_BYTES
    # Distinct input sets, used in rotation: enough that together they fill this many
    # times L2, at least 2, at most max_input_sets.
    input_sets_l2_multiple: int = 3
    max_input_sets: int = 64
    torch_burst: int = 10  # torch calls between two CUDA events (TorchVariant)
    breakdown: bool = False  # also each variant's kernels, one by one (layer steps)

    def __post_init__(self):
        if self.kernel_time_l2 not in ("warm", "cold"):
            raise ValueError(f"kernel_time_l2 must be 'warm' or 'cold', got {self.kernel_time_l2!r}")
        if self.kernel_samples < 1 or self.sustained_rounds < 1 or self.sustained_settle_rounds < 0:
            raise ValueError(f"a protocol needs at least one sample and one round: {self}")
        if not self.sustained_seconds > 0:
            raise ValueError(f"sustained_seconds must be positive, got {self.sustained_seconds}")

    @property
    def cold_l2(self) -> bool:
        return self.kernel_time_l2 == "cold"

    def as_json(self, scrub: L2Scrub | None = None) -> dict:
        """The settings, the statistics they feed, and (cold L2) the scrub's kernel names
        left out of each call's time (None until learned)."""
        return {**dataclasses.asdict(self), "kernel_statistic": "median",
                "sustained_order": "mirrored pairs, rotated", "sustained_statistic": "mean",
                "l2_scrub_kernels": list(scrub.kernels) if scrub is not None and scrub.kernels else None}


class Progress:
    """What a run reports while it times: steps announced (`expect`) and done (`advance`).
    This one reports nothing; the CLI's draws a progress bar."""

    def expect(self, steps: int) -> None:
        pass

    def advance(self) -> None:
        pass


# ---- inputs -------------------------------------------------------------------------
def make_inputs(a_shape, b_shape, k, dtype, n_sets, seed=0):
    """n_sets (a, b) pairs of the seed benchmark's data: standard normal scaled by
    K^-1/4, so C has unit variance."""
    scale = 1.0 / k**0.25
    sets = []
    for i in range(n_sets):
        ka, kb = jax.random.split(jax.random.key(seed + i))
        a = (jax.random.normal(ka, a_shape, jnp.float32) * scale).astype(dtype)
        b = (jax.random.normal(kb, b_shape, jnp.float32) * scale).astype(dtype)
        sets.append((a, b))
    jax.block_until_ready(sets)
    return sets


def input_set_count(a_shape, b_shape, itemsize, protocol: Protocol) -> int:
    set_bytes = (math.prod(a_shape) + math.prod(b_shape)) * itemsize
    wanted = math.ceil(protocol.input_sets_l2_multiple * protocol.l2_bytes / set_bytes)
    return max(2, min(protocol.max_input_sets, wanted))


# ---- the cold-L2 scrub ----------------------------------------------------------------
# One program for every variant; a reduction, so nothing but one word is written. Reads
# only: a scrub that rewrote its buffer would leave L2 full of dirty lines, written back
# to DRAM under the timed kernel (16x8192x8192: 42.3 us against 36 us end to end in
# tools/decode_timeline.cu, whose scrub reads; ncu's flush: 39.2).
read_l2_scrub = jax.jit(lambda buf: jax.lax.reduce(buf, jnp.uint32(0), jax.lax.bitwise_xor, (0,)))


class L2Scrub:
    """The cold-L2 protocol's state for one run: the buffer a scrub reads (allocated on
    first use) and the names of the scrub program's kernels (learned once)."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self._buffer = None
        self.kernels: tuple[str, ...] | None = None

    def buffer(self):
        if self._buffer is None:
            self._buffer = jnp.zeros(self.nbytes // 4, jnp.uint32)
        return self._buffer

    def __call__(self):
        return read_l2_scrub(self.buffer())

    def kernel_names(self, measure) -> tuple[str, ...]:
        """The scrub's kernels, in launch order, as `measure` (jax's profiler.measure)
        lists them; learned the first time."""
        if self.kernels is None:
            _, timings = measure(read_l2_scrub, aggregate=False)(self.buffer())
            if not timings:
                raise RuntimeError("--l2 cold: the scrub launched no kernel")
            self.kernels = tuple(name for name, _ in timings)
        return self.kernels


class AfterL2Scrub:
    """jitted fn, each call dispatched after a separate call that reads the scrub buffer,
    so on the device's stream the product starts with L2 holding only clean lines of it.
    profiler.measure takes it for an already-jitted function (jax.stages.Wrapped is a
    runtime-checkable protocol) and calls it as it is, so both dispatches fall in its
    timed window, in stream order; one jitted program instead would leave XLA free to run
    the two independent ops in either order, or together."""

    def __init__(self, fn, scrub: L2Scrub):
        self.fn = fn if isinstance(fn, jax.stages.Wrapped) else jax.jit(fn)  # a variant's own: compiled once
        self.scrub = scrub
        if not isinstance(self, jax.stages.Wrapped):  # measure would jit both into one program
            raise RuntimeError("--l2 cold: profiler.measure would not take the scrub and the product as two calls")

    def __call__(self, *args):
        self.scrub()
        return self.fn(*args)

    def trace(self, *args, **kwargs):
        return self.fn.trace(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self.fn.lower(*args, **kwargs)


def without_l2_scrub(timings, scrub_kernels):
    """The [(kernel, ms)] of a scrubbed call less the scrub's kernels, which come first."""
    n = len(scrub_kernels)
    if n == 0 or tuple(name for name, _ in timings[:n]) != tuple(scrub_kernels):
        raise RuntimeError(f"--l2 cold: the first kernels are not the L2 scrub's {list(scrub_kernels)}: "
                           f"{[name for name, _ in timings]}")
    return timings[n:]


# ---- variants -------------------------------------------------------------------------
class JaxVariant:
    """A jitted function timed by CUPTI (profiler.measure), or by the wall clock around one
    blocked call where CUPTI is not there (the CPU fallback). With `scrub`, each timed call
    follows an L2 scrub whose kernels are left out."""

    def __init__(self, name, fn, scrub: L2Scrub | None = None):
        self.name = name
        self.fn = jax.jit(fn)
        self.scrub = scrub
        try:
            from jax.experimental.mosaic.gpu import profiler

            self._profiler = profiler
            if scrub is not None:
                self._measure = profiler.measure(AfterL2Scrub(self.fn, scrub), aggregate=False)
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
                if self.scrub is not None:
                    _, timings = self._measure(*args)
                    scrub = self.scrub.kernel_names(self._profiler.measure)
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

    def dispatch(self, *args):
        return self.fn(*args)

    def sync(self, out):
        jax.block_until_ready(out)


class TorchVariant:
    """torch.matmul (cuBLAS directly) on the same device buffers, shared through dlpack.

    Its kernel time is read with CUDA events around `burst` back-to-back calls, divided by
    `burst`: one call between two events on an idle GPU also times the launch latency.
    """

    name = "torch.matmul"
    clock = "cuda-events"

    def __init__(self, torch, transpose_a, transpose_b, burst):
        self.torch = torch
        self.ta, self.tb = transpose_a, transpose_b
        self.burst = burst

    def convert(self, sets):
        def view(x, t):  # a transposed view: cuBLAS reads it in place
            x = self.torch.from_dlpack(x)
            return x.transpose(-1, -2) if t else x

        return [(view(a, self.ta), view(b, self.tb)) for a, b in sets]

    def kernel_ms(self, a, b) -> float:
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.burst):
            torch.matmul(a, b)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / self.burst

    def dispatch(self, a, b):
        return self.torch.matmul(a, b)

    def sync(self, out):
        self.torch.cuda.synchronize()


# ---- sustained throughput ---------------------------------------------------------------
def sustained_ms(variant, sets, kernel_ms_estimate, protocol: Protocol) -> float:
    """ms per call over back-to-back dispatches rotating through `sets`, about
    protocol.sustained_seconds long, after an untimed pre-heat of the same variant."""
    iters = int(min(protocol.sustained_max_iters,
                    max(protocol.sustained_min_iters,
                        protocol.sustained_seconds * 1e3 / max(kernel_ms_estimate, 1e-3))))
    out = None
    for i in range(max(len(sets), int(iters * protocol.sustained_preheat))):  # the dispatch path and the clock
        out = variant.dispatch(*sets[i % len(sets)])
    variant.sync(out)
    t0 = time.perf_counter()
    for i in range(iters):
        out = variant.dispatch(*sets[i % len(sets)])
    variant.sync(out)
    return (time.perf_counter() - t0) * 1e3 / iters


def sustained_rounds(timers, *, rounds: int, settle: int, progress=None) -> dict[str, list[float]]:
    """{name: sustained ms per round} for timers {name: () -> ms}: `rounds` rounds after
    `settle` untimed ones (the chip's clock and temperature settle under the load first);
    `progress()` after each timed round.

    Rounds come in pairs: round 2p runs the variants rotated by p, round 2p + 1 the same
    order reversed. Within a pair every variant's places add up to the same number, and
    the loop before each one is once its predecessor and once its successor; over an even
    number of rounds a clock that drifts linearly in time therefore moves every variant's
    mean (sustained_mean) by the same amount."""
    names = list(timers)
    for _ in range(settle):
        for name in names:
            timers[name]()
    times = {name: [] for name in names}
    for r in range(rounds):
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


# ---- one set of variants, timed side by side ----------------------------------------------
@dataclasses.dataclass(frozen=True)
class Timings:
    kernel: dict[str, list[float]]  # kernel-time samples per variant
    sustained: dict[str, list[float]]  # sustained ms per round per variant

    @functools.cached_property
    def kernel_median(self) -> dict[str, float]:
        return {name: statistics.median(xs) for name, xs in self.kernel.items()}

    @functools.cached_property
    def sustained_mean(self) -> dict[str, float]:
        return sustained_mean(self.sustained)

    def fields(self, name: str, flops: float, baseline: str) -> dict:
        """A row's time fields for variant `name`; ratios are `baseline`'s time over the
        variant's (above 1: the variant is faster)."""
        k, s = self.kernel_median, self.sustained_mean
        return {
            "kernel_ms": k[name], "kernel_tflops": flops / k[name] / 1e9,
            "kernel_ratio_vs_jnp": k[baseline] / k[name],
            "kernel_spread_ms": [min(self.kernel[name]), max(self.kernel[name])],
            "sustained_ms": s[name], "sustained_tflops": flops / s[name] / 1e9,
            "sustained_ratio_vs_jnp": s[baseline] / s[name],
            "sustained_rounds_ms": self.sustained[name],
        }


class Runner:
    """Times variants side by side under one Protocol, reporting to a Progress."""

    def __init__(self, protocol: Protocol, progress: Progress | None = None):
        self.protocol = protocol
        self.progress = progress if progress is not None else Progress()
        self.scrub = L2Scrub(protocol.l2_scrub_bytes) if protocol.cold_l2 else None

    def variant(self, name, fn) -> JaxVariant:
        return JaxVariant(name, fn, self.scrub)

    def time(self, variants, sets: dict[str, list]) -> Timings:
        """Kernel time (a warm-up call each, then samples interleaved: one of each variant
        per round, rotating through the variant's input sets) and sustained rounds."""
        p = self.protocol
        self.progress.expect(p.kernel_samples + p.sustained_rounds)
        kernel = {v.name: [] for v in variants}
        for v in variants:  # warm-up: compile, first launch, CUPTI init
            v.kernel_ms(*sets[v.name][0])
        for i in range(p.kernel_samples):
            for v in variants:
                kernel[v.name].append(v.kernel_ms(*sets[v.name][i % len(sets[v.name])]))
            self.progress.advance()
        median = {name: statistics.median(xs) for name, xs in kernel.items()}
        timers = {v.name: functools.partial(sustained_ms, v, sets[v.name], median[v.name], p) for v in variants}
        sustained = sustained_rounds(timers, rounds=p.sustained_rounds, settle=p.sustained_settle_rounds,
                                     progress=self.progress.advance)
        return Timings(kernel, sustained)

    def breakdown(self, variants, args) -> dict[str, list[tuple[str, float]]]:
        """{variant: its kernels one by one} where the protocol asks for it and CUPTI times
        every variant; else empty."""
        if not self.protocol.breakdown or not all(v.clock == "cupti" for v in variants):
            return {}
        return {v.name: kernel_breakdown(v.fn, args, self.protocol.kernel_samples) for v in variants}


# ---- kernels one by one -------------------------------------------------------------------
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
