// V5 epilogue: each consumer thread converts its f32 accumulators to the output type
// and stores them straight from registers to global memory, masked at partial tiles.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "hopper/warpgroup.cuh"

namespace jax_hopper {

template <class Element>
struct OutputParams {
  Element* c;
  int64_t ldc;
  int m, n;
  bool paired_stores;  // ldc even and c 4-byte aligned: two columns per store
};

template <class Element>
struct PairOf;
template <>
struct PairOf<__half> {
  using type = __half2;
  __device__ static type convert(float x, float y) { return __floats2half2_rn(x, y); }
};
template <>
struct PairOf<__nv_bfloat16> {
  using type = __nv_bfloat162;
  __device__ static type convert(float x, float y) { return __floats2bfloat162_rn(x, y); }
};

template <class Cfg>
struct DirectStoreEpilogue {
  using Element = typename Cfg::Element;
  using Pair = PairOf<Element>;

  // wgmma m64nN f32 accumulator layout (PTX ISA "Register Fragments"): thread t of the
  // warpgroup holds, for each 8-column block j, rows r and r + 8 with
  // r = 16 * warp + lane / 4, columns 8j + 2 * (lane % 4) + {0, 1}, as
  // acc[4j + {0, 1}] (row r) and acc[4j + {2, 3}] (row r + 8).
  static constexpr int kRowsPerWarp = 16;
  static constexpr int kHalfRows = 8;
  static constexpr int kColsPerBlock = 8;
  static constexpr int kColBlocks = Cfg::kBlockN / kColsPerBlock;

  __device__ static void store(const float (&acc)[Cfg::kAccumulators], const OutputParams<Element>& out,
                               int row0, int col0) {
    const int t = hopper::thread_in_warpgroup();
    const int warp = t / hopper::kWarpSize;
    const int lane = t % hopper::kWarpSize;
    const int r = row0 + warp * kRowsPerWarp + lane / 4;
    const int c = col0 + 2 * (lane % 4);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = r + half * kHalfRows;
      if (row >= out.m) continue;
      Element* dst_row = out.c + static_cast<int64_t>(row) * out.ldc;
#pragma unroll
      for (int j = 0; j < kColBlocks; ++j) {
        const int col = c + j * kColsPerBlock;
        const float x = acc[4 * j + 2 * half];
        const float y = acc[4 * j + 2 * half + 1];
        if (out.paired_stores && col + 1 < out.n) {
          *reinterpret_cast<typename Pair::type*>(dst_row + col) = Pair::convert(x, y);
        } else {
          const auto pair = Pair::convert(x, y);
          if (col < out.n) dst_row[col] = pair.x;
          if (col + 1 < out.n) dst_row[col + 1] = pair.y;
        }
      }
    }
  }
};

}  // namespace jax_hopper
