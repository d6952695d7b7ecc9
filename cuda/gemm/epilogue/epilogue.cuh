// The epilogue role of a consumer warpgroup: what its accumulators become, and the work
// the epilogue does around the mainloop. The kind's flags (config.cuh) pick the parts:
//  direct_store.cuh      (V5, persistent_basic) registers straight to C
//  tma_store.cuh         registers -> swizzled shared-memory sub-tiles -> TMA stores
//  deferred_store.cuh    (the default) a tile's TMA store during the next tile's first K tiles
//  fused_ops.cuh         (persistent_fused) bias, activation and residual before the store
//  derivative_store.cuh  (persistent_fused_derivative) act and act' stored as C and D
//  staged_operand.cuh    (persistent_fused_grad) acc * act'(z), z loaded during the mainloop
// Per tile the kernel calls begin_tile before the mainloop, started and during from
// inside it (Mainloop::mma's hooks), flush once its MMAs are done, then store; after the
// last tile, flush and finish.
#pragma once
#include <cuda.h>

#include <cstdint>

#include "gemm/config.cuh"
#include "gemm/epilogue/deferred_store.cuh"
#include "gemm/epilogue/derivative_store.cuh"
#include "gemm/epilogue/direct_store.cuh"
#include "gemm/epilogue/fused_ops.cuh"
#include "gemm/epilogue/output.cuh"
#include "gemm/epilogue/staged_operand.cuh"
#include "gemm/epilogue/tma_store.cuh"
#include "gemm/mainloop.cuh"
#include "gemm/scheduler/tile_order.cuh"
#include "gemm/shared_storage.cuh"
#include "hopper/mbarrier.cuh"

namespace jax_hopper {

template <class Cfg>
class Epilogue {
 public:
  using Acc = typename Mainloop<Cfg>::Acc;
  // The deferred store's previous tile (deferred_store.cuh). The kernel keeps it as a
  // local of its own and passes it to each call (a member, it changed the kernel's
  // machine code).
  using Deferred = typename DeferredStore<Cfg>::Pending;
  __device__ static void no_deferred(Deferred& deferred) { deferred.valid = false; }

  // Barrier init (one thread, before the cluster sync that publishes it): the staged
  // operand's loads complete on one barrier per consumer warpgroup.
  __device__ static void init(SharedStorage<Cfg>& smem) {
    if constexpr (Cfg::kStagedOperand)
      for (int w = 0; w < Cfg::kConsumerWarpgroups; ++w) hopper::mbarrier_init(&smem.operand.full[w], 1);
  }

  // `tmap_d`: the derivative kind's D, or the backward form's staged operand.
  __device__ Epilogue(SharedStorage<Cfg>& smem, int warpgroup, const CUtensorMap* tmap_c, const CUtensorMap* tmap_d,
                      const OutputParams& out)
      : smem_(smem), warpgroup_(warpgroup), tmap_c_(tmap_c), tmap_d_(tmap_d), out_(out) {}

  // Before the tile's mainloop: the fused epilogue's bias pair and residual prefetch.
  __device__ void begin_tile(int row0, int col0) {
    bias_pair_ = 0;
    if constexpr (Cfg::kFusedEpilogue && !Cfg::kStagedOperand) bias_pair_ = FusedOps<Cfg>::prefetch(out_, row0, col0);
  }

  // Once the tile's mainloop is under way: the backward form's staged operand loads.
  __device__ void started(int row0, int col0) {
    if constexpr (Cfg::kStagedOperand)
      StagedOperand<Cfg>::load_operand(buffers(), tmap_d_, &smem_.operand.full[warpgroup_], row0, col0);
  }

  // Once K tile kt's MMAs are issued: the deferred store's sub-tile kt of the previous tile.
  __device__ void during(Deferred& deferred, int kt) {
    if constexpr (Cfg::kDeferredStore)
      DeferredStore<Cfg>::store_pending_during(deferred, buffers(), tmap_c_, out_, warpgroup_, kt);
  }

  // The deferred store's sub-tiles from `first` on: those the current tile's K tiles did
  // not cover, before any path leaves the tile (all of them before a tile with no MMAs,
  // and after the last tile).
  __device__ void flush(Deferred& deferred, int first) {
    if constexpr (Cfg::kDeferredStore) DeferredStore<Cfg>::flush(deferred, buffers(), tmap_c_, out_, warpgroup_, first);
  }

  // The tile's accumulators to C (and D, or the column sums), or, deferred, to registers.
  __device__ void store(Deferred& deferred, Acc& acc, const TileCoord& tile, int row0, int col0) {
    if constexpr (Cfg::kSavesDerivative) {  // act and act' computed as the sub-tiles are staged
      FusedOps<Cfg>::share_bias(out_, bias_pair_, smem_.fused.bias[warpgroup_],
                                Cfg::kFirstEpilogueBarrier + warpgroup_);
      DerivativeStore<Cfg>::store_with_derivative(acc, buffers(), tmap_c_, tmap_d_, out_, smem_.fused.bias[warpgroup_],
                                                  warpgroup_, row0, col0);
    } else if constexpr (Cfg::kStagedOperand) {  // the backward form, in place of its staged operand
      StagedOperand<Cfg>::store_times_operand(acc, buffers(), tmap_c_, out_, &smem_.operand.full[warpgroup_],
                                              operand_phase_, smem_.column_sums.sums[warpgroup_], warpgroup_, row0,
                                              col0);
      operand_phase_ ^= 1;
    } else {
      if constexpr (Cfg::kFusedEpilogue)
        FusedOps<Cfg>::apply(acc, out_, row0, col0, bias_pair_, smem_.fused.bias[warpgroup_],
                             Cfg::kFirstEpilogueBarrier + warpgroup_);
      if constexpr (Cfg::kDeferredStore) {
        if (!out_.f32) {  // 16-bit C, by TMA or, where TMA cannot address it, copy_out
          DeferredStore<Cfg>::defer(acc, deferred, tile.batch, row0, col0);
          return;
        }
      }
#pragma unroll
      for (int mb = 0; mb < Cfg::kMmaBlocksM; ++mb) {  // one 64-row block at a time
        const int block_row0 = row0 + mb * Cfg::kMmaM;
        if constexpr (Cfg::kTmaStoreEpilogue) {
          TmaStore<Cfg>::store(Mainloop<Cfg>::block(acc, mb), buffers(), tmap_c_, out_, warpgroup_, tile.batch,
                               block_row0, col0);
        } else {
          DirectStore<Cfg>::store(Mainloop<Cfg>::block(acc, mb), out_, tile.batch, block_row0, col0);
        }
      }
    }
  }

  // The TMA stores must have read shared memory before the CTA exits.
  __device__ void finish() {
    if constexpr (Cfg::kTmaStoreEpilogue) TmaStore<Cfg>::finish();
  }

 private:
  __device__ auto& buffers() { return smem_.epilogue.buffers[warpgroup_]; }

  SharedStorage<Cfg>& smem_;
  const int warpgroup_;
  const CUtensorMap* const tmap_c_;
  const CUtensorMap* const tmap_d_;
  const OutputParams& out_;
  uint32_t bias_pair_ = 0;      // the fused epilogue's: this thread's bias pair of the tile
  uint32_t operand_phase_ = 0;  // staged operand: parity of this warpgroup's tiles so far
};

}  // namespace jax_hopper
