// The V5 kernel: barrier set-up and role dispatch only. 288 threads: consumer
// warpgroups 0 and 1 (threads 0-255), each owning a 64x256 half of the 128x256 tile,
// and one TMA producer warp (threads 256-287). One tile per CTA; one CTA per SM.
#pragma once
#include <cuda.h>

#include "gemm/config.cuh"
#include "gemm/epilogue.cuh"
#include "gemm/mainloop.cuh"
#include "gemm/pipeline.cuh"
#include "gemm/tile_scheduler.cuh"
#include "hopper/tma.cuh"
#include "hopper/warpgroup.cuh"

namespace jax_hopper {

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    gemm_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                const OutputParams out, const int k_tiles,
                const SwizzledTileScheduler<Cfg::kRasterSwizzle> scheduler) {
  extern __shared__ uint8_t smem_raw[];
  const uintptr_t base = reinterpret_cast<uintptr_t>(smem_raw);
  auto& smem = *reinterpret_cast<SharedStorage<Cfg>*>((base + kSmemAlignment - 1) &
                                                      ~uintptr_t(kSmemAlignment - 1));
  const Pipeline<Cfg::kStages> pipe{smem.full, smem.empty};
  if (threadIdx.x == 0) pipe.init(Cfg::kConsumerWarpgroups);
  __syncthreads();

  const TileCoord tile = scheduler.tile(blockIdx.x);
  const int warpgroup = hopper::warpgroup_index();
  if (warpgroup == Cfg::kConsumerWarpgroups) {
    if (hopper::lane_index() == 0) {
      hopper::tma_prefetch_descriptor(&tmap_a);
      hopper::tma_prefetch_descriptor(&tmap_b);
      Mainloop<Cfg>::load(pipe, smem, &tmap_a, &tmap_b, tile, k_tiles);
    }
  } else {
    float acc[Cfg::kAccumulators];
    Mainloop<Cfg>::mma(pipe, smem, warpgroup, k_tiles, acc);
    DirectStoreEpilogue<Cfg>::store(acc, out, tile.batch,
                                    tile.m_block * Cfg::kBlockM + warpgroup * Cfg::kWarpgroupM,
                                    tile.n_block * Cfg::kBlockN);
  }
}

}  // namespace jax_hopper
