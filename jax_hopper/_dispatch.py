"""Which path computes an eligible product: our kernel, or XLA's own dot (cuBLASLt).

The decision is made at trace time from the static problem, by a table of rules
measured on the H200 (BENCHMARKS.md, "Dispatcher"): the first rule whose condition
holds names the path. Where the table picked our kernel, it is asked again for the
product as it finally runs: batched by vmap, and on each device's shards under sharding
(kind_for_shapes). A rule exists only where a measurement backs it; the
catch-all sends a product to XLA, because on shapes our kernel has not been shown to
win, the safe answer is the one that never loses. Where the kernel cannot run (not
built, or a CUDA GPU that is not a Hopper) a pick of the kernel becomes XLA's dot
(rule "kernel-unavailable", with one warning): the table was measured on the H200, and
the kernel's stand-in elsewhere (for a fused dense layer, its f32-epilogue reference)
is slower than jnp's own computation. A product with a dimension of 2^31 or more
(KERNEL_MAX_DIM) is XLA's under every policy (rule "beyond-kernel-limits").

The policy picks how the table is used:
  "auto"    follow the table (the default);
  "kernel"  always our kernel where it applies (tests, benchmarks, experiments);
  "xla"     never our kernel.
``jax_hopper.set_dispatch(policy)`` sets it for the process (the environment variable
``JAX_HOPPER_DISPATCH`` gives the starting value); ``with jax_hopper.dispatch(policy):``
overrides it for a scope (per thread). It is read while jax traces, and it is a jax
configuration option (``jax_hopper_dispatch``) in jax's trace context and jit key, as
``jax_default_matmul_precision`` is: a function that ``jax.jit`` (or
``jax.checkpoint``, or a derivative) traced under one policy is traced again under
another, rather than keeping the paths of the first trace from jax's caches.
Derivatives: each product of a derivative is dispatched when the derivative is
traced, under the policy then in effect (so wrap ``jax.grad``, not only the forward,
in ``dispatch("kernel")`` to force every product).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable

import jax
import numpy as np
from jax._src import config as jax_config

from jax_hopper import _ffi
from jax_hopper._primitive import (
    DEFAULT_KERNEL,
    F16_ACCUMULATION_KERNEL,
    SMALL_M_KERNEL,
    TMA_ROW_MULTIPLE,
    XLA_KERNEL,
    _round_up,
)

POLICIES = ("auto", "kernel", "xla")
_ENV = "JAX_HOPPER_DISPATCH"
TMA_ROW_ALIGN_BYTES = 16  # TMA and cuBLASLt's fast kernels want 16-byte row strides


def _checked(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"dispatch policy must be one of {POLICIES}, got {policy!r}")
    return policy


# A jax configuration option, not a Python variable: jax keys its trace caches (jit's,
# jax.checkpoint's, the derivatives') on the options in its trace context, so a trace
# made under one policy is never reused under another (with a plain context variable,
# jax.checkpoint replayed an "auto" trace inside dispatch("kernel"), and jit a trace made
# under another policy: found in a review of the fuzz's transforms family). jax defines
# options through a private module only; both supported jax versions have this signature.
# It reads JAX_HOPPER_DISPATCH itself (checked first, for our error message).
def _jax_option(define: Callable, name: str, *args, **kwargs):
    """jax's option `name`, made by define(name, *args, **kwargs) once a process (a reload
    of this module finds the one made before), in jax's trace context and jit key."""
    state = jax_config.config_states.get(name)
    if state is None:
        state = define(name, *args, **kwargs, include_in_jit_key=True, include_in_trace_context=True)
    return state


_checked(os.environ.get(_ENV, "auto"))
_policy = _jax_option(
    jax_config.enum_state, _ENV.lower(), list(POLICIES), default="auto",
    help="jax_hopper's dispatch policy: auto (the measured rules), kernel (ours wherever it applies), xla (never)")


def current_policy() -> str:
    return _policy.value


def set_dispatch(policy: str) -> None:
    """Sets the dispatch policy ("auto", "kernel" or "xla") for the whole process (as
    ``jax.config.update("jax_hopper_dispatch", policy)`` does)."""
    jax.config.update(_ENV.lower(), _checked(policy))


@contextlib.contextmanager
def dispatch(policy: str):
    """``with jax_hopper.dispatch("kernel"): ...`` -- the policy for this scope only."""
    with _policy(_checked(policy)):
        yield


# The kernel's largest batch, M, N or K: its tile coordinates are int32 (cuda/gemm/gemm.cc
# kMaxDim refuses more). Past it every policy's pick is XLA's dot (rule
# "beyond-kernel-limits"), and the primitives compute through XLA (fits_kernel).
KERNEL_MAX_DIM = 2**31 - 1
BEYOND_KERNEL_LIMITS = "beyond-kernel-limits"

H200_PEAK_FLOPS = 989e12  # dense f16/bf16 tensor-core peak
H200_PEAK_BYTES_PER_S = 4.8e12  # HBM3e


