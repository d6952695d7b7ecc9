"""The kernel kinds, their compiled instances and the fused activations: one table.

Python reads it directly. The C++ side gets it through CMake, which runs this file at
configure time (``python3 jax_hopper/_kernels.py header OUT`` and ``... instances``)
and builds the enums, names and instance list from the output. A new kind or
activation is one entry here plus its device code. This file imports nothing but the
standard library, so CMake can run it before jax is importable.
"""

from __future__ import annotations

import dataclasses
import sys


@dataclasses.dataclass(frozen=True)
class Instance:
    """One compiled kernel: element type, operand majors ("K": K contiguous; "MN": M or
    N contiguous; jnp.dot's A [M, K] is K-major, its B [K, N] MN-major), ring depth."""

    dtype: str  # "f16" or "bf16"
    major_a: str
    major_b: str
    stages: int
    experimental: bool = False  # built only with -DJAX_HOPPER_EXPERIMENTAL_KERNELS=ON


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str  # the name Python uses
    enumerator: str  # C++ KernelKind
    id: int  # the KernelKind value, also the FFI's `kernel` attribute
    stages: int  # the default ring depth
    target: str  # the FFI target that launches it
    instances: tuple[Instance, ...]
    summary: str

    @property
    def experimental(self) -> bool:
        """Ablations and experiments: every instance sits behind the CMake option."""
        return all(i.experimental for i in self.instances)


def _layouts(dtypes, stages, *, experimental=False):
    """Every operand layout of each dtype."""
    return tuple(Instance(d, a, b, stages, experimental) for d in dtypes for a, b in
                 (("K", "MN"), ("K", "K"), ("MN", "MN"), ("MN", "K")))


def _nn(dtypes, stages, *, experimental=False):
    """jnp.dot's layout only: A [M, K], B [K, N]."""
    return tuple(Instance(d, "K", "MN", stages, experimental) for d in dtypes)


GEMM, FUSED, FUSED_GRAD, FUSED_DERIVATIVE = ("jax_hopper_gemm", "jax_hopper_gemm_fused",
                                             "jax_hopper_gemm_fused_grad", "jax_hopper_gemm_fused_derivative")
RAGGED = "jax_hopper_ragged_dot"
BOTH = ("f16", "bf16")

KINDS: tuple[Kind, ...] = (
    Kind("v5", "kV5", 0, 4, GEMM,
         _nn(BOTH, 4) + _nn(("f16",), 3, experimental=True) + _nn(("f16",), 2, experimental=True),
         "the seed's V5: one CTA per tile, a producer warp, two consumer warpgroups, stores from registers"),
    Kind("persistent", "kPersistent", 1, 4, GEMM, _layouts(BOTH, 4),
         "the default: persistent 2-CTA clusters multicasting B, tiles by ticket, deferred TMA-store epilogue"),
    Kind("persistent_basic", "kPersistentBasic", 2, 4, GEMM, _nn(("f16",), 4, experimental=True),
         "ablation: persistent clusters, stores from registers, one producer warp"),
    Kind("persistent_tma", "kPersistentTma", 3, 4, GEMM, _nn(("f16",), 4, experimental=True),
         "ablation: + the TMA-store epilogue"),
    Kind("persistent_wait0", "kPersistentWait0", 4, 4, GEMM, _nn(("f16",), 4, experimental=True),
         "ablation: persistent_static with wait_group(0)"),
    Kind("persistent_fused", "kPersistentFused", 5, 4, FUSED, _nn(BOTH, 4),
         "the dense layer: bias, activation and residual in the epilogue"),
    Kind("persistent_streamk", "kPersistentStreamK", 6, 4, GEMM, _nn(("f16",), 4, experimental=True),
         "experiment: the last partial wave split along K (stream-K)"),
    Kind("persistent_f16acc", "kPersistentF16Acc", 7, 3, GEMM, _layouts(("f16",), 3),
         "opt-in f16 accumulation: 256x256 tiles, four consumer warpgroups"),
    Kind("small_m", "kSmallM", 8, 4, GEMM, _nn(BOTH, 4),
         "decode-sized M: 64x128 tiles, each tile's K range split over CTAs"),
    Kind("persistent_pingpong", "kPersistentPingpong", 9, 6, GEMM, _nn(("f16",), 6, experimental=True),
         "experiment: 128x128 tiles, one per consumer warpgroup (ping-pong)"),
    Kind("persistent_fused_grad", "kPersistentFusedGrad", 10, 3, FUSED_GRAD, tuple(
        Instance(d, "K", "K", 3) for d in BOTH),
         "the MLP's backward form: (g w^T) * act'(z) and its column sums"),
    Kind("persistent_fused_derivative", "kPersistentFusedDerivative", 11, 4, FUSED_DERIVATIVE, _nn(BOTH, 4),
         "the dense layer that also writes act'(z)"),
    Kind("persistent_immediate", "kPersistentImmediate", 12, 4, GEMM, _nn(("f16",), 4, experimental=True),
         "ablation: + a producer warpgroup and setmaxnreg"),
    Kind("persistent_static", "kPersistentStatic", 13, 4, GEMM, _nn(("f16",), 4, experimental=True),
         "ablation: + the deferred store, tiles in a grid stride"),
    # Grouped products (ragged_dot): lhs [M, K] against rhs [G, K, N] or [G, N, K].
    Kind("grouped", "kGrouped", 14, 4, RAGGED,
         tuple(Instance(d, "K", b, 4) for d in BOTH for b in ("MN", "K")),
         "ragged rows: each group of lhs rows times its own matrix, tiles masked at group ends"),
    Kind("grouped_k", "kGroupedK", 15, 4, RAGGED, tuple(Instance(d, "MN", "MN", 4) for d in BOTH),
         "ragged contraction: per group, its rows of a transposed times its rows of b ([G, K, N])"),
)
KIND_BY_NAME = {kind.name: kind for kind in KINDS}

