// Epilogues: what a consumer warpgroup's accumulators (f32; f16 in the opt-in kind)
// become. The kind's flags (config.cuh) pick the parts:
//  direct_store.cuh      (V5, persistent_basic) registers straight to C
//  tma_store.cuh         registers -> swizzled shared-memory sub-tiles -> TMA stores
//                        that run while the consumers start the next tile
//  deferred_store.cuh    (the default) a tile's TMA store during the next tile's first K tiles
//  fused_ops.cuh         (persistent_fused) bias, activation and residual before the store
//  activations.cuh       the activations and their derivatives, in f32
//  derivative_store.cuh  (persistent_fused_derivative) act and act' stored as C and D
//  staged_operand.cuh    (persistent_fused_grad) acc * act'(z), z loaded during the mainloop
//  column_sums.cuh       (persistent_fused_grad) C's column sums, a bias gradient
#pragma once
#include <type_traits>

#include "gemm/epilogue/deferred_store.cuh"
#include "gemm/epilogue/derivative_store.cuh"
#include "gemm/epilogue/direct_store.cuh"
#include "gemm/epilogue/fused_ops.cuh"
#include "gemm/epilogue/output.cuh"
#include "gemm/epilogue/staged_operand.cuh"
#include "gemm/epilogue/tma_store.cuh"

namespace jax_hopper {

// The store of a finished tile: through shared memory and TMA, or from registers.
template <class Cfg>
using EpilogueOf = std::conditional_t<Cfg::kTmaStoreEpilogue, TmaStore<Cfg>, DirectStore<Cfg>>;

}  // namespace jax_hopper