@dataclasses.dataclass(frozen=True)
class Problem:
    """A product as the kernel would run it (after folding and layout planning)."""

    batch: int
    m: int
    n: int
    k: int
    itemsize: int  # of A and B
    out_itemsize: int
    transpose_a: bool
    transpose_b: bool

    @property
    def operand_rows(self) -> tuple[int, int]:
        """Stored row lengths (elements) of A and B."""
        return (self.m if self.transpose_a else self.k, self.k if self.transpose_b else self.n)

    @property
    def fits_kernel(self) -> bool:
        """Whether every dimension, and each stored row as TMA pads it, is within the
        kernel's int32 tile coordinates (cuda/gemm/gemm.cc refuses larger ones)."""
        padded_rows = (_round_up(row, TMA_ROW_MULTIPLE) for row in self.operand_rows)
        return all(d <= KERNEL_MAX_DIM for d in (self.batch, self.m, self.n, self.k, *padded_rows))

    @property
    def rows_aligned(self) -> bool:
        a_row, b_row = self.operand_rows
        return (a_row * self.itemsize % TMA_ROW_ALIGN_BYTES == 0 and b_row * self.itemsize % TMA_ROW_ALIGN_BYTES == 0
                and self.n * self.out_itemsize % TMA_ROW_ALIGN_BYTES == 0)

    @property
    def flops(self) -> float:
        return 2.0 * max(self.batch, 1) * self.m * self.n * self.k

    @property
    def compute_us(self) -> float:
        """Its time at the H200's dense f16 tensor-core peak."""
        return 1e6 * self.flops / H200_PEAK_FLOPS

    @property
    def padding_copy_us(self) -> float:
        """HBM time of the copies that pad stored rows for TMA (ops' _pad_for_tma: a row
        that is not a multiple of 8 16-bit elements), each read once and written once at
        the padded length; zero where every stored row is aligned."""
        b = max(self.batch, 1)
        a_row, b_row = self.operand_rows
        a_rows, b_rows = (self.k if self.transpose_a else self.m), (self.n if self.transpose_b else self.k)
        moved = sum(2 * b * outer * _round_up(row, TMA_ROW_MULTIPLE) * self.itemsize
                    for row, outer in ((a_row, a_rows), (b_row, b_rows)) if row % TMA_ROW_MULTIPLE)
        return 1e6 * moved / H200_PEAK_BYTES_PER_S

    @property
    def roofline_us(self) -> float:
        """The H200's lower bound on its time: the compute time or the HBM time of the
        operands and output, whichever binds."""
        b = max(self.batch, 1)
        moved = b * ((self.m * self.k + self.k * self.n) * self.itemsize + self.m * self.n * self.out_itemsize)
        return max(self.compute_us, 1e6 * moved / H200_PEAK_BYTES_PER_S)


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str
    applies: Callable[[Problem], bool]
    path: str  # "kernel" or "xla"
    evidence: str  # what was measured (BENCHMARKS.md has the tables)
    # Whether the rule also picks the path of a fused dense layer (choose_dense): False
    # where only the plain product was measured, whose epilogue the fused kind changes.
    fused_too: bool = True
    # The test for a fused dense layer's product, where it differs from `applies` (the
    # fused kinds are the default kernel's 128x256 tiles whatever kernel_for picks).
    applies_fused: Callable[[Problem], bool] | None = None


# Unaligned products below this many microseconds (of compute, or of HBM traffic for
# the decode case below) are dominated by launch and padding costs. Measured at cfd8819
# (f16 and bf16, BENCHMARKS.md "an odd K no longer copies the weight"): 1023^3 (2.2 us
# of compute) loses, 0.83-0.91x; 1279^3 (4.2 us) wins 1.25x, and every larger one
# measured wins, 1.6-3.9x: 1535^3, 2047^3-4095^3, 8191^3, 4096x4096x4095, 256 and
# 1024 x 8192 x 8191 (35 and 139 us). Since 105eeee (an odd N's output leaves through
# the deferred store) 895^3 and 1023^3 win by kernel time too, 1.22-1.28x, but lose
# dispatched one product at a time (sustained 0.65-0.98x: three launches, two of them
# padding, against cuBLASLt's one), and 767^3 loses both ways (0.88x): the threshold
# stays (BENCHMARKS.md, 2026-12-02 07:48).
MIN_UNALIGNED_KERNEL_US = 4.0

# The padding copies (Problem.padding_copy_us) may cost at most this share of the
# product's roofline time. Where B's stored rows are unaligned (jnp.dot's B [K, N] with N
# not a multiple of 8: an odd vocabulary such as GPT-2's 50257), the padding copies the
# whole weight, twice the HBM traffic of the product itself at small M. Measured at
# 1e33a4a and 72c3b75 (L2 cold; BENCHMARKS.md, session of 2026-12-04 14:23): copy / roofline
# about 2 lost to jnp.dot at every M up to 128 (1, 16, 64 x 50257 x 768 / 1600 / 4096,
# 16x32001x4096, 128x50257x4096: 0.33-0.54x; f16 and bf16), 1.61 won (256x50257x4096,
# 1.06-1.12x in two processes: left to XLA, as our time there is flat in M and XLA's grows
# with it, so the crossing lies somewhere between 128 and 256 rows), 1.07 and below won
# (384, 512, 1024 x 50257 x 4096: 1.13-1.16, 1.45, 1.80x; odd K, where only A is copied:
# 0.00-0.05, 16-256 x 8192 x 8191 and 16 x 4096 / 14336 x 4095, 1.9-3.3x; squares 1279^3
# and 1535^3: 0.64 and 0.54, 1.9 and 2.7x). Between 128 and 256 rows an odd N, forced onto
# the default kernel (copy / roofline 1.7-1.95), ran 0.974-1.178x (sessions of 2026-12-04
# 18:24 and 20:15; f16, L2 cold): it lost at 136x50257x1024 0.99, 136x128257x4096 0.997,
# 144x50257x768 0.974, and won 2-18% elsewhere (129 rows 1.02; 136-248 rows x 32001 /
# 50257 / 128257 x 1600-8192 1.03-1.18): no bound by rows, K or N separates those
# losses from the wins, so the copy bound stays and XLA keeps that band.
PADDING_COPY_MAX_SHARE = 1.25

