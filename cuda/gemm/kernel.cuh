// The kernel: barrier set-up and role dispatch only. Consumer warpgroups 0 .. n-1 each
// own 64 rows x 256 columns of the tile (n = 2: 128x256; the f16-accumulating kind,
// n = 4: 256x256), or (ping-pong) whole 128x128 tiles, taking the CTA's tiles in turn.
// After them comes the TMA producer (V5: one warp, threads 256-287; with register
// reallocation a whole warpgroup of which one thread works). V5 launches one CTA per
// tile, the small-M kind one per piece of a tile's K range; the persistent kinds launch
// one CTA per SM (in 2-CTA clusters) and each walks tiles, pipeline state carried on:
// the default and the fused kinds in the order clusters finish (tickets,
// scheduler/tile_tickets.cuh), the others with a grid stride. The default's consumers store a
// tile during the next one's first K tiles (epilogue/deferred_store.cuh).
#pragma once
#include <cuda.h>

#include <type_traits>

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
                const TileOrderOf<Cfg> scheduler, const StreamKParams stream_k,
                const __grid_constant__ CUtensorMap tmap_d,  // the derivative kind's D, or the backward
                                                             // form's staged operand
                uint32_t* tile_counter) {  // the dynamic order's tickets, zeroed per call
                                           // (the last two: the other parameters keep their offsets)
  using Main = Mainloop<Cfg>;
  JH_TIMELINE_MARK(threadIdx.x == 0, kTimelineEntry);
  extern __shared__ uint8_t smem_raw[];
  const uintptr_t base = reinterpret_cast<uintptr_t>(smem_raw);
  auto& smem = *reinterpret_cast<SharedStorage<Cfg>*>((base + kSmemAlignment - 1) &
                                                      ~uintptr_t(kSmemAlignment - 1));
  const typename Main::Pipe pipe{smem.full, smem.empty};
  if (threadIdx.x == 0) {
    if constexpr (Cfg::kPingpong)
      for (int w = 0; w < Cfg::kConsumerWarpgroups; ++w)
        hopper::mbarrier_init(&smem.turns.turn[w], hopper::kWarpgroupSize);
    if constexpr (Cfg::kStagedOperand)
      for (int w = 0; w < Cfg::kConsumerWarpgroups; ++w) hopper::mbarrier_init(&smem.operand.full[w], 1);
    if constexpr (Cfg::kDynamicTiles) TileTickets<Cfg::kStages, Cfg::kClusterM>::init(smem.dynamic.tickets);
    pipe.init(Cfg::kStageReaders * Cfg::kClusterM);  // its fence covers the turn, operand and mailbox barriers too
  }
  // Peers signal this CTA's barriers: they must all be initialised cluster-wide first.
  if constexpr (Cfg::kClusterM > 1) {
    hopper::cluster_sync();
  } else {
    __syncthreads();
  }

  const int cta_rank = Cfg::kClusterM > 1 ? static_cast<int>(hopper::cluster_cta_rank()) : 0;
  const int64_t cluster = blockIdx.x / Cfg::kClusterM;  // V5: one tile per CTA, one unit
  // A warp-uniform index puts the consumers' wgmma descriptors in uniform registers:
  // 88 -> 48 instructions per warp per K tile, 1-3% faster. The
  // forward fused kind's epilogue (32 bytes) and the kPersistentTma ablation's (16)
  // would then spill, so those two keep the plain index; the derivative and backward
  // forms fit (the backward form since it lost its unstaged path).
  constexpr bool kPlainIndex = Cfg::kKind == KernelKind::kPersistentFused || Cfg::kKind == KernelKind::kPersistentTma;
  const int warpgroup = kPlainIndex ? hopper::warpgroup_index() : hopper::warpgroup_index_uniform();
  if (warpgroup == Cfg::kConsumerWarpgroups) {
    if constexpr (Cfg::kProducerWarpgroup) hopper::setmaxnreg_dec<Cfg::kProducerRegisters>();
    if (threadIdx.x % Cfg::kProducerThreads == 0) {
      hopper::tma_prefetch_descriptor(&tmap_a);
      hopper::tma_prefetch_descriptor(&tmap_b);
      auto st = producer_start_state<Cfg::kStages>();
      JH_TIMELINE_MARK(true, kTimelineProducer);
      if constexpr (Cfg::kDynamicTiles) {
        auto& slots = smem.dynamic.tickets;
        TileTickets<Cfg::kStages, Cfg::kClusterM> tickets(slots, tile_counter, work.num_tiles, work.clusters, cluster,
                                                          cta_rank);
        for (int32_t t = tickets.first(); t != kNoTile; t = tickets.next()) {  // tiles fit in int32 (host-checked)
          const TileCoord tile = scheduler.tile(t, cta_rank);
          Main::load(pipe, smem, &tmap_a, &tmap_b, tile, 0, work.k_tiles, cta_rank, work.a_box_rows, st,
                     [&slots, tile, cta_rank](int index, uint64_t* bar) {
                       return mark_stage(slots, index, tile, static_cast<uint32_t>(cta_rank), bar);
                     });
        }
        // The end mark: a fresh stage with no loads, only the mark.
        pipe.producer_acquire(st);
        uint64_t* bar = pipe.producer_barrier(st);
        const TileCoord end{kNoTile, 0, 0};
        pipe.producer_expect(st, mark_stage(slots, st.index, end, static_cast<uint32_t>(cta_rank), bar));
        st.advance();
        Main::drain(pipe, st, Cfg::kStages - 1);  // the end mark's stage is acquired already
      } else {
        auto cursor = work_cursor<Cfg>(work, cluster);
        for (WorkUnit unit; cursor.next(unit);)
          Main::load(pipe, smem, &tmap_a, &tmap_b, scheduler.tile(unit.tile, cta_rank), unit.k_begin, unit.k_end,
                     cta_rank, work.a_box_rows, st);
        Main::drain(pipe, st);
      }
    }
    if constexpr (Cfg::kSplitK) {
      __syncwarp();  // the cluster barriers are .aligned: the whole warp, converged
      SplitKReduce<Cfg>::hold_for_peers(work);
    }
  } else {
    if constexpr (Cfg::kProducerWarpgroup) hopper::setmaxnreg_inc<Cfg::kConsumerRegisters>();
    using Epi = EpilogueOf<Cfg>;
    auto read = consumer_start_state<Cfg::kStages>();
    auto cursor = [&] {
      if constexpr (Cfg::kDynamicTiles) {
        return StageTileCursor<typename Main::Pipe, typename Main::State>{pipe, smem.dynamic.tickets.stage_tile, read,
                                                                          work.k_tiles};
      } else {
        return work_cursor<Cfg>(work, cluster);
      }
    }();
    int64_t unit_index = 0;  // this CTA's units so far (ping-pong: whose turn it is)
    int64_t own_units = 0;   // ping-pong: this warpgroup's units so far
    uint32_t operand_phase = 0;  // staged operand: parity of this warpgroup's tiles so far
    bool summed = false;  // split K: this CTA's piece went through SplitKReduce
    typename DeferredStore<Cfg>::Pending pending;  // the deferred store's previous tile
    pending.valid = false;
    // Ping-pong: the other warpgroup may start its next mainloop. Every thread arrives
    // (not one elected): a phase then also proves that each of this warpgroup's warps
    // passed its own turn wait, so no warp can fall two phases behind (K <= 64 or a
    // unit past M has no wgmma to keep the warps together).
    const auto hand_over = [&] {
      if constexpr (Cfg::kPingpong) hopper::mbarrier_arrive(&smem.turns.turn[1 - warpgroup]);
    };
    for (WorkUnit unit; cursor.next(unit); ++unit_index) {
      const int k_tiles = unit.k_end - unit.k_begin;
      if constexpr (Cfg::kPingpong) {
        static_assert(Cfg::kConsumerWarpgroups == 2, "ping-pong alternates two warpgroups");
        if (unit_index % Cfg::kConsumerWarpgroups != warpgroup) {
          Main::skip(k_tiles, read);
          continue;
        }
        // Unit u waits until the mainloop of unit u - 1 (the other warpgroup's) has waited
        // for all its stages: the c-th hand-over to this warpgroup (c = 1, 2, ...)
        // completes phase c - 1, whose parity the wait names.
        const int64_t handovers_needed = warpgroup == 0 ? own_units : own_units + 1;
        if (handovers_needed > 0)
          hopper::mbarrier_wait(&smem.turns.turn[warpgroup], static_cast<uint32_t>((handovers_needed - 1) & 1));
        ++own_units;
      }
      TileCoord tile;
      if constexpr (Cfg::kDynamicTiles) {
        tile = cursor.coord;  // decoded by the producer
      } else {
        tile = scheduler.tile(unit.tile, cta_rank);
      }
      // Cooperative kinds: this warpgroup's rows of the tile (and A's 64-row slice);
      // ping-pong: the whole tile.
      const int a_slice = Cfg::kPingpong ? 0 : warpgroup;
      const int row0 = tile.m_block * Cfg::kBlockM + a_slice * Cfg::kMmaM;
      const int col0 = tile.n_block * Cfg::kBlockN;
      // Rows all past M (small M: the second warpgroup, the cluster's second CTA; in
      // ping-pong a whole tile past M): no MMAs, no stores. A stream-K finisher and its contributors share a tile, CTA rank
      // and warpgroup, so they skip together (nothing is published or awaited); so do a
      // tile's split-K pieces, which still pass their cluster's barriers (hold_for_peers).
      if (row0 >= out.m) {
        if constexpr (Cfg::kDeferredStore) DeferredStore<Cfg>::flush(pending, smem.epilogue.buffers[warpgroup], &tmap_c, out, warpgroup, 0);
        Main::pass(pipe, k_tiles, read, Cfg::kFirstEpilogueBarrier + warpgroup);
        hand_over();
        if constexpr (Cfg::kSplitK) SplitKReduce<Cfg>::hold_for_peers(work);
        continue;
      }
      uint32_t bias_pair = 0;
      if constexpr (Cfg::kFusedEpilogue && !Cfg::kStagedOperand)
        bias_pair = FusedOps<Cfg>::prefetch(out, row0, col0);
      typename Main::Acc acc;
      // The backward form's staged operand loads while the mainloop runs.
      const auto load_operand = [&] {
        if constexpr (Cfg::kStagedOperand)
          StagedOperand<Cfg>::load_operand(smem.epilogue.buffers[warpgroup], &tmap_d, &smem.operand.full[warpgroup], row0,
                                 col0);
      };
      const auto store_pending = [&](int kt) {
        if constexpr (Cfg::kDeferredStore)
          DeferredStore<Cfg>::store_pending_during(pending, smem.epilogue.buffers[warpgroup], &tmap_c, out, warpgroup, kt);
      };
      Main::mma(pipe, smem, a_slice, k_tiles, acc, read, hand_over, load_operand, store_pending);
      JH_TIMELINE_MARK(threadIdx.x == 0, kTimelineMainloopDone);
      // What the previous tile left to store goes before any path below leaves the unit.
      if constexpr (Cfg::kDeferredStore)
        DeferredStore<Cfg>::flush(pending, smem.epilogue.buffers[warpgroup], &tmap_c, out, warpgroup, k_tiles);
      if constexpr (Cfg::kStreamK) {
        using Fixup = StreamKFixup<Cfg>;
        if (unit.role == UnitRole::kContributor) {
          Fixup::publish(acc, stream_k, cluster, cta_rank, warpgroup, out.m - row0);
          continue;
        }
        if (unit.role == UnitRole::kFinisher) {
          const int64_t tile_end = work.tail_tile_end(unit.tile);
          for (int64_t r = work.range_of(cluster) + 1; r < work.ranges() && work.tail_begin(r) < tile_end; ++r)
            if (work.has_tail_work(r))
              Fixup::accumulate(acc, stream_k, work.cluster_of(r), cta_rank, warpgroup, out.m - row0);
        }
      }
      if constexpr (Cfg::kSplitK) {
        summed = unit.role == UnitRole::kContributor;
        if (summed &&
            !SplitKReduce<Cfg>::reduce(acc, stream_k, work, unit, smem, warpgroup, out, tile.batch, row0, col0))
          continue;  // another piece of the tile stores it, or (in a cluster) each piece its columns
        JH_TIMELINE_MARK(threadIdx.x == 0, kTimelineSummed);
      }
      if constexpr (Cfg::kSavesDerivative) {  // act and act' computed as the sub-tiles are staged
        FusedOps<Cfg>::share_bias(out, bias_pair, smem.fused.bias[warpgroup], Cfg::kFirstEpilogueBarrier + warpgroup);
        DerivativeStore<Cfg>::store_with_derivative(acc, smem.epilogue.buffers[warpgroup], &tmap_c, &tmap_d, out,
                                        smem.fused.bias[warpgroup], warpgroup, row0, col0);
        continue;
      }
      if constexpr (Cfg::kStagedOperand) {  // the backward form, in place of its staged operand
        StagedOperand<Cfg>::store_times_operand(acc, smem.epilogue.buffers[warpgroup], &tmap_c, out,
                                      &smem.operand.full[warpgroup], operand_phase, smem.column_sums.sums[warpgroup],
                                      warpgroup, row0, col0);
        operand_phase ^= 1;
      } else {
        if constexpr (Cfg::kFusedEpilogue)
          FusedOps<Cfg>::apply(acc, out, row0, col0, bias_pair, smem.fused.bias[warpgroup],
                               Cfg::kFirstEpilogueBarrier + warpgroup);
        if constexpr (Cfg::kDeferredStore) {
          if (!out.f32) {  // 16-bit C, by TMA or, where TMA cannot address it, copy_out
            DeferredStore<Cfg>::defer(acc, pending, tile.batch, row0, col0);
            continue;
          }
        }
#pragma unroll
        for (int mb = 0; mb < Cfg::kMmaBlocksM; ++mb) {  // one 64-row block at a time
          const int block_row0 = row0 + mb * Cfg::kMmaM;
          if constexpr (Cfg::kTmaStoreEpilogue) {
            Epi::store(Main::block(acc, mb), smem.epilogue.buffers[warpgroup], &tmap_c, out, warpgroup,
                            tile.batch, block_row0, col0);
          } else {
            Epi::store(Main::block(acc, mb), out, tile.batch, block_row0, col0);
          }
        }
      }
    }
    if constexpr (Cfg::kDeferredStore) DeferredStore<Cfg>::flush(pending, smem.epilogue.buffers[warpgroup], &tmap_c, out, warpgroup, 0);
    JH_TIMELINE_MARK(threadIdx.x == 0, kTimelineStoresIssued);
    if constexpr (Cfg::kTmaStoreEpilogue) Epi::finish();
    if constexpr (Cfg::kSplitK) SplitKReduce<Cfg>::finish(work, summed);
    JH_TIMELINE_MARK(threadIdx.x == 0, kTimelineConsumerDone);
  }
  // No CTA may exit while a peer can still multicast into or arrive on its shared memory.
  // (Split K's clusters: SplitKReduce's second barrier.)
  if constexpr (Cfg::kClusterM > 1) hopper::cluster_sync();
}

}  // namespace jax_hopper
