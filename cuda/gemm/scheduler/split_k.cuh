// Split K's sum of a tile's pieces (the small-M kind, work_list.cuh: SplitKCursor).
#pragma once
#include <cstdint>

#include "gemm/config.cuh"
#include "gemm/epilogue/direct_store.cuh"
#include "gemm/epilogue/output.cuh"
#include "gemm/scheduler/stream_k.cuh"
#include "gemm/scheduler/work_list.cuh"
#include "gemm/shared_storage.cuh"
#include "gemm/timeline.cuh"
#include "hopper/async_copy.cuh"
#include "hopper/cluster.cuh"
#include "hopper/flag.cuh"
#include "hopper/warpgroup.cuh"

namespace jax_hopper {

// Split K (the small-M kind, one CTA per piece of a tile's K range). Two ways to sum a
// tile's pieces, both in piece order, so the bits do not depend on which CTA finishes
// first (deterministic):
// - In a cluster (work.cluster_pieces; up to kMaxClusterPieces pieces): every piece
//   leaves its partial sum in its own shared memory (the ring, free once its mainloop is
//   done); after a cluster barrier each piece reads its share of the tile's columns from
//   all of them through distributed shared memory, sums and stores it; a second barrier
//   keeps every ring alive until all have read. No workspace, no counters to zero, no L2
//   round trips.
// - Through global memory (where clusters do not fit or do not pay: launch.cuh,
//   choose_split_k_clusters): every piece stores its partial sum in its own slot (unit
//   u's: slot u) and counts itself in the tile's arrival counter (zeroed per call); the
//   piece that arrives last sums all of the tile's slots and stores the tile. Nobody
//   waits. The workspace is the stream-K kind's
//   (StreamKParams: `flags` holds one counter per tile). This sum is on the kernel's
//   critical path for the last tiles, and slot by slot it took an L2 round trip per
//   piece (about 1 us each, measured). So the slots are gathered a batch
//   at a time into the ring's shared memory by cp.async (no register per load in
//   flight), each thread fetching and reading back only its own elements: one round
//   trip per batch.
template <class Cfg>
struct SplitKReduce {
  using Slots = StreamKFixup<Cfg>;
  static constexpr int kVectors = Slots::kVectors;
  static constexpr int kRowsPerWarp = Cfg::kWarpgroupM / hopper::kWarpsPerWarpgroup;
  static constexpr int kRingVectors = static_cast<int>(sizeof(typename SharedStorage<Cfg>::Stage)) * Cfg::kStages /
                                      static_cast<int>(sizeof(float4));

  // Threads of the warps holding any of `rows` (> 0) rows inside M (with few rows, fewer
  // warps hold them).
  __device__ static int threads_with_rows(int rows) {
    const int warps = rows >= Cfg::kWarpgroupM ? hopper::kWarpsPerWarpgroup : (rows + kRowsPerWarp - 1) / kRowsPerWarp;
    return warps * hopper::kWarpSize;
  }

  static constexpr size_t workspace_bytes(int64_t units) {
    return static_cast<size_t>(units) * Slots::kSlotVectors * sizeof(float4);
  }

  // The cluster barriers of the in-cluster sum, for the threads that hold no partial sum
  // (the producer warp): every thread of every CTA of the cluster passes each of them.
  // Nothing of theirs to publish: relaxed arrivals.
  __device__ static void hold_for_peers(const WorkList& work) {
    if (!work.cluster_pieces) return;
    hopper::cluster_sync_relaxed();  // the partial sums are in shared memory
    hopper::cluster_sync_relaxed();  // every piece has read its columns of them
  }

  // The end of a piece that summed in a cluster (reduce_in_cluster arrived at the last
  // barrier): it waits there before it exits, so no peer still reads its ring.
  __device__ static void finish(const WorkList& work, bool summed) {
    if (work.cluster_pieces && summed) hopper::cluster_wait();
  }

