// XLA FFI handler for C = A * B on Hopper.
#pragma once
#include <cstdint>

#include "xla/ffi/api/api.h"

namespace jax_hopper {
// How many times this process ran one of the handlers below. A call that XLA captured
// into a command buffer runs its handler when the graph is recorded, not when it is
// replayed (tests/gpu/test_xla_plan_gpu.py counts on this).
uint64_t ffi_handler_runs();
}  // namespace jax_hopper

// Every handler's last result is its workspace: bytes that XLA plans and nobody reads,
// at least workspace_bytes (module.cc: the extension's workspace_bytes) for the device
// it was sized for. The handlers allocate nothing, so they are marked command-buffer
// compatible: XLA may capture them into its CUDA graphs.

// Operands: a, b (f16 or bf16, rank 2, or rank 3 with a leading batch dimension);
// results: c [(batch,) M, N] of the same type or f32, the workspace.
// Attributes: transpose_a (A stored [K, M]), transpose_b (B stored [N, K]),
// kernel (a KernelKind value: jax_hopper/_kernels.py, Kind.id; a kind this target
// launches), stages.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxHopperGemm);

// C = act(A * B + bias) + residual in one kernel (the fused epilogue). Operands: a, b
// (rank 2), bias ([N] or empty), residual ([M, N] or empty), all of one 16-bit type;
// result c [M, N] of that type. Attributes: transpose_a, transpose_b, activation (an
// Activation value: jax_hopper/_kernels.py, ACTIVATIONS).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxHopperGemmFused);

// The backward form C = (A * B) * act'(z) (with activation 0, z is act'(z) itself: a
// multiply) and, optionally, C's f32 column sums per 64 rows (a bias gradient).
// Operands: a, b (rank 2), z ([M, N]), of one 16-bit type; results c ([M, N], that
// type) and column_sums (f32 [ceil(M / 64), N], or empty for none). Attributes:
// transpose_a, transpose_b, activation. N must be a multiple of 8 (z and c go by TMA).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxHopperGemmFusedGrad);

// C = act(A * B + bias) and D = act'(A * B + bias) in one kernel, for a backward pass
// to multiply by act'. Operands: a, b (rank 2), bias ([N] or empty); results c and d
// [M, N], all of one 16-bit type. Attributes: transpose_a, transpose_b, activation (as
// above, not 0). N must be a multiple of 8 (D is written by TMA only).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxHopperGemmFusedDerivative);

// Grouped products (ragged_dot). Operands: a, b (one 16-bit type), group_sizes (int32
// [G]); result c (their type or f32). Attributes: kernel (grouped: a [M, K], b [G, K, N]
// or with transpose_b [G, N, K], c [M, N], each group's rows of a times its b; grouped_k:
// a [R, M], b [R, N], c [G, M, N], per group its rows of a transposed times its rows of
// b), transpose_b, period (grouped: 0, or batch entries of `period` groups sharing b's
// period - 1 entries, each ending with a gap group of zeros).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxHopperRaggedDot);
