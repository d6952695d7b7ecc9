// The kernel: barrier set-up and role dispatch only. Consumer warpgroups 0 .. n-1 each
// own 64 rows x 256 columns of the tile (n = 2: 128x256; the f16-accumulating kind,
// n = 4: 256x256), or (ping-pong) whole 128x128 tiles, taking the CTA's tiles in turn.
// After them comes the TMA producer (V5: one warp, threads 256-287; with register
// reallocation a whole warpgroup of which one thread works). V5 launches one CTA per
// tile, the small-M kind one per piece of a tile's K range; the persistent kinds launch
// one CTA per SM (in 2-CTA clusters) and each walks tiles, pipeline state carried on.
// The roles, each in its own file:
//  pipeline.cuh, mainloop.cuh     the ring of stages: TMA loads (producer), wgmma (consumers)
//  scheduler/tile_scheduler.cuh   which units of work a CTA takes; partial sums (stream-K,
//                                 split K); ping-pong's turns
//  epilogue/epilogue.cuh          what the accumulators become (the deferred store, the
//                                 fused forms)
// tools/sass_check.py keeps this file's machine code pinned: its objects are built where
// they are used, from the kernel's parameters, and `deferred` stays a local of its own.
#pragma once
#include <cuda.h>

#include "gemm/config.cuh"
#include "gemm/epilogue/epilogue.cuh"
#include "gemm/mainloop.cuh"
#include "gemm/pipeline.cuh"
#include "gemm/scheduler/tile_scheduler.cuh"
#include "gemm/shared_storage.cuh"
#include "gemm/timeline.cuh"
#include "hopper/cluster.cuh"
#include "hopper/tma.cuh"
#include "hopper/warpgroup.cuh"