# Past decode-sized M the default kernel runs one CTA per 128x256 output tile and splits
# no K loop. With few tiles (up to one per SM) each CTA streams a K x 256 block of B at one
# SM's pace, about 46 us at K = 4095 however many tiles (its time flat in the tiles up to
# one wave), while XLA's slow unaligned kernel takes the larger of streaming the weight
# and its arithmetic, at up to about 340 TF/s where only K is odd (past 128 rows; fewer
# at decode-sized M, and slower still where N is odd too). So the default kernel needs
# either enough distinct blocks of B's columns, batch x ceil(N / 256) (two tile rows share
# a block; past 256 rows 24 blocks are 72 tiles), or enough tiles. Measured (f16, L2 cold; sessions of
# 2026-12-04 14:23, 16:21 and 18:24), odd K, by B blocks: 16 lost (128 x 4096 x 4095 /
# 14335, 96x4096x8191, 256x4096x4095, 2x100x2048x8191: 0.83-0.93x); 24 won (128x6144x4095
# 1.25x, 256x6144x6143 1.28x, 2x100x3072x8191 1.23x, 3x200x2048x4095 1.42x); 32 won (65-128
# x 8192 x 8191 1.53-1.58x, 2x100x4096x4095 1.64x, 192 and 256 x 8192 x 8191 1.79-1.89x,
# 2x256x4096x4095 1.76x), and 56-64 (128x14336x4095 1.78x, 4x128x4096x4095 1.68x). By
# tiles, with fewer blocks: 32 lost (256x4096x4095 0.92x, 512x2048x8191 0.65x), 48 lost or
# tied (1024x1536x4095 0.79-0.82x, 448x3072x4095 0.92-0.94x, 320 and 384 x 4096 x 4095
# 1.00-1.08x), 50 lost at 1280x1280x4095 (0.86x, where XLA ran 314 TF/s) and won at
# 1279^3 (1.89x: an odd N, XLA's slower kernel); 54 and more won (1152x1536x4095 1.64x,
# 640x3072x4095 1.70x, 2048x1024x4095 1.60x, 1535^3 2.70x, 1024x4096x4095 2.40x). The
# bound is the smallest win above every loss. (An outputs bound, 1279^2, stood here
# until the session of 18:24 measured 1280x1280x4095.) Those that kernel_for gives the
# small-M kind (unbatched, jnp.dot's layout, only A's rows padded, its tiles in one wave;
# past 256 rows with N, K and its tiles large enough) run that kind instead, ahead of the
# default kernel on every one of these measured.
MIN_UNALIGNED_B_BLOCKS = 24
MIN_UNALIGNED_TILES = 54
DEFAULT_TILE_M = 128  # the default kernel's 128x256 tile
DEFAULT_TILE_N = 256


def _unaligned_rows_win(p: Problem, kind: str | None = None) -> bool:
    """Rows TMA cannot describe, enough work, and padding copies that do not outweigh
    the product. At decode-sized M only where the small-M kind runs (jnp.dot's layout,
    unbatched): with an odd K it reads the weight in place and is HBM-bound (16 and 64 x
    8192 x 8191, 28 us of HBM time: 3.1-3.3x); with an odd N, or a K-major weight (x @
    W.T) with an odd K, the padding would copy the weight whole (the copy bound leaves it
    to XLA). With an odd K and its tiles in one wave (past 256 rows: N >= 1024, K >= 2047
    and 160 tiles), the small-M kind too (kernel_for); the default kernel only with
    enough blocks of B's columns to spread B over the SMs, or enough tiles to outrun
    XLA's slow kernel. `kind`: the kind that would run it (default: kernel_for's)."""
    if p.rows_aligned or p.padding_copy_us > PADDING_COPY_MAX_SHARE * p.roofline_us:
        return False
    if (kernel_for(p) if kind is None else kind) == SMALL_M_KERNEL:
        return p.roofline_us >= MIN_UNALIGNED_KERNEL_US
    if p.m <= SMALL_M_MAX_ROWS:
        return False  # decode-sized on another kind (batched, transposed, fused): never measured
    b_blocks = max(p.batch, 1) * math.ceil(p.n / DEFAULT_TILE_N)
    tiles = b_blocks * math.ceil(p.m / DEFAULT_TILE_M)
    return p.compute_us >= MIN_UNALIGNED_KERNEL_US and (b_blocks >= MIN_UNALIGNED_B_BLOCKS or
                                                        tiles >= MIN_UNALIGNED_TILES)


# Aligned products with M and N both >= WIDE_MIN_MN (and K >= WIDE_MIN_K): there our
# default kernel ran ahead of cuBLASLt in every measurement, by a little (f16 and bf16,
# jnp.dot's layout, unbatched, 16-bit output; BENCHMARKS.md, session of 2026-12-02
# 10:35): kernel time 0.999-1.029x, geometric mean about 1.014, over 16384^3 (four
# processes), 16384x16384x8192 (two), 16384x16384x4096, 32768x16384x8192 and
# 16384x32768x8192; sustained 0.998-1.030x. Where only one of M, N is that large it tied
# (8192x16384x8192 1.002 / 0.998, 16384x8192x16384 1.005 / 0.999-1.004, 16384x8192x8192
# 1.002), as at 12288^3 (1.000-1.002) and 8192^3. Other layouts, batches, f32 outputs and
# the fused kinds were not measured there: XLA. Through the default path (session of
# 2026-12-02 14:28, 92a2940 / 4f1a694), the measured shapes ran 1.003-1.021x (sustained
# 1.029-1.077x), and LM heads, where N is a vocabulary, 1.015-1.039x (sustained
# 1.035-1.075x; 16384x50304x4096, 16384x128256x4096, 32768x32000x4096, f16 and bf16); with
# 8192 tokens (M) those tied (1.003-1.012x, sustained 0.994-1.001x) and stay on XLA.
# Shorter K lost or tied (16384x16384 x 2048 / 3072: 0.983-0.994x, sustained 0.97x;
# 16384x32000x3072 1.001-1.005x, sustained 0.98-0.995x; 16384x128256x2048 0.974-1.003x),
# but for 16384x128256x3072 (1.05x, where cuBLASLt's pick is slow): K stays >= 4096.
WIDE_MIN_MN = 16384
WIDE_MIN_K = 4096


