// The backward form's bias gradient, reduced in its epilogue: db = the column sums of
// dz = (A*B) * act'(z), from the f32 values before they are rounded. Without it, db is
// a pass of its own over dz (0.076 ms at 8192x16384 f16 on the H200), where XLA folds
// it into the elementwise pass that the backward form replaces.
//
// Each consumer warpgroup sums its 64 rows of the tile and writes them as one row of an
// f32 partial [ceil(M/64)][N] (no atomics: the result does not depend on tile order),
// which the caller sums over its few rows. Within the warpgroup, per 64-column sub-tile:
//  - each thread adds its two rows (r, r + 8) of each accumulator column block;
//  - the 8 lanes sharing columns (lane % 4) reduce-scatter over the warp's 16 rows: 14
//    shuffles leave lane l with the totals of sub-tile columns 2l, 2l + 1;
//  - each warp writes those 64 totals to its row of a [4 warps][256] f32 scratch;
// and after the tile's last sub-tile, a barrier, then thread t adds the 4 warps' values
// of columns 2t, 2t + 1 and stores them.
#pragma once
#include <cstdint>

#include "gemm/gemm.h"
#include "hopper/warpgroup.cuh"

namespace jax_hopper {

template <class Cfg>
struct ColumnSums {
  // wgmma's f32 fragment: thread t holds columns 8j + 2 (t % 4) + {0, 1} of each 8-column
  // block j, in rows r and r + 8 (direct_store.cuh).
  static constexpr int kColsPerBlock = 8;
  static constexpr int kSubtileCols = Cfg::kStoreRowBytes / static_cast<int>(sizeof(typename Cfg::Element));  // 64
  static constexpr int kBlocksPerSubtile = kSubtileCols / kColsPerBlock;                                     // 8
  static constexpr int kLanesPerColumn = hopper::kWarpSize / 4;  // lanes holding the same columns
  // Checked where used: every kind with a TMA-store epilogue names the Scratch type.
  static constexpr bool kShapeOk = kBlocksPerSubtile == kLanesPerColumn && Cfg::kBlockN == 2 * hopper::kWarpgroupSize &&
                                   Cfg::kMmaM == kColumnSumRows;

  using Scratch = float[hopper::kWarpsPerWarpgroup][Cfg::kBlockN];
  // One sub-tile's per-thread sums: block j's two columns, rows r and r + 8 added.
  using SubtileSums = float2[kBlocksPerSubtile];

  __device__ static float2 add(float2 a, float2 b) { return make_float2(a.x + b.x, a.y + b.y); }
  __device__ static float2 pick(bool second, float2 a, float2 b) { return second ? b : a; }
  __device__ static float2 exchange(float2 v, int lane_mask) {
    return make_float2(__shfl_xor_sync(0xffffffffu, v.x, lane_mask), __shfl_xor_sync(0xffffffffu, v.y, lane_mask));
  }

  // Whether this thread's fragment rows r and r + 8 of the warpgroup's 64 (from row0) lie
  // inside M. Rows past M hold A's zero-filled rows times B, NaN where B holds an Inf,
  // and stay out of the sums (jnp's bias gradient sums M rows).
  __device__ static void rows_inside(int row0, int m, bool (&inside)[2]) {
    const int r = row0 + hopper::thread_in_warpgroup() / hopper::kWarpSize * 16 + hopper::lane_index() / 4;
    inside[0] = r < m;
    inside[1] = r + 8 < m;
  }

  // Halving steps over lane bits 4, 3, 2 (lane / 4 = g): at each, a lane keeps the half
  // of its blocks that bit of g selects and adds its partner's copy of that half. Lane l
  // ends with block g = l / 4 summed over the warp's 16 rows: columns 8g + 2 (l % 4) +
  // {0, 1} = 2l + {0, 1} of the sub-tile.
  __device__ static float2 reduce_scatter(const SubtileSums& v) {
    static_assert(kShapeOk, "one 8-column block per lane after the reduce-scatter; thread t finishing columns "
                            "2t, 2t + 1 of the tile; a warpgroup's 64 rows as one row of the partial (gemm.h)");
    const int lane = hopper::lane_index();
    constexpr int kHalf = kBlocksPerSubtile / 2, kQuarter = kHalf / 2;
    const bool hi4 = lane & 16, hi3 = lane & 8, hi2 = lane & 4;
    float2 w[kHalf];
#pragma unroll
    for (int k = 0; k < kHalf; ++k)
      w[k] = add(pick(hi4, v[k], v[k + kHalf]), exchange(pick(hi4, v[k + kHalf], v[k]), 16));
    float2 x[kQuarter];
#pragma unroll
    for (int k = 0; k < kQuarter; ++k)
      x[k] = add(pick(hi3, w[k], w[k + kQuarter]), exchange(pick(hi3, w[k + kQuarter], w[k]), 8));
    return add(pick(hi2, x[0], x[1]), exchange(pick(hi2, x[1], x[0]), 4));
  }

  // This warp's totals of sub-tile s into its scratch row. Called after the sub-tile's
  // warpgroup barrier: the next tile's first write then comes after every thread has
  // passed that tile's first barrier, so after it finished reading this tile's scratch.
  __device__ static void publish(Scratch& scratch, int s, float2 total) {
    const int warp = hopper::thread_in_warpgroup() / hopper::kWarpSize;
    *reinterpret_cast<float2*>(&scratch[warp][s * kSubtileCols + 2 * hopper::lane_index()]) = total;
  }

  // After the last sub-tile: the warpgroup's 64-row totals of the tile's columns into
  // row `row_block` of the partial [.][ld] (columns from col0; none past n).
  __device__ static void write(const Scratch& scratch, float* partial, int64_t ld, int row_block, int col0, int n,
                               uint32_t barrier) {
    hopper::named_barrier_sync(barrier, hopper::kWarpgroupSize);
    const int col = 2 * hopper::thread_in_warpgroup();
    float2 total = *reinterpret_cast<const float2*>(&scratch[0][col]);
#pragma unroll
    for (int w = 1; w < hopper::kWarpsPerWarpgroup; ++w)
      total = add(total, *reinterpret_cast<const float2*>(&scratch[w][col]));
    // n is a multiple of 8 (the host checks), so column pairs are whole.
    if (col0 + col < n) *reinterpret_cast<float2*>(partial + row_block * ld + col0 + col) = total;
  }
};

}  // namespace jax_hopper
