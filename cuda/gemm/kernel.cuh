// The kernel: barrier set-up and role dispatch only. Consumer warpgroups 0 and 1 each
// own a 64x256 half of the 128x256 tile; after them comes the TMA producer (V5: one
// warp, threads 256-287; with register reallocation a whole warpgroup of which one
// thread works). V5 launches one CTA per tile; the persistent kinds launch one CTA per
// SM (in 2-CTA clusters) and each walks tiles with a grid stride, pipeline state
// carried on.
#pragma once
#include <cuda.h>

#include <type_traits>

#include "gemm/config.cuh"
#include "gemm/epilogue.cuh"
#include "gemm/mainloop.cuh"
#include "gemm/pipeline.cuh"
#include "gemm/tile_scheduler.cuh"
#include "hopper/cluster.cuh"
#include "hopper/tma.cuh"
#include "hopper/warpgroup.cuh"

namespace jax_hopper {

template <class Cfg>
using SchedulerOf = SwizzledTileScheduler<Cfg::kRasterSwizzle, Cfg::kClusterM>;

template <class Cfg>
using EpilogueOf = std::conditional_t<Cfg::kTmaStoreEpilogue, TmaStoreEpilogue<Cfg>, DirectStoreEpilogue<Cfg>>;

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    gemm_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                const __grid_constant__ CUtensorMap tmap_c, const OutputParams out, const int k_tiles, const SchedulerOf<Cfg> scheduler) {
  using Main = Mainloop<Cfg>;
  extern __shared__ uint8_t smem_raw[];
  const uintptr_t base = reinterpret_cast<uintptr_t>(smem_raw);
  auto& smem = *reinterpret_cast<SharedStorage<Cfg>*>((base + kSmemAlignment - 1) &
                                                      ~uintptr_t(kSmemAlignment - 1));
  const typename Main::Pipe pipe{smem.full, smem.empty};
  if (threadIdx.x == 0) pipe.init(Cfg::kConsumerWarpgroups * Cfg::kClusterM);
  // Peers signal this CTA's barriers: they must all be initialised cluster-wide first.
  if constexpr (Cfg::kClusterM > 1) {
    hopper::cluster_sync();
  } else {
    __syncthreads();
  }

  const int cta_rank = Cfg::kClusterM > 1 ? static_cast<int>(hopper::cluster_cta_rank()) : 0;
  const int64_t first_tile = blockIdx.x / Cfg::kClusterM;
  const int64_t tile_stride = gridDim.x / Cfg::kClusterM;
  const int64_t num_tiles = scheduler.num_tiles();
  const int warpgroup = hopper::warpgroup_index();
  if (warpgroup == Cfg::kConsumerWarpgroups) {
    if constexpr (Cfg::kProducerWarpgroup) hopper::setmaxnreg_dec<Cfg::kProducerRegisters>();
    if (threadIdx.x % Cfg::kProducerThreads == 0) {
      hopper::tma_prefetch_descriptor(&tmap_a);
      hopper::tma_prefetch_descriptor(&tmap_b);
      auto st = producer_start_state<Cfg::kStages>();
      for (int64_t t = first_tile; t < num_tiles; t += tile_stride)
        Main::load(pipe, smem, &tmap_a, &tmap_b, scheduler.tile(t, cta_rank), k_tiles, cta_rank, st);
      Main::drain(pipe, st);
    }
  } else {
    if constexpr (Cfg::kProducerWarpgroup) hopper::setmaxnreg_inc<Cfg::kConsumerRegisters>();
    using Epilogue = EpilogueOf<Cfg>;
    auto read = consumer_start_state<Cfg::kStages>();
    for (int64_t t = first_tile; t < num_tiles; t += tile_stride) {
      const TileCoord tile = scheduler.tile(t, cta_rank);
      float acc[Cfg::kAccumulators];
      Main::mma(pipe, smem, warpgroup, k_tiles, acc, read);
      const int row0 = tile.m_block * Cfg::kBlockM + warpgroup * Cfg::kWarpgroupM;
      const int col0 = tile.n_block * Cfg::kBlockN;
      if constexpr (Cfg::kFusedEpilogue) FusedOps<Cfg>::apply(acc, out, row0, col0);
      if constexpr (Cfg::kTmaStoreEpilogue) {
        Epilogue::store(acc, smem.epilogue.buffers[warpgroup], &tmap_c, out, warpgroup, tile.batch, row0, col0);
      } else {
        Epilogue::store(acc, out, tile.batch, row0, col0);
      }
    }
    if constexpr (Cfg::kTmaStoreEpilogue) Epilogue::finish();
  }
  // No CTA may exit while a peer can still multicast into or arrive on its shared memory.
  if constexpr (Cfg::kClusterM > 1) hopper::cluster_sync();
}

}  // namespace jax_hopper