def _wide_aligned_win(p: Problem) -> bool:
    return (p.rows_aligned and p.batch <= 1 and not (p.transpose_a or p.transpose_b) and
            p.out_itemsize == p.itemsize and min(p.m, p.n) >= WIDE_MIN_MN and p.k >= WIDE_MIN_K)


RULES: tuple[Rule, ...] = (
    Rule("unaligned-rows", _unaligned_rows_win, "kernel",
         "rows not 16-byte aligned: cuBLASLt falls to its slow kernels (8191^3 f16: 163 TF/s, 16x8192x8191: "
         "18 TF/s) while ours pads only the short rows and runs at 1.6-3.9x from 1281^3 up and 2.3-3.3x on "
         "decode-like products with an odd K in jnp.dot's layout; not where the padding copies a weight "
         "that outweighs the product (an odd vocabulary over up to 128 tokens: 0.33-0.54x)",
         applies_fused=lambda p: _unaligned_rows_win(p, DEFAULT_KERNEL)),
    Rule("wide-aligned", _wide_aligned_win, "kernel",
         "aligned, M and N >= 16384, K >= 4096, jnp.dot's layout: our default kernel 0.999-1.029x cuBLASLt by "
         "kernel time (geometric mean ~1.014 over 12 measurements in 4 processes), 0.998-1.030x sustained; "
         "LM heads (16384 x 50304 or 128256 x 4096, 32768x32000x4096) 1.015-1.039x, 1.035-1.075x sustained",
         fused_too=False),
    Rule("default", lambda p: True, "xla",
         "aligned shapes: our fastest f32 kernel ties cuBLASLt at 6144^3-12288^3 (0.99-1.01x by kernel time, "
         "0.98-1.02x sustained; sweeps at 3ecf707 and 7369afe), which is no reason to switch, and is behind on "
         "small, one-wave, odd, decode-like and short-K shapes (0.42-0.96x)"),
)


# The opt-in f16-accumulating kernel (accumulation="f16") was measured against
# cuBLASLt on 11 unbatched f16 NN shapes with 16-byte aligned rows and f16 output
# (BENCHMARKS.md, "Opt-in f16 accumulation"): ahead by 2.5-5.4% where every dimension
# is >= 4096 and the 256x256 tiles fill their last wave at least half (or there are
# many waves, where a part-empty last one costs little); behind on small, K-short and
# decode shapes and on 6144^3 (4.36 waves). The wave count is approximate (single
# tiles over 132 SMs; the kernel schedules 2-CTA clusters); it agrees with all 11
# measurements. Outside what was measured (batched, unaligned rows, f32 output) and
# where it lost, an f16-accumulation request takes the f32 path the table picks:
# faster there, or not shown slower, and more accurate.
F16_ACCUMULATION_TILE = 256
F16_ACCUMULATION_MIN_DIM = 4096
F16_ACCUMULATION_MIN_LAST_WAVE = 0.5
F16_ACCUMULATION_MANY_WAVES = 10
H200_SMS = 132  # one 256x256 tile per SM at a time (H100 SXM has as many)


def f16_accumulation_wins(p: Problem) -> bool:
    measured_kind = p.batch <= 1 and p.rows_aligned and p.out_itemsize == 2
    if not measured_kind or min(p.m, p.n, p.k) < F16_ACCUMULATION_MIN_DIM:
        return False
    tiles = max(p.batch, 1) * math.ceil(p.m / F16_ACCUMULATION_TILE) * math.ceil(p.n / F16_ACCUMULATION_TILE)
    waves = tiles / H200_SMS
    last_wave = waves - math.floor(waves) or 1.0
    return waves >= F16_ACCUMULATION_MANY_WAVES or last_wave >= F16_ACCUMULATION_MIN_LAST_WAVE


def choose_f16_accumulation(problem: Problem, policy: str | None = None) -> tuple[str, str, bool]:
    """(path, rule, whether the f16-accumulating kernel runs) for a product whose
    caller allows f16 accumulation: policy "kernel" always runs it (within KERNEL_MAX_DIM),
    "auto" where it was measured faster (else the table's f32 choice), "xla" never."""
    policy = current_policy() if policy is None else policy
    if policy == "kernel":
        path, rule = _runnable("kernel", "policy=kernel", problem, forced=True)
        return path, rule, path == "kernel"
    if policy == "auto" and f16_accumulation_wins(problem):
        path, rule = _runnable("kernel", "f16-accumulation", problem)
        return path, rule, path == "kernel"
    return (*choose(problem, policy), False)


# The fused dense (ops.dense) with an activation: bias and activation in our kernel's
# epilogue against jnp's act(x @ w + b), where XLA folds the bias and ReLU / tanh-GELU
# into cuBLASLt's epilogue and runs other activations as a separate pass. Measured on
# the H200 (BENCHMARKS.md, "Dispatcher: derivatives and the fused dense"; f16, bf16, kernel
# time, 3 layer shapes with all dimensions >= 4096 and K = 4096 or 8192): exact GELU
# 1.03-1.11x on all; tanh-GELU and SiLU 1.01-1.04x at K = 4096 but 0.99-1.00x at
# K = 8192 (the product's share grows with K, the fused pass's saving does not); ReLU
# 0.94-0.96x (cuBLASLt fuses it too). The rule covers what won: per activation, the
# largest K measured ahead; unbatched (ops.dense folds leading dimensions into M),
# aligned rows, all dimensions >= FUSED_MIN_DIM. Elsewhere the plain table decides.
# Exact GELU, since its epilogue takes Phi from one exp (2026-12-01, BENCHMARKS.md "exact
# GELU from one exp"), was also measured ahead with one of M, K at 2048 and N = 8192 (MxNxK
# 2048x8192x4096: 1.11x, 8192x8192x2048: 1.25x, f16 and bf16, sustained alike) and tied at
# K = 16384 (0.99-1.00x, so K stays <= 8192): it also wins with one of M, K down to
# FUSED_SMALL_M_OR_K and N >= FUSED_SMALL_MIN_N (both small at once was not measured).
FUSED_MIN_DIM = 4096
FUSED_ACTIVATION_MAX_K = {"gelu_exact": 8192, "gelu_tanh": 4096, "silu": 4096}
FUSED_SMALL_M_OR_K = {"gelu_exact": 2048}
FUSED_SMALL_MIN_N = 8192


