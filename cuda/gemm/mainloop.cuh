// The V5 mainloop: a TMA producer filling the ring, and consumers that keep one wgmma
// group in flight (wait_group(1)) with the stage release lagging one K tile behind.
#pragma once
#include <cuda.h>

#include "gemm/config.cuh"
#include "gemm/pipeline.cuh"
#include "gemm/scheduler/tile_order.cuh"
#include "gemm/shared_storage.cuh"
#include "gemm/timeline.cuh"
#include "hopper/tma.cuh"
#include "hopper/warpgroup.cuh"
#include "hopper/wgmma.cuh"

namespace jax_hopper {

template <class Cfg>
struct Mainloop {
  using Element = typename Cfg::Element;
  using LayoutA = typename Cfg::LayoutA;
  using LayoutB = typename Cfg::LayoutB;
  using Storage = SharedStorage<Cfg>;
  using State = PipelineState<Cfg::kStages>;
  using Pipe = Pipeline<Cfg::kStages, Cfg::kClusterM>;

  // ---- producer: run by one thread of the producer warp ------------------------------
  // Boxes [first, first + count) of one operand tile; multicast to the whole cluster
  // when the operand is shared (cta_mask != 0).
  template <class Layout>
  __device__ static void load_tile(Element* dst, const CUtensorMap* tmap, uint64_t* bar, int mn0, int k0,
                                   int batch, int first, uint16_t cta_mask) {
#pragma unroll
    for (int i = 0; i < Layout::kBoxesPerCta; ++i) {
      const int box = first + i;
      int32_t inner, outer;
      Layout::box_coords(box, mn0, k0, inner, outer);
      if (cta_mask) {
        hopper::tma_load_3d_multicast(Layout::box_dst(dst, box), tmap, bar, inner, outer, batch, cta_mask);
      } else {
        hopper::tma_load_3d(Layout::box_dst(dst, box), tmap, bar, inner, outer, batch);
      }
    }
  }

  // K tiles [k_begin, k_end) of one output tile. `st` carries on across tiles, so a
  // persistent CTA's producer runs ahead into the next tile while the consumers finish
  // this one. `first_stage(index, full_barrier)` runs once the first K tile's stage is
  // acquired and returns the transaction bytes it adds to the stage's (the dynamic order
  // stores the tile there for the consumers, completing on the stage's barrier).
  struct NoStageMark {
    __device__ uint32_t operator()(int, uint64_t*) const { return 0; }
  };
  // `a_rows`: the rows of A's box (WorkList::a_box_rows), which set the stage's bytes.
  template <class FirstStage = NoStageMark>
  __device__ static void load(const Pipe& pipe, Storage& smem, const CUtensorMap* tmap_a,
                              const CUtensorMap* tmap_b, TileCoord tile, int k_begin, int k_end, int cta_rank,
                              int a_rows, State& st, FirstStage first_stage = {}) {
    load_at(pipe, smem, tmap_a, tmap_b, tile.m_block * Cfg::kBlockM, tile.n_block * Cfg::kBlockN, 0, k_begin, k_end,
            tile.batch, tile.batch, cta_rank, a_rows, st, first_stage);
  }