DEFAULT_KIND = "persistent"
SMALL_M_KIND = "small_m"
F16_ACCUMULATION_KIND = "persistent_f16acc"
FUSED_KIND, FUSED_GRAD_KIND, FUSED_DERIVATIVE_KIND = (
    "persistent_fused", "persistent_fused_grad", "persistent_fused_derivative")
# Kinds the plain GEMM target launches by name (the others have targets of their own).
GEMM_KINDS = tuple(kind.name for kind in KINDS if kind.target == GEMM)
GROUPED_KIND, GROUPED_K_KIND = "grouped", "grouped_k"


@dataclasses.dataclass(frozen=True)
class Activation:
    name: str | None
    enumerator: str  # C++ Activation
    id: int


ACTIVATIONS: tuple[Activation, ...] = (
    Activation(None, "kNone", 0),
    Activation("relu", "kRelu", 1),
    Activation("gelu_tanh", "kGeluTanh", 2),
    Activation("gelu_exact", "kGeluErf", 3),
    Activation("silu", "kSilu", 4),
)
ACTIVATION_IDS = {a.name: a.id for a in ACTIVATIONS}


def stages_of(kind: str) -> int:
    return KIND_BY_NAME[kind].stages


# ---- generated C++ -----------------------------------------------------------------
_CPP_TYPES = {"f16": "kF16", "bf16": "kBF16"}
_CPP_MAJORS = {"K": "kK", "MN": "kMN"}


def cpp_header() -> str:
    """The C++ view of the table (cuda/gemm/gemm.h includes it)."""
    kinds = ",\n".join(f"  {k.enumerator} = {k.id}" for k in sorted(KINDS, key=lambda k: k.id))
    acts = ",\n".join(f"  {a.enumerator} = {a.id}" for a in ACTIVATIONS)
    names = " \\\n".join(f"  X({k.enumerator}, \"{k.name}\", {k.stages}, \"{k.target}\")" for k in KINDS)
    return (
        "// Generated from jax_hopper/_kernels.py at configure time: edit that table, not this file.\n"
        "#pragma once\n#include <cstdint>\n\nnamespace jax_hopper {\n\n"
        f"enum class KernelKind : int32_t {{\n{kinds}\n}};\n"
        f"constexpr int32_t kNumKernelKinds = {len(KINDS)};\n\n"
        f"// Elementwise function of the fused epilogues, applied in f32.\n"
        f"enum class Activation : int32_t {{\n{acts}\n}};\n"
        f"constexpr int32_t kNumActivations = {len(ACTIVATIONS)};\n\n"
        f"// X(enumerator, name, default stages, FFI target) for every kind, in the table's order.\n"
        f"#define JAX_HOPPER_KERNEL_KINDS(X) \\\n{names}\n\n"
        "}  // namespace jax_hopper\n")


def cpp_instances(experimental: bool) -> str:
    """One line per compiled instance: KernelKind, ElementType, Major of A, Major of B, stages."""
    return "".join(f"{k.enumerator} {_CPP_TYPES[i.dtype]} {_CPP_MAJORS[i.major_a]} {_CPP_MAJORS[i.major_b]} "
                   f"{i.stages}\n" for k in KINDS for i in k.instances if experimental or not i.experimental)


def _main(argv):
    if len(argv) == 2 and argv[0] == "header":
        with open(argv[1], "w") as f:
            f.write(cpp_header())
    elif argv[:1] == ["instances"] and argv[1:] in ([], ["--experimental"]):
        sys.stdout.write(cpp_instances(experimental=bool(argv[1:])))
    else:
        sys.exit("usage: python3 _kernels.py header OUT | instances [--experimental]")


if __name__ == "__main__":
    _main(sys.argv[1:])