def fused_activation_wins(p: Problem, activation: str | None, max_k: dict = FUSED_ACTIVATION_MAX_K) -> bool:
    """`max_k`: the longest K measured ahead, per activation (absent: never)."""
    if not (p.batch <= 1 and p.rows_aligned and p.out_itemsize == p.itemsize and
            p.k <= max_k.get(activation, 0)):
        return False
    if min(p.m, p.n, p.k) >= FUSED_MIN_DIM:
        return True
    small = FUSED_SMALL_M_OR_K.get(activation)
    return (small is not None and p.n >= FUSED_SMALL_MIN_N and min(p.m, p.k) >= small and
            max(p.m, p.k) >= FUSED_MIN_DIM)


def choose_dense(problem: Problem, activation: str | None, policy: str | None = None) -> tuple[str, str]:
    """(path, rule) for a fused dense layer act(x w + b) [+ r] (problem: x w)."""
    policy = current_policy() if policy is None else policy
    if policy == "auto" and fused_activation_wins(problem, activation):
        return _runnable("kernel", "fused-activation", problem)
    return choose(problem, policy, fused=True)


def layer_problem(x_shape, w_shape, dtype) -> Problem:
    """The Problem of a fused dense layer's product x [..., K] w [K, N] (x's leading dims
    folded into M, as the FFI handler folds them)."""
    m, k = math.prod(x_shape[:-1]), x_shape[-1]
    return problem_of((m, k), (k, w_shape[-1]), dtype, dtype, False, False)


def layer_runs_kernel(x_shape, w_shape, dtype, activation: str | None) -> bool:
    """Whether the rules (policy "auto") run a fused dense layer of these shapes on our
    kernel: asked again for each device's shards (_fused._cuda_impl) of a layer they
    picked the kernel for. A symbolic dim keeps the kernel (no sizes to ask about)."""
    if not numeric(*x_shape, *w_shape):
        return True
    return choose_dense(layer_problem(x_shape, w_shape, dtype), activation, "auto")[0] == "kernel"


# The MLP's backward form (ops.mlp): dz1 = (dy w2^T) * act'(z1) in one launch of our
# gradient kind (problem: dy w2^T, w2 read as stored [F, D]), against the product alone
# (dispatched by the table) followed by XLA's elementwise pass. Measured on the H200
# (BENCHMARKS.md, sessions "the MLP's backward form", 2026-12-01 03:36 and 05:52;
# 8192x4096x16384, f16 and bf16, kernel time). Alone it beats jnp's two passes (exact
# GELU 1.15-1.17x, the multiply by a saved act' 1.04-1.05x), but a layer with a bias
# also needs db1, which XLA folds into its elementwise pass: as a pass of its own
# (0.076 ms) it made the training step lose. Since the epilogue sums db1 too
# (cuda/gemm/column_sums.cuh), dz1 and db1 together run 1.07-1.09x jnp's product and
# pass (tanh-GELU, SiLU, the saved-act' multiply) and 1.20-1.21x (exact GELU), and the
# training step gains about 1% (exact GELU with act' saved: 1.057/1.061x against
# 1.048-1.053x; tanh-GELU 1.010x against 1.00x). At K = 8192 (8192x8192x32768, session
# of 2026-12-01 09:20) the multiply form with db1 still runs 1.069/1.068x (f16/bf16)
# jnp's product and pass: the pass it saves grows with N like the product's deficit to
# cuBLASLt. Auto runs it where that was measured: a bias gradient to sum, every
# dimension >= BACKWARD_FORM_MIN_DIM and K (the model width) <= BACKWARD_FORM_MAX_K
# (longer K unmeasured; the deficit grows with K, the pass does not).
BACKWARD_FORM_MIN_DIM = 4096
BACKWARD_FORM_MAX_K = 8192


def backward_form_wins(p: Problem, bias_grad: bool) -> bool:
    return (bias_grad and p.batch <= 1 and min(p.m, p.n, p.k) >= BACKWARD_FORM_MIN_DIM and
            p.k <= BACKWARD_FORM_MAX_K)


def choose_activation_grad(problem: Problem, activation: str | None, policy: str | None = None,
                           bias_grad: bool = False) -> tuple[str, str]:
    """(path, rule) for the MLP's backward form (problem: dy w2^T; bias_grad: the layer
    has a bias, whose gradient the kernel would sum): "kernel" runs it; "xla" leaves the
    product to choose() and act' (and db1) to XLA."""
    del activation
    policy = current_policy() if policy is None else policy
    if problem.n % TMA_WIDTH_MULTIPLE:
        return "xla", "hidden-width-not-multiple-of-8"
    if policy == "kernel":
        return _runnable("kernel", "policy=kernel", problem)
    if policy == "auto" and backward_form_wins(problem, bias_grad):
        return _runnable("kernel", "backward-form-with-bias-gradient", problem)
    return "xla", "backward-form-slower"