  // The same from element coordinates: A's rows from m0, B's from n0, K tile kt at K
  // element k_offset + kt * kBlockK, each operand's own batch entry (the grouped kinds:
  // a group's rows anywhere in A, its B entry).
  template <class FirstStage = NoStageMark>
  __device__ static void load_at(const Pipe& pipe, Storage& smem, const CUtensorMap* tmap_a,
                                 const CUtensorMap* tmap_b, int m0, int n0, int k_offset, int k_begin, int k_end,
                                 int batch_a, int batch_b, int cta_rank, int a_rows, State& st,
                                 FirstStage first_stage = {}) {
    const uint32_t stage_bytes = Cfg::stage_bytes(a_rows);
    // This CTA's share of B, delivered to every CTA of the cluster.
    constexpr uint16_t kClusterMask = Cfg::kClusterM > 1 ? (1u << Cfg::kClusterM) - 1 : 0;
    const int first_b_box = cta_rank * LayoutB::kBoxesPerCta;
    for (int kt = k_begin; kt < k_end; ++kt) {
      pipe.producer_acquire(st);
      uint64_t* bar = pipe.producer_barrier(st);
      const uint32_t marked = kt == k_begin ? first_stage(st.index, bar) : 0;
      // Out-of-bounds parts of a box are zero-filled and still count toward the bytes;
      // the peers' shares of B land on this CTA's barrier too.
      pipe.producer_expect(st, stage_bytes + marked);
      auto& stage = smem.stages[st.index];
      const int k0 = k_offset + kt * Cfg::kBlockK;
      load_tile<LayoutA>(stage.a, tmap_a, bar, m0, k0, batch_a, 0, 0);
      load_tile<LayoutB>(stage.b, tmap_b, bar, n0, k0, batch_b, first_b_box, kClusterMask);
      st.advance();
    }
  }

  // Drain: one more acquire per stage waits for the consumers' last release of every
  // stage still in use, so this warp never exits with arrivals on its ring outstanding
  // (`stages` fewer than all when the caller acquired some itself).
  __device__ static void drain(const Pipe& pipe, State& st, int stages = Cfg::kStages) {
    for (int s = 0; s < stages; ++s) {
      pipe.producer_acquire(st);
      st.advance();
    }
  }

  // ---- consumer: run by a whole consumer warpgroup -------------------------------------
  // This warpgroup's accumulator block `mb` (one wgmma row block; the whole accumulator
  // unless a ping-pong warpgroup holds two).
  using Acc = typename Cfg::Accumulator[Cfg::kAccumulatorRegisters];
  using BlockAcc = typename Cfg::Accumulator[Cfg::kBlockAccumulatorRegisters];
  __device__ static BlockAcc& block(Acc& acc, int mb) {
    return *reinterpret_cast<BlockAcc*>(&acc[mb * Cfg::kBlockAccumulatorRegisters]);
  }

  // The MMAs of one K tile: per 16-deep K step, one wgmma per row block of this
  // warpgroup, A's 64-row slices a_slice, a_slice + 1, ... against the tile's B.
  // `accumulate` false starts a fresh sum.
  __device__ static void mma_k_tile(const typename Storage::Stage& stage, int a_slice, Acc& acc, bool accumulate) {
    // Two descriptors built per K tile; every wgmma's is one of them plus a constant.
    const uint64_t desc_a0 = LayoutA::template descriptor<Cfg::kMmaK>(stage.a, a_slice, 0);
    const uint64_t desc_b0 = LayoutB::template descriptor<Cfg::kMmaK>(stage.b, 0, 0);
#pragma unroll
    for (int kk = 0; kk < Cfg::kMmasPerKTile; ++kk) {
      const uint64_t desc_b = desc_b0 + LayoutB::template descriptor_offset<Cfg::kMmaK>(0, kk);
      const int scale_d = (accumulate || kk > 0) ? 1 : 0;
#pragma unroll
      for (int mb = 0; mb < Cfg::kMmaBlocksM; ++mb) {
        const uint64_t desc_a = desc_a0 + LayoutA::template descriptor_offset<Cfg::kMmaK>(mb, kk);
        hopper::wgmma_m64nNk16<Element, LayoutA::kTranspose, LayoutB::kTranspose, Cfg::kBlockN>(
            block(acc, mb), desc_a, desc_b, scale_d);
      }
    }
  }

  // Ping-pong: the other warpgroup's tile. Its stages are neither awaited nor released
  // here (they have one reader per CTA, the other warpgroup); the cursor just steps
  // over them.
  __device__ static void skip(int k_tiles, State& read) {
    for (int kt = 0; kt < k_tiles; ++kt) read.advance();
  }

