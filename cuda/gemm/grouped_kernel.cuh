// The grouped kernel (ragged_dot): the GEMM's roles over a schedule of groups. The TMA
// producer and the consumers' mainloop are the persistent kernel's (2-CTA clusters
// multicasting B, a 4-stage ring, one wgmma group in flight); the schedule is the
// group table (scheduler/group_table.cuh), which every CTA builds from the device's
// group sizes at its start; the epilogue is the deferred store (epilogue/
// deferred_store.cuh): a tile's 16-bit output waits in registers and leaves during the
// next tile's first K tiles, staged in shared memory and copied out a row at a time,
// masked at the group's last row, since a tile may cross into the next group's rows (a
// TMA store writes whole boxes). f32 output goes straight from the registers
// (epilogue/direct_store.cuh), masked the same way. Ragged rows then zero C's rows
// past the groups (and, batched, each entry's gap group); the ragged contraction zeroes the rows past its group in the last K
// tile of the group, in both operands, before the MMAs read them.
#pragma once
#include <cuda.h>

#include "gemm/config.cuh"
#include "gemm/epilogue/deferred_store.cuh"
#include "gemm/epilogue/direct_store.cuh"
#include "gemm/epilogue/output.cuh"
#include "gemm/mainloop.cuh"
#include "gemm/pipeline.cuh"
#include "gemm/scheduler/group_table.cuh"
#include "gemm/shared_storage.cuh"
#include "hopper/cluster.cuh"
#include "hopper/tma.cuh"
#include "hopper/warpgroup.cuh"

namespace jax_hopper {

template <class Cfg>
using GroupTableOf =
    GroupTable<Cfg::kBlockM, Cfg::kBlockN, Cfg::kBlockK, Cfg::kClusterM, Cfg::kRasterSwizzle, Cfg::kRaggedK>;

// The ragged contraction's last K tile of a group: its K rows from `rows` on belong to
// no part of the group, so they are zeroed in both operands (both MN-major: K row r is
// the 128 bytes at r * 128 of every box, whatever the swizzle does inside them). Each
// consumer warpgroup zeroes its own slice of A and half of B's boxes (in this CTA's
// copy of the stage), then fences its writes for the MMAs' async proxy; the named
// barrier over both warpgroups keeps either from reading B before the other's half is
// zero.
template <class Cfg>
struct RaggedTail {
  using LayoutA = typename Cfg::LayoutA;
  using LayoutB = typename Cfg::LayoutB;
  static_assert(!LayoutA::kKMajor && !LayoutB::kKMajor, "the ragged contraction reads both operands MN-major");
  static_assert(LayoutA::kBoxes == Cfg::kConsumerWarpgroups && LayoutB::kBoxes % Cfg::kConsumerWarpgroups == 0,
                "an A box per consumer warpgroup, B's boxes shared evenly");
  static constexpr int kBBoxesPerWarpgroup = LayoutB::kBoxes / Cfg::kConsumerWarpgroups;
  static constexpr uint32_t kBarrier = Cfg::kFirstEpilogueBarrier + Cfg::kConsumerWarpgroups;
  static_assert(kBarrier < Cfg::kHardwareBarriers, "a named barrier for the two warpgroups");

  // Every thread takes the same few 16-byte words of each box (a fixed, unrolled
  // count: the accumulators are live here), storing those in rows past `rows`.
  static constexpr int kWordsPerRow = kSwizzleBytes / static_cast<int>(sizeof(uint4));
  static constexpr int kWordsPerThread = Cfg::kBlockK * kWordsPerRow / hopper::kWarpgroupSize;
  __device__ static void zero_rows(void* box, int rows) {
    uint4* words = static_cast<uint4*>(box);
    const int t = hopper::thread_in_warpgroup();
#pragma unroll
    for (int j = 0; j < kWordsPerThread; ++j) {
      const int i = t + j * hopper::kWarpgroupSize;
      if (i / kWordsPerRow >= rows) words[i] = make_uint4(0, 0, 0, 0);
    }
  }

