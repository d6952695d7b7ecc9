// Partial sums handed between CTAs through a global workspace. Stream-K tail
// (work_list.cuh: WorkList): a contributor hands its partial accumulator to the finisher
// of the tile, one flag per (cluster, CTA rank, consumer warpgroup); split K's sum
// through global memory (split_k.cuh) uses the same slots. Each thread stores and loads its own
// accumulator registers as float4s laid out [vector][thread], so both sides coalesce.
// A warp's accumulators are 16 rows of the warpgroup's 64 (wgmma's m64 layout); in the
// small-M kind, warps whose rows all lie past M (M = 16 uses one warp of four) move
// nothing. (Not in the 2-warpgroup stream-K kind: the check costs it a spill at its
// 168-register cap, and its tail tiles are full ones.)
#pragma once
#include <cstdint>

#include "gemm/config.cuh"
#include "hopper/flag.cuh"
#include "hopper/warpgroup.cuh"

namespace jax_hopper {

struct StreamKParams {
  float4* workspace;  // kSlotVectors float4 per slot; null when the tail is not split
  uint32_t* flags;    // one per slot, zeroed before the launch
};

template <class Cfg>
struct StreamKFixup {
  static constexpr int kVectors = Cfg::kAccumulators / 4;  // float4s per thread
  static constexpr int kSlotVectors = kVectors * hopper::kWarpgroupSize;
  static constexpr int kSlotsPerCluster = Cfg::kClusterM * Cfg::kConsumerWarpgroups;
  static constexpr uint32_t kPublished = 1;

  // Workspace bytes / flags for `clusters` clusters (host side).
  static constexpr size_t workspace_bytes(int64_t clusters) {
    return static_cast<size_t>(clusters) * kSlotsPerCluster * kSlotVectors * sizeof(float4);
  }
  static constexpr size_t flag_count(int64_t clusters) { return static_cast<size_t>(clusters) * kSlotsPerCluster; }

  __device__ static int64_t slot(int64_t cluster, int rank, int warpgroup) {
    return (cluster * Cfg::kClusterM + rank) * Cfg::kConsumerWarpgroups + warpgroup;
  }

  // Whether this thread's warp holds any of the `rows` rows left inside M.
  __device__ static bool warp_has_rows(int rows) {
    if constexpr (!Cfg::kSmallM) return true;
    constexpr int kRowsPerWarp = Cfg::kWarpgroupM / hopper::kWarpsPerWarpgroup;
    return hopper::thread_in_warpgroup() / hopper::kWarpSize * kRowsPerWarp < rows;
  }

  // Adds one float4 of a partial sum to accumulators 4v .. 4v + 3.
  __device__ static void add_vector(float (&acc)[Cfg::kAccumulators], int v, float4 x) {
    acc[4 * v] += x.x;
    acc[4 * v + 1] += x.y;
    acc[4 * v + 2] += x.z;
    acc[4 * v + 3] += x.w;
  }

  // This thread's accumulators into / added from a partial-sum slot ([vector][thread]).
  __device__ static void store_partial(const float (&acc)[Cfg::kAccumulators], float4* dst, int rows) {
    const int t = hopper::thread_in_warpgroup();
    if (!warp_has_rows(rows)) return;
#pragma unroll
    for (int v = 0; v < kVectors; ++v)
      dst[v * hopper::kWarpgroupSize + t] = make_float4(acc[4 * v], acc[4 * v + 1], acc[4 * v + 2], acc[4 * v + 3]);
  }
  __device__ static void add_partial(float (&acc)[Cfg::kAccumulators], const float4* src, int rows) {
    const int t = hopper::thread_in_warpgroup();
    if (!warp_has_rows(rows)) return;
#pragma unroll
    for (int v = 0; v < kVectors; ++v)
      add_vector(acc, v, __ldcg(src + v * hopper::kWarpgroupSize + t));  // L2: written by another SM
  }

  __device__ static void publish(const float (&acc)[Cfg::kAccumulators], const StreamKParams& p, int64_t cluster,
                                 int rank, int warpgroup, int rows) {
    const int64_t s = slot(cluster, rank, warpgroup);
    store_partial(acc, p.workspace + s * kSlotVectors, rows);
    __threadfence();  // each thread's stores before the barrier, then one release for all
    hopper::named_barrier_sync(Cfg::kFirstEpilogueBarrier + warpgroup, hopper::kWarpgroupSize);
    if (hopper::thread_in_warpgroup() == 0) hopper::flag_release(&p.flags[s], kPublished);
  }

  // Adds the partial sum of `cluster`'s same rank and warpgroup, once published.
  __device__ static void accumulate(float (&acc)[Cfg::kAccumulators], const StreamKParams& p, int64_t cluster,
                                    int rank, int warpgroup, int rows) {
    const int64_t s = slot(cluster, rank, warpgroup);
    if (hopper::thread_in_warpgroup() == 0) hopper::flag_wait(&p.flags[s], kPublished);
    hopper::named_barrier_sync(Cfg::kFirstEpilogueBarrier + warpgroup, hopper::kWarpgroupSize);
    add_partial(acc, p.workspace + s * kSlotVectors, rows);
  }
};

}  // namespace jax_hopper