  // A warpgroup with no rows inside M in this tile keeps the ring's protocol -- waits
  // for each of its K tiles' stages and releases it at once (no wgmma reads it) -- and
  // computes nothing, so the SM's tensor cores serve the other warpgroup alone.
  // `barrier` (a named barrier of this warpgroup alone) holds the release until every
  // warp has waited: with no wgmma to keep the warps together, a lagging warp could
  // otherwise find the stage refilled and its barrier two phases on.
  __device__ static void pass(const Pipe& pipe, int k_tiles, State& read, uint32_t barrier) {
    const bool elected = hopper::thread_in_warpgroup() == 0;
    for (int kt = 0; kt < k_tiles; ++kt) {
      pipe.consumer_wait(read);
      hopper::named_barrier_sync(barrier, hopper::kWarpgroupSize);
      if (elected) pipe.consumer_release(read);
      read.advance();
    }
  }

  // `read` carries on across the tiles of a persistent CTA. Each K tile: wait for its
  // stage, issue its MMAs, then wait until only kMmaInFlight groups are in flight and
  // release the stage of the group that just retired. With kMmaInFlight = 1 (V5 and the
  // default) the stage being read by the group still in flight is never released:
  // release trails read by exactly one stage. `issued()` runs once the last stage has
  // been waited for and its MMAs issued, before the tail retires them (ping-pong hands
  // the tensor cores to the other warpgroup there). `started()` runs once the MMAs of K
  // tile kStartedAfter (or of the last, if there are fewer) are issued: the tile is
  // under way, and the previous tile's epilogue a K tile behind (the backward form
  // loads its staged operand there).
  // `during(kt)` runs once K tile kt's MMAs are committed, before the wait: work there
  // (the deferred store of the previous tile) overlaps them. `ready(kt, stage)` runs
  // once K tile kt's stage has arrived, before its MMAs read it (the ragged
  // contraction zeroes the rows past its group there).
  struct Nothing {
    __device__ void operator()() const {}
    __device__ void operator()(int) const {}
    __device__ void operator()(int, int) const {}
  };
  static constexpr int kStartedAfter = 1;
  template <class Issued = Nothing, class Started = Nothing, class During = Nothing, class Ready = Nothing>
  __device__ static void mma(const Pipe& pipe, const Storage& smem, int a_slice, int k_tiles, Acc& acc,
                             State& read, Issued issued = {}, Started started = {}, During during = {},
                             Ready ready = {}) {
    const bool elected = hopper::thread_in_warpgroup() == 0;
    const int started_after = k_tiles > kStartedAfter ? kStartedAfter : k_tiles - 1;
    State release = read;  // the stage whose MMA retires next
    for (int kt = 0; kt < k_tiles; ++kt) {
      pipe.consumer_wait(read);
      JH_TIMELINE_MARK(kt == 0 && threadIdx.x == 0, kTimelineFirstData);
      ready(kt, read.index);
      hopper::wgmma_fence();
      mma_k_tile(smem.stages[read.index], a_slice, acc, /*accumulate=*/kt > 0);
      hopper::wgmma_commit_group();
      during(kt);
      hopper::wgmma_wait_group<Cfg::kMmaInFlight>();
      if (kt >= Cfg::kMmaInFlight) {
        if (elected) pipe.consumer_release(release);
        release.advance();
      }
      if (kt == started_after) started();
      read.advance();
    }
    issued();
    // Tail: retire what is still in flight and release its stages (the producer's drain
    // waits on them).
    hopper::wgmma_wait_group<0>();
    const int unreleased = k_tiles < Cfg::kMmaInFlight ? k_tiles : Cfg::kMmaInFlight;
    for (int i = 0; i < unreleased; ++i) {
      if (elected) pipe.consumer_release(release);
      release.advance();
    }
  }
};

}  // namespace jax_hopper