  // Returns whether this CTA's warpgroup holds the tile's total in `acc` and must store it
  // (in a cluster, every piece stores its own columns of the tile: never).
  __device__ static bool reduce(float (&acc)[Cfg::kAccumulators], const StreamKParams& p, const WorkList& work,
                                const WorkUnit& unit, SharedStorage<Cfg>& smem, int warpgroup,
                                const OutputParams& out, int batch, int row0, int col0) {
    const int rows = out.m - row0;
    if (work.cluster_pieces) {
      reduce_in_cluster(acc, work, unit, smem, warpgroup, out, batch, row0, col0);
      return false;
    }
    const uint32_t barrier = Cfg::kFirstEpilogueBarrier + warpgroup;
    Slots::store_partial(acc, p.workspace + work.split_unit(unit.tile, unit.piece) * Slots::kSlotVectors, rows);
    __threadfence();  // each thread's stores before the barrier, then one arrival for all
    hopper::named_barrier_sync(barrier, hopper::kWarpgroupSize);
    bool last = false;
    if (hopper::thread_in_warpgroup() == 0) {
      last = hopper::arrive_count(&p.flags[unit.tile]) == static_cast<uint32_t>(work.pieces - 1);
    }
    if (!hopper::named_barrier_any(barrier, hopper::kWarpgroupSize, last)) return false;
    __threadfence();  // every thread's loads after the last arrival's acquire
    JH_TIMELINE_MARK(threadIdx.x == 0, kTimelinePartialsReady);
#pragma unroll
    for (int i = 0; i < Cfg::kAccumulators; ++i) acc[i] = 0.0f;
    if (!Slots::warp_has_rows(rows)) return true;
    // The ring's shared memory, split between the threads of the warps holding rows
    // (with few rows, fewer warps get more of it): [batch slot][vector][thread].
    const int threads = threads_with_rows(rows);
    const int per_batch = kRingVectors / (threads * kVectors);
    const int t = hopper::thread_in_warpgroup();
    float4* ring = reinterpret_cast<float4*>(&smem.stages[0]);
    for (int first = 0; first < work.pieces; first += per_batch) {
      const int n = work.pieces - first < per_batch ? work.pieces - first : per_batch;
      for (int b = 0; b < n; ++b) {
        const float4* src = p.workspace + work.split_unit(unit.tile, first + b) * Slots::kSlotVectors;
#pragma unroll
        for (int v = 0; v < kVectors; ++v)
          hopper::copy_async_16(&ring[(b * kVectors + v) * threads + t], src + v * hopper::kWarpgroupSize + t);
      }
      hopper::copy_async_wait_all();
      for (int b = 0; b < n; ++b) {  // in piece order
#pragma unroll
        for (int v = 0; v < kVectors; ++v) Slots::add_vector(acc, v, ring[(b * kVectors + v) * threads + t]);
      }
    }
    return true;
  }

  // The in-cluster sum (cluster rank = piece), scattered over the pieces: each leaves its
  // partial sum in its own ring; after a cluster barrier, piece p adds up column blocks
  // [p * kVectors / P, (p + 1) * kVectors / P) of all P partial sums in piece order (its
  // own from shared memory, the others' through distributed shared memory) and stores
  // those columns of C; a second barrier keeps every ring alive until all have read.
  // Summed by piece 0 alone, all P - 1 partial sums crossed into one SM, 1.4-2.9 us after
  // the last mainloop (distributed shared memory moved 10-25 GB/s into it; a bulk push
  // instead of loads was no faster). Here each
  // SM takes in (P - 1) / P of one partial sum.
  __device__ static void reduce_in_cluster(const float (&acc)[Cfg::kAccumulators], const WorkList& work,
                                           const WorkUnit& unit, SharedStorage<Cfg>& smem, int warpgroup,
                                           const OutputParams& out, int batch, int row0, int col0) {
    static_assert(Slots::kSlotVectors <= kRingVectors, "a partial sum fits in the ring");
    float4* ring = reinterpret_cast<float4*>(&smem.stages[0]);
    const int t = hopper::thread_in_warpgroup();
    const int threads = threads_with_rows(out.m - row0);  // the partial sum: [vector][thread of these]
    // Every warp's wgmma reads of the ring are retired before any warp overwrites it.
    hopper::named_barrier_sync(Cfg::kFirstEpilogueBarrier + warpgroup, hopper::kWarpgroupSize);
    if (t < threads) {
#pragma unroll
      for (int v = 0; v < kVectors; ++v)
        ring[v * threads + t] = make_float4(acc[4 * v], acc[4 * v + 1], acc[4 * v + 2], acc[4 * v + 3]);
    }
    hopper::cluster_sync();  // releases this piece's partial sum, acquires the others'
    JH_TIMELINE_MARK(threadIdx.x == 0, kTimelinePartialsReady);
    switch (work.pieces) {  // compile-time piece counts keep the loads in registers
      case 2: sum_columns<2>(ring, unit.piece, threads, out, batch, row0, col0); break;
      case 3: sum_columns<3>(ring, unit.piece, threads, out, batch, row0, col0); break;
      case 4: sum_columns<4>(ring, unit.piece, threads, out, batch, row0, col0); break;
      case 5: sum_columns<5>(ring, unit.piece, threads, out, batch, row0, col0); break;
      case 6: sum_columns<6>(ring, unit.piece, threads, out, batch, row0, col0); break;
      case 7: sum_columns<7>(ring, unit.piece, threads, out, batch, row0, col0); break;
      case 8: sum_columns<8>(ring, unit.piece, threads, out, batch, row0, col0); break;
      default: hopper::cluster_arrive_relaxed(); break;  // none: the host forms clusters of 2 .. kMaxClusterPieces
    }
    static_assert(kMaxClusterPieces == 8, "a case per cluster size");
    JH_TIMELINE_MARK(threadIdx.x == 0, kTimelineSummed);
  }