  __device__ static void zero(typename SharedStorage<Cfg>::Stage& stage, int rows, int warpgroup) {
    zero_rows(LayoutA::box_dst(stage.a, warpgroup), rows);
#pragma unroll
    for (int i = 0; i < kBBoxesPerWarpgroup; ++i)
      zero_rows(LayoutB::box_dst(stage.b, warpgroup * kBBoxesPerWarpgroup + i), rows);
    hopper::fence_proxy_async_shared();
    hopper::named_barrier_sync(kBarrier, Cfg::kConsumerWarpgroups * hopper::kWarpgroupSize);
  }
};

// Ragged rows: C's rows from `first_row` to M are no group's and read as zeros. They are
// one contiguous range (C's rows are ldc apart with ldc = N, as the FFI passes them),
// zeroed by every CTA's consumer threads in a grid stride: 16-byte stores where aligned,
// 2-byte ones at the ends (elements are 2 or 4 bytes).
__device__ inline void zero_rows_past(const OutputParams& out, int first_row, int thread, int threads) {
  const int64_t element = out.f32 ? 4 : 2;
  char* const begin = static_cast<char*>(out.c) + int64_t{first_row} * out.ldc * element;
  char* const end = static_cast<char*>(out.c) + int64_t{out.m} * out.ldc * element;
  if (begin >= end) return;
  const auto align_up = [](char* p) { return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + 15) & ~uintptr_t{15}); };
  char* const mid_begin = align_up(begin) < end ? align_up(begin) : end;
  char* const mid_end = reinterpret_cast<char*>(reinterpret_cast<uintptr_t>(end) & ~uintptr_t{15}) > mid_begin
                            ? reinterpret_cast<char*>(reinterpret_cast<uintptr_t>(end) & ~uintptr_t{15})
                            : mid_begin;
  for (char* p = begin + 2 * int64_t{thread}; p < mid_begin; p += 2 * int64_t{threads}) *reinterpret_cast<uint16_t*>(p) = 0;
  for (char* p = mid_end + 2 * int64_t{thread}; p < end; p += 2 * int64_t{threads}) *reinterpret_cast<uint16_t*>(p) = 0;
  uint4* const words = reinterpret_cast<uint4*>(mid_begin);
  const int64_t count = (mid_end - mid_begin) / 16;
  for (int64_t i = thread; i < count; i += threads) words[i] = make_uint4(0, 0, 0, 0);
}