# The saved-derivative form of ops.mlp: the forward pass saves act'(z1) instead of z1,
# computed next to act(z1) in the epilogue of the derivative kind (one launch, both from
# the f32 z1), and the backward pass multiplies (dh * act'(z1)) instead of recomputing
# act' from z1. Measured on the H200 (BENCHMARKS.md, session of 22:36; 8192x4096x16384
# f16, kernel time against jnp's block): exact GELU's training step 1.038x (1.020x
# sustained), against 1.00x with z1 saved -- XLA's backward erf pass costs 0.42 ms, a
# multiply about 0.2, and the derivative kind computes act and act' for 1.105x jnp's
# product plus act pass. tanh-GELU and SiLU gained at most 1% then; since the backward
# form sums db1 in its epilogue, its multiply form runs 0.06 ms faster than its act'-from-z1
# form, and the forward's derivative kind ties the product plus XLA's act pass, so saving
# act' lifts their step (session of 2026-12-01 09:20, f16/bf16, kernel time): tanh-GELU
# 1.011 -> 1.023/1.019x, SiLU 1.026/1.012 -> 1.034/1.019x. Default: these three, where
# the derivative kind runs (choose_dense_with_derivative); the saved_derivative() scope
# forces the form for the activations it names on either path (XLA's pass computing both
# otherwise), for the benchmark and tests. ReLU: its derivative kind never runs under auto.
SAVED_DERIVATIVE_ACTIVATIONS: frozenset = frozenset({"gelu_exact", "gelu_tanh", "silu"})
# The override is a jax configuration option in jax's trace context and jit key too (as
# the policy is): a function traced under one override is traced again under another.
_SAVED_DERIVATIVE_OPTION = "jax_hopper_saved_derivative"
_saved_derivative_override = _jax_option(
    jax_config.string_or_object_state, _SAVED_DERIVATIVE_OPTION, default=None,
    help="jax_hopper's saved-derivative override (benchmark and tests): None, or the activations that save act'")


def may_save_derivative(activation: str | None) -> bool:
    """Whether saves_derivative can be true for this activation (so whether asking the
    dispatcher about the derivative kind is worth it)."""
    chosen = _saved_derivative_override.value
    chosen = SAVED_DERIVATIVE_ACTIVATIONS if chosen is None else chosen
    return activation is not None and activation in chosen


def saves_derivative(activation: str | None, derivative_kind_runs: bool) -> bool:
    """Whether ops.mlp's forward (and a differentiated ops.dense without a residual) saves
    act'(z1) for this activation (traced-time choice);
    `derivative_kind_runs`: whether choose_dense_with_derivative picked the kernel."""
    if activation is None:
        return False
    if _saved_derivative_override.value is not None:
        return activation in _saved_derivative_override.value
    return activation in SAVED_DERIVATIVE_ACTIVATIONS and derivative_kind_runs


@contextlib.contextmanager
def saved_derivative(activations):
    """Scoped override of the saved-derivative choice (read while jax traces): exactly the
    named activations save act'(z1), on either path. For the benchmark and tests."""
    with _saved_derivative_override(frozenset(activations)):
        yield


# The derivative kind writes act'(z), and the backward form reads z (or the saved act')
# and writes dz, by TMA only: rows of a multiple of 8 elements.
TMA_WIDTH_MULTIPLE = 8

# jax_hopper.mlp's saved-derivative form runs its derivative kind where fused-activation
# does (above), and also at a longer K than the fused dense alone (whose tanh-GELU and
# SiLU tie at K = 8192): against the layer plus XLA's act pass it saves that pass and,
# in the backward pass, act' recomputed from z1 (the multiply form instead of the act'
# form), where the fused dense alone saves only the first. ops.dense keeps its own rule
# (choose_dense), so a block of two dense calls is unchanged. Measured on the H200
# (BENCHMARKS.md, session of 2026-12-02 01:54; tokens x d_model x d_ff =
# 8192x8192x32768, kernel time): per kernel (tanh-GELU f16) the derivative kind 6.35 ms
# against nvjet + XLA's act pass 6.28 + 0.46, the multiply form 6.52 against the act'
# form 6.90; the whole training step, this rule against z1 kept interleaved in one
# process, 0.1-0.9% faster for tanh-GELU and SiLU in f16 and bf16 (0.4-0.8% sustained),
# never slower. Longer K (the model width) was not measured. The other conditions are
# fused-activation's.
SAVED_DERIVATIVE_MAX_K = {"gelu_tanh": 8192, "silu": 8192}


def saved_derivative_wins(p: Problem, activation: str | None) -> bool:
    """Where, beyond fused-activation's bounds, the derivative kind runs for the
    saved-derivative form under "auto"."""
    return fused_activation_wins(p, activation, SAVED_DERIVATIVE_MAX_K)


def choose_dense_with_derivative(problem: Problem, activation: str | None,
                                 policy: str | None = None) -> tuple[str, str]:
    """(path, rule) for the saved-derivative form's first layer, act(z1) and act'(z1)
    with z1 = x w1 + b1 (problem: x w1): "kernel" is one launch of the derivative kind;
    "xla" is the layer (ops.dense's pick) followed by XLA's pass computing both."""
    policy = current_policy() if policy is None else policy
    if problem.n % TMA_WIDTH_MULTIPLE:
        return "xla", "derivative-width-not-multiple-of-8"
    if policy == "kernel":
        return _runnable("kernel", "policy=kernel", problem)
    if policy == "auto" and fused_activation_wins(problem, activation):
        return _runnable("kernel", "fused-activation", problem)
    if policy == "auto" and saved_derivative_wins(problem, activation):
        return _runnable("kernel", "saved-derivative", problem)
    return "xla", f"policy={policy}" if policy != "auto" else "derivative-kind-not-ahead"