  // This piece's columns of the tile: every load first (kPieces per element, at most
  // ceil(kVectors / kPieces) elements per thread), then the sums in piece order and the
  // stores. Element e of the piece's slice is vector v, thread u of the partial-sum layout:
  // C rows r and r + 8, columns c and c + 1 of the wgmma fragment (DirectStore).
  template <int kPieces>
  __device__ static void sum_columns(float4* ring, int piece, int threads, const OutputParams& out, int batch,
                                     int row0, int col0) {
    using Direct = DirectStore<Cfg>;
    constexpr int kPerThread = (kVectors + kPieces - 1) / kPieces;
    const int first = piece * kVectors / kPieces * threads;  // the slice's first element
    const int count = ((piece + 1) * kVectors / kPieces) * threads - first;
    const int t = hopper::thread_in_warpgroup();
    float4 x[kPerThread][kPieces];
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int e = i * hopper::kWarpgroupSize + t;
      if (e < count) {
#pragma unroll
        for (int q = 0; q < kPieces; ++q)
          x[i][q] = q == piece ? ring[first + e] : hopper::load_shared_cluster_v4(&ring[first + e], q);
      }
    }
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {  // (past `count`, sums of unloaded registers, never stored)
#pragma unroll
      for (int q = 1; q < kPieces; ++q) {
        x[i][0].x += x[i][q].x;
        x[i][0].y += x[i][q].y;
        x[i][0].z += x[i][q].z;
        x[i][0].w += x[i][q].w;
      }
    }
    // Done reading the others' rings: every load's value has been used above, so a relaxed
    // arrival (no MEMBAR.ALL.GPU, which a release costs) cannot pass a load still in flight.
    // The empty asm makes each sum an input of a volatile asm before the arrival's, so the
    // compiler cannot sink an add (and with it the use of a load) below the arrival.
#pragma unroll
    for (int i = 0; i < kPerThread; ++i)
      asm volatile("" ::"f"(x[i][0].x), "f"(x[i][0].y), "f"(x[i][0].z), "f"(x[i][0].w));
    hopper::cluster_arrive_relaxed();
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int e = i * hopper::kWarpgroupSize + t;
      if (e >= count) continue;
      const float4 sum = x[i][0];
      const int v = (first + e) / threads;
      const int u = (first + e) % threads;
      const int lane = u % hopper::kWarpSize;
      const int row = row0 + u / hopper::kWarpSize * Direct::kRowsPerWarp + lane / 4;
      const int col = col0 + v * Direct::kColsPerBlock + 2 * (lane % 4);
      if (row < out.m) Direct::store_pair(out, batch, row, col, sum.x, sum.y);
      if (row + Direct::kHalfRows < out.m) Direct::store_pair(out, batch, row + Direct::kHalfRows, col, sum.z, sum.w);
    }
  }
};

}  // namespace jax_hopper