namespace jax_hopper {

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kCtasPerSm)
    gemm_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                const __grid_constant__ CUtensorMap tmap_c, const OutputParams out, const WorkList work,
                const TileOrderOf<Cfg> order, const StreamKParams stream_k,
                const __grid_constant__ CUtensorMap tmap_d,  // the derivative kind's D, or the backward
                                                             // form's staged operand
                uint32_t* tile_counter) {  // the dynamic order's tickets, zeroed per call
                                           // (the last two: the other parameters keep their offsets)
  using Main = Mainloop<Cfg>;
  using Scheduler = TileScheduler<Cfg>;
  JH_TIMELINE_MARK(threadIdx.x == 0, kTimelineEntry);
  extern __shared__ uint8_t smem_raw[];
  const uintptr_t base = reinterpret_cast<uintptr_t>(smem_raw);
  auto& smem = *reinterpret_cast<SharedStorage<Cfg>*>((base + kSmemAlignment - 1) &
                                                      ~uintptr_t(kSmemAlignment - 1));
  const typename Main::Pipe pipe{smem.full, smem.empty};
  if (threadIdx.x == 0) {
    Epilogue<Cfg>::init(smem);
    Scheduler::init(smem);
    pipe.init(Cfg::kStageReaders * Cfg::kClusterM);  // its fence covers the epilogue's and scheduler's barriers too
  }
  // Peers signal this CTA's barriers: they must all be initialised cluster-wide first.
  if constexpr (Cfg::kClusterM > 1) {
    hopper::cluster_sync();
  } else {
    __syncthreads();
  }

  const int cta_rank = Cfg::kClusterM > 1 ? static_cast<int>(hopper::cluster_cta_rank()) : 0;
  const int64_t cluster = blockIdx.x / Cfg::kClusterM;  // V5: one tile per CTA, one unit
  const Scheduler scheduler{{work, order, stream_k, tile_counter, out, smem, cluster, cta_rank}};
  // A warp-uniform index puts the consumers' wgmma descriptors in uniform registers:
  // 88 -> 48 instructions per warp per K tile, 1-3% faster. The forward fused kind's
  // epilogue (32 bytes) and the kPersistentTma ablation's (16) would then spill, so those
  // two keep the plain index.
  constexpr bool kPlainIndex = Cfg::kKind == KernelKind::kPersistentFused || Cfg::kKind == KernelKind::kPersistentTma;
  const int warpgroup = kPlainIndex ? hopper::warpgroup_index() : hopper::warpgroup_index_uniform();
  if (warpgroup == Cfg::kConsumerWarpgroups) {  // the producer
    if constexpr (Cfg::kProducerWarpgroup) hopper::setmaxnreg_dec<Cfg::kProducerRegisters>();
    if (threadIdx.x % Cfg::kProducerThreads == 0) {
      hopper::tma_prefetch_descriptor(&tmap_a);
      hopper::tma_prefetch_descriptor(&tmap_b);
      auto st = producer_start_state<Cfg::kStages>();
      JH_TIMELINE_MARK(true, kTimelineProducer);
      if constexpr (Scheduler::kTicketed) {  // units are tile indices, the first known before the loop
        typename Scheduler::Producer tiles(smem, tile_counter, work, cluster, cta_rank);
        for (int32_t t = tiles.first(); t != kNoTile; t = tiles.next()) {
          const TileCoord tile = scheduler.tile(t);
          Main::load(pipe, smem, &tmap_a, &tmap_b, tile, 0, work.k_tiles, cta_rank, work.a_box_rows, st,
                     typename Scheduler::StageMark{scheduler, tile});
        }
      } else {
        auto units = Scheduler::producer(work, cluster);  // the same walk as the consumers'
        for (WorkUnit unit; units.next(unit);)
          Main::load(pipe, smem, &tmap_a, &tmap_b, scheduler.tile(unit), unit.k_begin, unit.k_end, cta_rank,
                     work.a_box_rows, st);
      }
      scheduler.end(pipe, st);
      Main::drain(pipe, st, Cfg::kStages - Scheduler::kEndStages);  // the end's stages are acquired already
    }
    // The lane-0 code above diverged; the cluster barriers after it are .aligned.
    if constexpr (Cfg::kClusterM > 1 || Cfg::kSplitK) __syncwarp();
    scheduler.producer_done();
  } else {  // a consumer warpgroup
    if constexpr (Cfg::kProducerWarpgroup) hopper::setmaxnreg_inc<Cfg::kConsumerRegisters>();
    auto read = consumer_start_state<Cfg::kStages>();
    auto units = consumer_units(scheduler, smem, work, cluster, pipe, read, warpgroup);
    Epilogue<Cfg> epilogue(smem, warpgroup, &tmap_c, &tmap_d, out);
    typename Epilogue<Cfg>::Deferred deferred;
    Epilogue<Cfg>::no_deferred(deferred);
    for (WorkUnit unit; units.next(unit);) {
      const int k_tiles = unit.k_end - unit.k_begin;
      const TileCoord tile = units.tile(scheduler, unit);
      // Cooperative kinds: this warpgroup's rows of the tile (and A's 64-row slice);
      // ping-pong: the whole tile.
      const int a_slice = Cfg::kPingpong ? 0 : warpgroup;
      const int row0 = tile.m_block * Cfg::kBlockM + a_slice * Cfg::kMmaM;
      const int col0 = tile.n_block * Cfg::kBlockN;
      // Rows all past M (small M: the second warpgroup, the cluster's second CTA; in
      // ping-pong a whole tile past M): no MMAs, no stores. A stream-K finisher and its
      // contributors share a tile, CTA rank and warpgroup, so they skip together (nothing
      // is published or awaited); so do a tile's split-K pieces, which still pass their
      // cluster's barriers (skipped).
      if (row0 >= out.m) {
        epilogue.flush(deferred, 0);
        Main::pass(pipe, k_tiles, read, Cfg::kFirstEpilogueBarrier + warpgroup);
        units.hand_over();
        units.skipped();
        continue;
      }
      epilogue.begin_tile(row0, col0);
      typename Main::Acc acc;
      Main::mma(
          pipe, smem, a_slice, k_tiles, acc, read, [&] { units.hand_over(); }, [&] { epilogue.started(row0, col0); },
          [&](int kt) { epilogue.during(deferred, kt); });
      JH_TIMELINE_MARK(threadIdx.x == 0, kTimelineMainloopDone);
      epilogue.flush(deferred, k_tiles);  // what the previous tile left, before any path leaves the unit
      if constexpr (Scheduler::kPartialSums) {  // handed on, or summed with the tile's other pieces
        if (!units.finish_unit(acc, unit, tile, row0, col0)) continue;
      }
      epilogue.store(deferred, acc, tile, row0, col0);
    }
    epilogue.flush(deferred, 0);
    JH_TIMELINE_MARK(threadIdx.x == 0, kTimelineStoresIssued);
    epilogue.finish();
    units.finish();
    JH_TIMELINE_MARK(threadIdx.x == 0, kTimelineConsumerDone);
  }
  // No CTA may exit while a peer can still multicast into or arrive on its shared memory.
  // (Split K's clusters: SplitKReduce's second barrier.)
  if constexpr (Cfg::kClusterM > 1) hopper::cluster_sync();
}

}  // namespace jax_hopper