def choose(problem: Problem, policy: str | None = None, fused: bool = False) -> tuple[str, str]:
    """(path, rule name) for one product under `policy` (default: the current one);
    `fused`: the product of a fused dense layer (rules measured on plain products only
    do not apply)."""
    policy = current_policy() if policy is None else policy
    if policy == "kernel":
        return _runnable("kernel", "policy=kernel", problem, forced=True)
    if policy != "auto":
        return policy, f"policy={policy}"
    for rule in RULES:
        applies = rule.applies_fused if fused and rule.applies_fused is not None else rule.applies
        if (rule.fused_too or not fused) and applies(problem):
            return _runnable(rule.path, rule.name, problem)
    raise AssertionError("the rule table ends with a catch-all")


def pick(problem: Problem, f16_accumulation: bool = False, policy: str | None = None) -> tuple[str, str, str]:
    """(path, rule, the kernel kind that runs it on the kernel path) for one product;
    `f16_accumulation`: its caller allows f16 sums (choose_f16_accumulation)."""
    if f16_accumulation:
        path, rule, f16 = choose_f16_accumulation(problem, policy)
        if f16:
            return path, rule, F16_ACCUMULATION_KERNEL
    else:
        path, rule = choose(problem, policy)
    return path, rule, kernel_for(problem)


def picked_by_rules(rule: str) -> bool:
    """Whether a path came from the table (policy "auto"; `rule` as choose returns it),
    not from a policy that forces one."""
    return not rule.startswith("policy=")


def _runnable(path: str, rule: str, problem: Problem, forced: bool = False) -> tuple[str, str]:
    """A pick, unless it is the kernel and the kernel cannot run it: a dimension past the
    kernel's limits, or no kernel here (unless `forced`, policy "kernel" for a product:
    the primitive then computes through XLA, with a warning)."""
    if path == "kernel" and not problem.fits_kernel:
        return "xla", BEYOND_KERNEL_LIMITS
    if path == "kernel" and not forced:
        reason = _ffi.kernel_unavailable_reason()
        if reason is not None:
            _ffi.warn_no_kernel_once(reason)
            return "xla", "kernel-unavailable"
    return path, rule


# Which of our kernels computes a product sent to our kernel (by a rule or by policy
# "kernel"). Decode-sized M: the small-M kind (64x128 tiles, every tile's K range split
# into pieces, one CTA each, summed within a cluster where they fit) against the default kernel, f16 NN
# (BENCHMARKS.md, "Decode: the small-M kind"): its first form (a stream-K split) was
# already 1.3-1.9x faster at M = 1-64 with N x K = 8192x8192, 14336x4096, 4096x14336 and
# 16x4096x4096, 0.97x at 64x4096x4096, a tie at 128x8192x8192 and 0.62x at
# 128x14336x4096; its split-K form is faster still on every decode shape measured
# (session of 2026-12-03 17:49). Compiled for jnp.dot's layout, unbatched. Neither
# beats jnp.dot on decode shapes (XLA's Triton split-K there; the split-K form, summed in
# clusters and loading only A's rows up to M: 0.85-1.00x at M <= 64 where N x K >=
# 4096 x 14336, 0.69-0.74x at 16x4096x4096 with L2 warm between calls, session of
# 2026-12-04 00:06; with the weights cold in L2, as in a decode step, 0.73-0.94x, session
# of 02:44, and 0.89-0.96x since each piece of a cluster sums its share of the tile's
# columns, session of 04:36), so "auto" keeps them on XLA; this picks the kind once our
# kernel is asked for.
SMALL_M_MAX_ROWS = 64
# ... and up to this many rows where only A's rows are padded (an odd K: B read in place,
# A copied), as long as its 64x128 tiles fit in one wave of its CTAs (two per SM: 264 on
# the H200): there its tiles, four times as many as the default kernel's, spread B's stream
# over more SMs (with up to 132 tiles each is also split in K: floor(264 / tiles) pieces;
# launch.cuh split_k_pieces). Past one wave its tiles run in two or more (K split again
# by its cost model) and each of its tile rows streams B once more. Measured against the
# default kernel (f16, L2 cold, jnp.dot's layout; sessions of 2026-12-04 14:23 and 16:21),
# small-M / default kernel, x jnp.dot, by its tiles:
#   96-128 rows x 4096 / 6144 / 8192 x 4095 / 8191 / 14335 (64-128 tiles): 2.07-2.48 / 0.83-1.58;
#   256x4096x4095 (128): 1.61 / 0.92;  192x8192x8191, 256x6144x6143 (192): 2.17 / 1.79, 1.62 / 1.28;
#   128x14336x4095 (224): 1.89 / 1.79;  192x10240x4095 (240): 1.92 / 1.66;  256x8192x8191 (256): 1.94 / 1.88;
#   past one wave the default kernel: 256x10240x4095 (320) 1.44 / 2.45, 160x16384x4095 (384)
#   1.41 / 2.44, 256x14336x4095 (448) 1.79 / 2.75; a tie at 128x28672x4095 (448): 1.51 / 1.48.
# (The default kernel there has over 32 blocks of B's columns, so it passes the bound
# of _unaligned_rows_win.)
SMALL_M_UNALIGNED_MAX_ROWS = 256
SMALL_M_UNALIGNED_MAX_TILES = 256
# Past 256 rows XLA's unaligned kernel runs faster (up to about 340 TF/s where only K is
# odd; cuBLASLt's pick varies by shape), and the small-M kind needs most of its wave:
# N, K and its tiles at least these. Measured (session of
# 2026-12-04 18:24, f16 and bf16, L2 cold), small-M / default kernel, x jnp.dot, by its
# tiles: 320x4096x4095 (160) 1.32-1.35 / 1.00;  448x3072x4095 (168) 1.25 / 0.92;
# 384x4096x4095, 1024x1536x4095, 1536x1024x4095 (192) 1.43 / 1.08, 1.08-1.10 / 0.79,
# 1.10-1.15;  1280x1280x4095 (200) 1.17-1.32 / 0.86;  1152x1536x4095 (216) 2.26 / 1.64;
# 640x3072x4095 (240) 2.18 / 1.70;  2048x1024 x 4095 / 2047 (256) 1.97-2.09, 1.87-1.93 /
# 1.60 -- but with fewer tiles, or narrow N, it lost or barely won: 640x1024x8191 (80)
# 0.98; 2048x512x4095 (128) 0.96-0.97 / 0.59 (A, copied, the larger operand there);
# 512x2048x8191 (128) 1.11-1.13 / 0.65-0.67. Those run the default kernel's rule instead.
# N and K stay within what was measured (N 1024-4096, K 2047-8191; the narrow-N loss
# above also had too few tiles); with N >= 1024 its 256 tiles hold at most 2048 rows.
SMALL_M_UNALIGNED_WIDE_MIN_N = 1024
SMALL_M_UNALIGNED_WIDE_MIN_K = 2047
SMALL_M_UNALIGNED_WIDE_MIN_TILES = 160
SMALL_M_TILE_M, SMALL_M_TILE_N = 64, 128  # the small-M kind's tile (cuda/gemm/config.cuh)


