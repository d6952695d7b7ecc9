// V5 epilogue: each consumer thread converts its f32 accumulators to the output type
// and stores them straight from registers to global memory, masked at partial tiles.
// The output type is chosen at run time (the 16-bit input type, or f32 straight from
// the accumulator) so one kernel instance serves both.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "hopper/warpgroup.cuh"

namespace jax_hopper {

struct OutputParams {
  void* c;
  int64_t ldc;
  int64_t batch_stride;  // elements between the outputs of consecutive batch entries
  int m, n;
  bool f32;            // C is f32; else the kernel's 16-bit element type
  bool paired_stores;  // ldc even and c aligned for two-element stores
};

// Two adjacent columns as one store.
template <class T>
struct PairOf;
template <>
struct PairOf<__half> {
  using type = __half2;
  __device__ static type convert(float x, float y) { return __floats2half2_rn(x, y); }
  __device__ static void split(type p, __half& x, __half& y) { x = p.x, y = p.y; }
};
template <>
struct PairOf<__nv_bfloat16> {
  using type = __nv_bfloat162;
  __device__ static type convert(float x, float y) { return __floats2bfloat162_rn(x, y); }
  __device__ static void split(type p, __nv_bfloat16& x, __nv_bfloat16& y) { x = p.x, y = p.y; }
};
template <>
struct PairOf<float> {
  using type = float2;
  __device__ static type convert(float x, float y) { return make_float2(x, y); }
  __device__ static void split(type p, float& x, float& y) { x = p.x, y = p.y; }
};

template <class Cfg>
struct DirectStoreEpilogue {
  // wgmma m64nN f32 accumulator layout (PTX ISA "Register Fragments"): thread t of the
  // warpgroup holds, for each 8-column block j, rows r and r + 8 with
  // r = 16 * warp + lane / 4, columns 8j + 2 * (lane % 4) + {0, 1}, as
  // acc[4j + {0, 1}] (row r) and acc[4j + {2, 3}] (row r + 8).
  static constexpr int kRowsPerWarp = 16;
  static constexpr int kHalfRows = 8;
  static constexpr int kColsPerBlock = 8;
  static constexpr int kColBlocks = Cfg::kBlockN / kColsPerBlock;

  template <class Out>
  __device__ static void store_as(const float (&acc)[Cfg::kAccumulators], const OutputParams& out, int batch,
                                  int row0, int col0) {
    using Pair = PairOf<Out>;
    const int t = hopper::thread_in_warpgroup();
    const int warp = t / hopper::kWarpSize;
    const int lane = t % hopper::kWarpSize;
    const int r = row0 + warp * kRowsPerWarp + lane / 4;
    const int c = col0 + 2 * (lane % 4);
    Out* base = static_cast<Out*>(out.c) + batch * out.batch_stride;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = r + half * kHalfRows;
      if (row >= out.m) continue;
      Out* dst_row = base + static_cast<int64_t>(row) * out.ldc;
#pragma unroll
      for (int j = 0; j < kColBlocks; ++j) {
        const int col = c + j * kColsPerBlock;
        const auto pair = Pair::convert(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
        if (out.paired_stores && col + 1 < out.n) {
          *reinterpret_cast<typename Pair::type*>(dst_row + col) = pair;
        } else {
          Out x, y;
          Pair::split(pair, x, y);
          if (col < out.n) dst_row[col] = x;
          if (col + 1 < out.n) dst_row[col + 1] = y;
        }
      }
    }
  }

  __device__ static void store(const float (&acc)[Cfg::kAccumulators], const OutputParams& out, int batch,
                               int row0, int col0) {
    if (out.f32) {
      store_as<float>(acc, out, batch, row0, col0);
    } else {
      store_as<typename Cfg::Element>(acc, out, batch, row0, col0);
    }
  }
};

}  // namespace jax_hopper
