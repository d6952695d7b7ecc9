"""The dispatcher's rules, as data: which path computes a problem, and why.

`RULES` is an ordered table; the first rule whose op, policy and condition match a
problem names its path (_dispatch.decide). A kernel rule exists only where a measurement
backs it (`evidence`: results files under docs/results/evidence/); the catch-alls send a
problem to XLA, the answer that never loses. docs/dispatch.md is generated from this
table (tools/dispatch_doc.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from jax_hopper import _kernels
from jax_hopper._problem import H200_SMS, TMA_ROW_MULTIPLE, Problem

EVIDENCE = "docs/results/evidence/"

# ---- which kind runs a product on our kernel ---------------------------------------
# Decode-sized M: the small-M kind (64x128 tiles, each tile's K range split over CTAs).
SMALL_M_MAX_ROWS = 64
# Up to this many rows, and past it up to 2048 with N, K and tiles large enough, where
# only A's rows need padding (an odd K: B read in place, A copied) and the small-M kind's
# tiles fit one wave of its CTAs: there its tiles spread B's stream over more SMs than
# the default kernel's.
SMALL_M_UNALIGNED_MAX_ROWS = 256
SMALL_M_UNALIGNED_MAX_TILES = 256
SMALL_M_UNALIGNED_WIDE_MIN_N = 1024
SMALL_M_UNALIGNED_WIDE_MIN_K = 2047
SMALL_M_UNALIGNED_WIDE_MIN_TILES = 160
SMALL_M_TILE_M, SMALL_M_TILE_N = 64, 128  # cuda/gemm/config.cuh
KIND_EVIDENCE = tuple(EVIDENCE + name for name in (
    "small_m_decode.json", "decode_splitk_oneshot_w1.json", "unaligned_small_m_128.json",
    "unaligned_small_m_256.json", "unaligned_small_m_wave.json", "unaligned_small_m_rows.json",
    "unaligned_small_m_wide.json"))
DEFAULT_TILE_M, DEFAULT_TILE_N = 128, 256


def kernel_for(p: Problem) -> str:
    """The kind that runs a plain product with f32 accumulation on our kernel."""
    if p.batch <= 1 and not (p.transpose_a or p.transpose_b):
        if p.m <= SMALL_M_MAX_ROWS:
            return _kernels.SMALL_M_KIND
        a_row, b_row = p.operand_rows
        only_a_padded = a_row % TMA_ROW_MULTIPLE != 0 and b_row % TMA_ROW_MULTIPLE == 0
        small_m_tiles = math.ceil(p.m / SMALL_M_TILE_M) * math.ceil(p.n / SMALL_M_TILE_N)
        if only_a_padded and small_m_tiles <= SMALL_M_UNALIGNED_MAX_TILES and (
                p.m <= SMALL_M_UNALIGNED_MAX_ROWS or
                (p.n >= SMALL_M_UNALIGNED_WIDE_MIN_N and p.k >= SMALL_M_UNALIGNED_WIDE_MIN_K and
                 small_m_tiles >= SMALL_M_UNALIGNED_WIDE_MIN_TILES)):
            return _kernels.SMALL_M_KIND
    return _kernels.DEFAULT_KIND


def kind_of(p: Problem) -> str:
    """The kind our kernel path runs for `p`, by its op (rules may name another)."""
    if p.op == "product":
        return kernel_for(p)
    if p.op == "ragged_rows":
        return _kernels.GROUPED_KIND
    if p.op == "ragged_contract":
        return _kernels.GROUPED_K_KIND
    return {"dense": _kernels.FUSED_KIND, "dense_derivative": _kernels.FUSED_DERIVATIVE_KIND,
            "activation_grad": _kernels.FUSED_GRAD_KIND}[p.op]


# ---- unaligned rows ----------------------------------------------------------------
# Below this much work, launch and padding costs dominate an unaligned product.
MIN_UNALIGNED_KERNEL_US = 4.0
# The padding copies may cost at most this share of the product's roofline time (an odd
# vocabulary at small M copies a weight twice the product's own traffic).
PADDING_COPY_MAX_SHARE = 1.25
# The default kernel streams a K x 256 block of B per CTA at one SM's pace; against
# XLA's unaligned kernels it needs enough distinct blocks of B's columns, or tiles.
MIN_UNALIGNED_B_BLOCKS = 24
MIN_UNALIGNED_TILES = 54


def unaligned_rows_win(p: Problem, kind: str | None = None) -> bool:
    """Rows TMA cannot describe (cuBLASLt falls to slow kernels), enough work, and
    padding copies that do not outweigh the product. `kind`: the kind that would run it
    (default: kernel_for's)."""
    if p.rows_aligned or p.padding_copy_us > PADDING_COPY_MAX_SHARE * p.roofline_us:
        return False
    if (kernel_for(p) if kind is None else kind) == _kernels.SMALL_M_KIND:
        return p.roofline_us >= MIN_UNALIGNED_KERNEL_US
    if p.m <= SMALL_M_MAX_ROWS:
        return False  # decode-sized on another kind (batched, transposed, fused): not measured
    b_blocks = max(p.batch, 1) * math.ceil(p.n / DEFAULT_TILE_N)
    tiles = b_blocks * math.ceil(p.m / DEFAULT_TILE_M)
    return p.compute_us >= MIN_UNALIGNED_KERNEL_US and (b_blocks >= MIN_UNALIGNED_B_BLOCKS or
                                                        tiles >= MIN_UNALIGNED_TILES)


def _unaligned_rows_rule(p: Problem) -> bool:
    # A fused layer runs the default kernel's 128x256 tiles whatever kernel_for picks.
    return unaligned_rows_win(p, None if p.op == "product" else _kernels.DEFAULT_KIND)


# ---- aligned, wide -----------------------------------------------------------------
WIDE_MIN_MN = 16384
WIDE_MIN_K = 4096


def wide_aligned_win(p: Problem) -> bool:
    return (p.rows_aligned and p.batch <= 1 and not (p.transpose_a or p.transpose_b) and
            p.out_itemsize == p.itemsize and min(p.m, p.n) >= WIDE_MIN_MN and p.k >= WIDE_MIN_K)


# ---- opt-in f16 accumulation (256x256 tiles) ----------------------------------------
F16_ACCUMULATION_TILE = 256
F16_ACCUMULATION_MIN_DIM = 4096
F16_ACCUMULATION_MIN_LAST_WAVE = 0.5
F16_ACCUMULATION_MANY_WAVES = 10


def f16_accumulation_wins(p: Problem) -> bool:
    """Every dimension >= 4096 and the last wave of 256x256 tiles at least half full (or
    many waves), unbatched, aligned, 16-bit output: where it was measured ahead."""
    measured_kind = p.batch <= 1 and p.rows_aligned and p.out_itemsize == 2
    if not measured_kind or min(p.m, p.n, p.k) < F16_ACCUMULATION_MIN_DIM:
        return False
    tiles = max(p.batch, 1) * math.ceil(p.m / F16_ACCUMULATION_TILE) * math.ceil(p.n / F16_ACCUMULATION_TILE)
    waves = tiles / H200_SMS
    last_wave = waves - math.floor(waves) or 1.0
    return waves >= F16_ACCUMULATION_MANY_WAVES or last_wave >= F16_ACCUMULATION_MIN_LAST_WAVE


# ---- fused activations ---------------------------------------------------------------
# Per activation, the longest K measured ahead (absent: never). The fused pass saves a
# fixed share while the product's share grows with K.
FUSED_MIN_DIM = 4096
FUSED_ACTIVATION_MAX_K = {"gelu_exact": 8192, "gelu_tanh": 4096, "silu": 4096}
# Exact GELU also wins with one of M, K down to 2048 when N >= 8192.
FUSED_SMALL_M_OR_K = {"gelu_exact": 2048}
FUSED_SMALL_MIN_N = 8192
# The saved-derivative form of mlp also saves the backward pass's act' recomputation, so
# its derivative kind wins at a longer K than the fused dense alone.
SAVED_DERIVATIVE_MAX_K = {"gelu_tanh": 8192, "silu": 8192}


def fused_activation_wins(p: Problem, max_k: dict = FUSED_ACTIVATION_MAX_K) -> bool:
    if not (p.batch <= 1 and p.rows_aligned and p.out_itemsize == p.itemsize and
            p.k <= max_k.get(p.activation, 0)):
        return False
    if min(p.m, p.n, p.k) >= FUSED_MIN_DIM:
        return True
    small = FUSED_SMALL_M_OR_K.get(p.activation)
    return (small is not None and p.n >= FUSED_SMALL_MIN_N and min(p.m, p.k) >= small and
            max(p.m, p.k) >= FUSED_MIN_DIM)


def saved_derivative_wins(p: Problem) -> bool:
    return fused_activation_wins(p, SAVED_DERIVATIVE_MAX_K)


# ---- the MLP's backward form -----------------------------------------------------------
# dz1 = (dy w2^T) * act'(z1) with db1 summed in the epilogue, against the product and
# XLA's elementwise pass: ahead with a bias gradient to sum, large layers, model width
# (K) up to 8192.
BACKWARD_FORM_MIN_DIM = 4096
BACKWARD_FORM_MAX_K = 8192


def backward_form_wins(p: Problem) -> bool:
    return (p.bias_grad and p.batch <= 1 and min(p.m, p.n, p.k) >= BACKWARD_FORM_MIN_DIM and
            p.k <= BACKWARD_FORM_MAX_K)


# An f32 result of f16 operands left to XLA's dot keeps our derivative rule
# (primitives/gemm.py: _rounds_f32_cotangent): an LM head's training step ran 1.74x jnp's.
F32_COTANGENT_EVIDENCE = tuple(EVIDENCE + name for name in ("lm_head.json", "lm_head_breakdown.json"))


# ---- the table -----------------------------------------------------------------------
ALL_POLICIES = ("auto", "kernel", "xla")


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str
    ops: tuple[str, ...]  # the problems it speaks for (_problem.OPS)
    policies: tuple[str, ...]  # the policies under which it is consulted
    when: Callable[[Problem], bool]
    path: str  # "kernel" or "xla"
    condition: str  # `when` in words (docs/dispatch.md)
    evidence: tuple[str, ...] = ()  # results files backing a kernel pick
    # A kernel pick stays a kernel pick where no kernel is built (the primitive then
    # warns and computes through XLA): policy "kernel" on products and layers.
    unavailable_ok: bool = False
    kind: Callable[[Problem], str] = kind_of  # the kind a kernel pick runs


def _always(p: Problem) -> bool:
    return True


def _f16_accumulation_kind(p: Problem) -> str:
    return _kernels.F16_ACCUMULATION_KIND


def _requested_kind(p: Problem) -> str:
    """Policy "kernel": the f16-accumulating kind where the caller allows it."""
    return _kernels.F16_ACCUMULATION_KIND if p.f16_accumulation else kind_of(p)


def _f16_accumulation_rule(p: Problem) -> bool:
    return p.f16_accumulation and f16_accumulation_wins(p)


def _width_not_multiple_of_8(p: Problem) -> bool:
    return p.n % TMA_ROW_MULTIPLE != 0


# The grouped kernel's group table (cuda/gemm/scheduler/group_table.cuh).
MAX_GROUPS = 1024


def ragged_unfit(p: Problem) -> bool:
    """A grouped product the kernel cannot take as stored: a row TMA cannot read in place
    (not a multiple of 8 elements), or more groups than its table holds."""
    a_row, b_row = p.operand_rows
    return a_row % TMA_ROW_MULTIPLE != 0 or b_row % TMA_ROW_MULTIPLE != 0 or not 1 <= p.batch <= MAX_GROUPS


RAGGED_OPS = ("ragged_rows", "ragged_contract")


# The grouped kernel's measured range (ragged_h100.json): 8 to 256 groups over 16384 or
# more rows (the contraction: summed over), the other two dims 1024 or more, 16-bit
# results (the deferred store; f32 results leave through register stores, not timed).
RAGGED_MIN_GROUPS = 8
RAGGED_MIN_ROWS = 16384
RAGGED_MIN_DIM = 1024


def ragged_measured_win(p: Problem) -> bool:
    rows, others = (p.m, (p.n, p.k)) if p.op == "ragged_rows" else (p.k, (p.m, p.n))
    return (p.batch >= RAGGED_MIN_GROUPS and rows >= RAGGED_MIN_ROWS and min(others) >= RAGGED_MIN_DIM
            and p.out_itemsize == p.itemsize)


def _evidence(*names: str) -> tuple[str, ...]:
    return tuple(EVIDENCE + name for name in names)


RULES: tuple[Rule, ...] = (
    Rule("derivative-width-not-multiple-of-8", ("dense_derivative",), ALL_POLICIES, _width_not_multiple_of_8, "xla",
         "N is not a multiple of 8: the derivative kind writes act' by TMA only"),
    Rule("hidden-width-not-multiple-of-8", ("activation_grad",), ALL_POLICIES, _width_not_multiple_of_8, "xla",
         "the hidden width is not a multiple of 8: the backward form reads z and writes dz by TMA only"),
    Rule("ragged-unaligned-or-too-many-groups", RAGGED_OPS, ALL_POLICIES, ragged_unfit, "xla",
         "a stored row is not a multiple of 8 elements, or more than 1024 groups: the grouped kernel reads rows "
         "in place by TMA and keeps its group table in shared memory"),
    Rule("policy=kernel", ("product", "dense") + RAGGED_OPS, ("kernel",), _always, "kernel",
         "policy \"kernel\": our kernel wherever it applies", unavailable_ok=True, kind=_requested_kind),
    Rule("policy=kernel", ("dense_derivative", "activation_grad"), ("kernel",), _always, "kernel",
         "policy \"kernel\" (where no kernel is built, XLA's form)"),
    Rule("policy=xla", ("product", "dense", "dense_derivative") + RAGGED_OPS, ("xla",), _always, "xla",
         "policy \"xla\": never our kernel"),
    Rule("f16-accumulation", ("product",), ("auto",), _f16_accumulation_rule, "kernel",
         "accumulation=\"f16\" asked for; f16; unbatched, aligned, 16-bit output; M, N, K >= 4096; the last wave "
         "of 256x256 tiles at least half full or >= 10 waves",
         _evidence("f16acc_sweep.json", "bench.json"), kind=_f16_accumulation_kind),
    Rule("fused-activation", ("dense", "dense_derivative"), ("auto",), fused_activation_wins, "kernel",
         "exact GELU with K <= 8192, tanh-GELU or SiLU with K <= 4096; unbatched, aligned, 16-bit output; M, N, "
         "K >= 4096 (exact GELU: one of M, K down to 2048 where N >= 8192)",
         _evidence("dense_rule_evidence.json", "dense_mlp.json",
                   "dense_rule_gelu_exact.json", "mlp_small_gelu_exact_rule.json")),
    Rule("saved-derivative", ("dense_derivative",), ("auto",), saved_derivative_wins, "kernel",
         "tanh-GELU or SiLU with 4096 < K <= 8192 (the fused-activation conditions otherwise): mlp's forward "
         "saves act' for the backward pass",
         _evidence("ab_saved_rule.json", "d8192_rule.json", "d8192_breakdown.json")),
    Rule("derivative-kind-not-ahead", ("dense_derivative",), ("auto",), _always, "xla",
         "elsewhere: the layer, then XLA's pass computing act and act'",
         _evidence("dense_rule_evidence.json", "d8192_rule.json")),
    Rule("backward-form-with-bias-gradient", ("activation_grad",), ("auto",), backward_form_wins, "kernel",
         "a bias gradient to sum; unbatched; M, N, K >= 4096; K (the model width) <= 8192",
         _evidence("backward_rule_kernel.json", "backward_rule_xla.json", "bias_grad_pair.json",
                   "bias_grad_step_auto.json", "d8192_pair.json", "d8192_backward_rule.json")),
    Rule("backward-form-slower", ("activation_grad",), ALL_POLICIES, _always, "xla",
         "elsewhere: the product, then XLA's elementwise pass",
         _evidence("backward_form.json", "bias_grad_pair.json")),
    Rule("unaligned-rows", ("product", "dense"), ("auto",), _unaligned_rows_rule, "kernel",
         "a stored row is not 16-byte aligned (cuBLASLt's slow kernels); padding copies at most 1.25x the "
         "product's roofline time; >= 4 us of work; on the default kernel >= 24 blocks of B's columns or >= 54 "
         "tiles (decode-sized M: only on the small-M kind)",
         _evidence("unaligned_c.json", "unaligned_c_small.json", "unaligned_1.json",
                   "unaligned_rule.json", "unaligned_few_blocks.json",
                   "unaligned_few_tiles.json", "unaligned_tiles_boundary.json",
                   "unaligned_layouts.txt", "unaligned_batched.json")),
    Rule("wide-aligned", ("product",), ("auto",), wide_aligned_win, "kernel",
         "aligned, unbatched, jnp.dot's layout, 16-bit output, M and N >= 16384, K >= 4096",
         _evidence("wide_aligned_a.json", "wide_aligned_b.json", "wide_default_path.json",
                   "wide_short_k.json")),
    Rule("ragged-groups", RAGGED_OPS, ("auto",), ragged_measured_win, "kernel",
         "8 groups or more over >= 16384 rows (the contraction: summed over), the other dims >= 1024, 16-bit "
         "results: our grouped kernel ran 1.11-3.17x the fastest JAX alternative on every measured shape "
         "(G = 8 to 256), 6.8-44x XLA's lowering where it ran (at G = 256 it failed: out of memory asking for "
         "64-224 GiB, or no autotuning configuration)",
         _evidence("ragged_h100.json", "ragged_moe_step_h100.json")),
    Rule("ragged-not-measured", RAGGED_OPS, ("auto",), _always, "xla",
         "elsewhere (fewer groups or rows, narrow weights, f32 results): not measured against ours; XLA's "
         "lowering computes every group's product over all the rows"),
    Rule("default", ("product", "dense"), ("auto",), _always, "xla",
         "elsewhere: aligned shapes tie cuBLASLt at best, small and decode-sized ones lose",
         _evidence("sweep_2.json", "sweep_f16.json", "sweep_bf16.json",
                   "decode_cold_2.json")),
)