// A warpgroup's 64 rows of a tile as zeros (the ragged contraction's empty groups: C's
// entry is a sum over no rows; batched ragged rows' gaps), masked at `rows` and C's columns.
template <class Cfg>
__device__ void store_zeros(const OutputParams& out, int batch, int row0, int col0, int rows) {
  constexpr int kPairsPerRow = Cfg::kBlockN / 2;
  for (int i = hopper::thread_in_warpgroup(); i < Cfg::kMmaM * kPairsPerRow; i += hopper::kWarpgroupSize) {
    const int row = row0 + i / kPairsPerRow;
    if (row < rows) DirectStore<Cfg>::store_pair(out, batch, row, col0 + 2 * (i % kPairsPerRow), 0.0f, 0.0f);
  }
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kCtasPerSm)
    grouped_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                   const OutputParams out, const GroupedWork work) {
  static_assert(Cfg::kGrouped, "a grouped kind");
  using Main = Mainloop<Cfg>;
  using Table = GroupTableOf<Cfg>;
  extern __shared__ uint8_t smem_raw[];
  const uintptr_t base = reinterpret_cast<uintptr_t>(smem_raw);
  auto& smem = *reinterpret_cast<SharedStorage<Cfg>*>((base + kSmemAlignment - 1) &
                                                      ~uintptr_t(kSmemAlignment - 1));
  const typename Main::Pipe pipe{smem.full, smem.empty};
  if (threadIdx.x == 0) pipe.init(Cfg::kStageReaders * Cfg::kClusterM);
  Table::build(smem.scheduler.groups, work);
  // Peers signal this CTA's barriers, and every thread reads the table: both must be
  // ready cluster-wide first.
  hopper::cluster_sync();

  const Table table{smem.scheduler.groups, work};
  const int cta_rank = static_cast<int>(hopper::cluster_cta_rank());
  const int cluster = static_cast<int>(blockIdx.x) / Cfg::kClusterM;
  const int warpgroup = hopper::warpgroup_index_uniform();
  if (warpgroup == Cfg::kConsumerWarpgroups) {  // the producer
    hopper::setmaxnreg_dec<Cfg::kProducerRegisters>();
    if (threadIdx.x % Cfg::kProducerThreads == 0) {
      hopper::tma_prefetch_descriptor(&tmap_a);
      hopper::tma_prefetch_descriptor(&tmap_b);
      auto st = producer_start_state<Cfg::kStages>();
      for (int t = cluster; t < table.num_tiles(); t += work.clusters) {
        const GroupTile tile = table.tile(t, cta_rank);
        // Ragged rows: A's rows of the group against B's entry g; the contraction: the
        // group's rows of both (A and B stored [rows, ...], 2-D).
        Main::load_at(pipe, smem, &tmap_a, &tmap_b, tile.row0, tile.n0, tile.k0, 0, tile.k_tiles, 0,
                      tile.b_entry, cta_rank, Cfg::LayoutA::kBoxOuter, st);
      }
      Main::drain(pipe, st);
    }
    __syncwarp();  // the lane-0 code above diverged; the cluster barrier below is .aligned
  } else {  // a consumer warpgroup: 64 rows of each tile
    hopper::setmaxnreg_inc<Cfg::kConsumerRegisters>();
    using Deferred = DeferredStore<Cfg>;
    auto read = consumer_start_state<Cfg::kStages>();
    auto& buffers = smem.epilogue.buffers[warpgroup];
    // The previous tile's 16-bit output: stored during this tile's first K tiles, or
    // flushed before a path that leaves the tile without MMAs.
    typename Deferred::Pending pending;
    pending.valid = false;
    const auto flush = [&](int first) { Deferred::flush(pending, buffers, nullptr, out, warpgroup, first); };
    // The tile count is read from the table each time round rather than held in a register.
    for (int t = cluster; t < table.num_tiles(); t += work.clusters) {
      const GroupTile tile = table.tile(t, cta_rank);
      const int row0 = tile.row0 + warpgroup * Cfg::kMmaM;
      const int batch = Cfg::kRaggedK ? tile.group : 0;
      // Ragged rows: rows all past the group (the cluster's second tile of a group with
      // an odd count, or the second warpgroup's half) compute nothing. The contraction
      // keeps both warpgroups in step for RaggedTail's barrier; its stores mask at C's rows.
      if (!Cfg::kRaggedK && row0 >= tile.row_end) {
        flush(0);
        Main::pass(pipe, tile.k_tiles, read, Cfg::kFirstEpilogueBarrier + warpgroup);
        continue;
      }
      // An empty group's sum (the contraction), or a gap's rows (batched ragged rows):
      // zeros, without the accumulators.
      if (tile.k_tiles == 0) {
        flush(0);
        store_zeros<Cfg>(out, batch, row0, tile.n0, tile.row_end);
        continue;
      }
      typename Main::Acc acc;
      const typename Main::Nothing nothing;
      const auto during = [&](int kt) { Deferred::store_pending_during(pending, buffers, nullptr, out, warpgroup, kt); };
      if constexpr (Cfg::kRaggedK) {
        const int last = tile.k_tiles - 1, last_rows = tile.last_k_rows;
        Main::mma(pipe, smem, warpgroup, tile.k_tiles, acc, read, nothing, nothing, during,
                  [&smem, last, last_rows, warpgroup](int kt, int stage) {
                    if (kt == last && last_rows < Cfg::kBlockK)
                      RaggedTail<Cfg>::zero(smem.stages[stage], last_rows, warpgroup);
                  });
      } else {
        Main::mma(pipe, smem, warpgroup, tile.k_tiles, acc, read, nothing, nothing, during);
      }
      flush(tile.k_tiles);  // the sub-tiles this tile's K tiles did not cover
      // The tile's coordinates again: looked up after the mainloop rather than held across
      // it, where the accumulators and the pending tile fill the consumers' registers.
      const GroupTile done = table.tile(t, cta_rank);
      const int done_row0 = done.row0 + warpgroup * Cfg::kMmaM;
      const int done_batch = Cfg::kRaggedK ? done.group : 0;
      if (out.f32) {
        DirectStore<Cfg>::store(acc, out, done_batch, done_row0, done.n0, done.row_end);
      } else {
        Deferred::defer(acc, pending, done_batch, done_row0, done.n0, done.row_end);
      }
    }
    flush(0);
    if constexpr (!Cfg::kRaggedK) {
      constexpr int kConsumerThreads = Cfg::kConsumerWarpgroups * hopper::kWarpgroupSize;
      zero_rows_past(out, table.rows_covered(), static_cast<int>(blockIdx.x) * kConsumerThreads + threadIdx.x,
                     static_cast<int>(gridDim.x) * kConsumerThreads);
    }
  }
  // No CTA may exit while its peer can still multicast into or arrive on its shared memory.
  hopper::cluster_sync();
}

}  // namespace jax_hopper