def kernel_for(p: Problem) -> str:
    """The kernel kind that runs `p` on our kernel (f32 accumulation)."""
    if p.batch <= 1 and not (p.transpose_a or p.transpose_b):
        if p.m <= SMALL_M_MAX_ROWS:
            return SMALL_M_KERNEL
        a_row, b_row = p.operand_rows
        only_a_padded = a_row % TMA_ROW_MULTIPLE != 0 and b_row % TMA_ROW_MULTIPLE == 0
        small_m_tiles = math.ceil(p.m / SMALL_M_TILE_M) * math.ceil(p.n / SMALL_M_TILE_N)
        if only_a_padded and small_m_tiles <= SMALL_M_UNALIGNED_MAX_TILES and (
                p.m <= SMALL_M_UNALIGNED_MAX_ROWS or
                (p.n >= SMALL_M_UNALIGNED_WIDE_MIN_N and p.k >= SMALL_M_UNALIGNED_WIDE_MIN_K and
                 small_m_tiles >= SMALL_M_UNALIGNED_WIDE_MIN_TILES)):
            return SMALL_M_KERNEL
    return DEFAULT_KERNEL


def numeric(*dims) -> bool:
    """Every dim a number. A symbolic one (jax.export's shape polymorphism) is not: the
    rules below and the kernel's launch need sizes, so such products are jax's (or, under
    vmap, the primitives' reference arithmetic)."""
    return all(isinstance(d, (int, np.integer)) for d in dims)


def kind_for_shapes(kernel: str, rules: bool, a_shape, b_shape, dtype, out_dtype, transpose_a: bool,
                    transpose_b: bool) -> str:
    """The kind that computes a product bound with `kernel` once its operands have these
    shapes, which can differ from the shapes it was picked for: vmap grows M or adds a
    batch dim (_batching.py), and under sharding each device multiplies its shards
    (_primitive._cuda_impl). Where the rules picked the kind (`rules`: policy "auto"),
    they are asked again for these shapes (XLA_KERNEL where they would leave it to XLA's
    dot); the small-M kind asked for by name or by policy "kernel", compiled for one
    product in jnp.dot's layout, is picked again by kernel_for; any other is kept. Shapes
    with a symbolic dim keep the kind (there are no sizes to ask about). A K-split
    product's shards are f32 partial sums (_sharding._per_device_product) and are judged
    as such: the rules measured only 16-bit outputs there leave them to XLA's dot."""
    if not (rules or kernel == SMALL_M_KERNEL) or not numeric(*a_shape, *b_shape):
        return kernel
    problem = problem_of(a_shape, b_shape, dtype, out_dtype, transpose_a, transpose_b)
    if not rules:
        return kernel_for(problem)
    path, _, kind = pick(problem, f16_accumulation=kernel == F16_ACCUMULATION_KERNEL, policy="auto")
    return XLA_KERNEL if path == "xla" else kind


def fits_kernel(a_shape, b_shape, transpose_a: bool = False, transpose_b: bool = False) -> bool:
    """Whether the kernel can take a primitive's operands of these shapes (as problem_of
    reads them): every dimension within KERNEL_MAX_DIM. Shapes with a symbolic dim are
    not judged here (no sizes; the primitives' callers keep those on XLA)."""
    if not numeric(*a_shape, *b_shape):
        return True
    return problem_of(a_shape, b_shape, np.float16, np.float16, transpose_a, transpose_b).fits_kernel


def problem_of(a_shape, b_shape, dtype, out_dtype, transpose_a: bool, transpose_b: bool) -> Problem:
    """The Problem of the primitive's operands ([B...,] stored A, [B...,] stored B, the
    batch dims counted as one; or A [..., M, K] against a 2-D B, its leading dims folded
    into M)."""
    batch = math.prod(a_shape[:-2]) if len(a_shape) == len(b_shape) >= 3 else 0
    a2, b2 = a_shape[-2:], b_shape[-2:]
    folded = math.prod(a_shape[:-2]) if len(b_shape) == 2 else 1
    m = (a2[1] if transpose_a else a2[0]) * folded
    k = a2[0] if transpose_a else a2[1]
    n = b2[0] if transpose_b else b2[1]
    return Problem(batch, int(m), int(n), int(k), np.dtype(dtype).itemsize, np.dtype(out_dtype).itemsize,
                   bool(transpose_a), bool(transpose_b))
