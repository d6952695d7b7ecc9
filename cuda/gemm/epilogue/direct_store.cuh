// The seed's epilogue (V5): each thread stores its accumulator registers straight to C,
// masked at partial tiles. Also the fallback of the TMA-store epilogue for C that TMA
// cannot address, and split K's store of summed columns.
#pragma once
#include <cstdint>

#include "gemm/epilogue/output.cuh"
#include "hopper/warpgroup.cuh"

namespace jax_hopper {

template <class Cfg>
struct DirectStore {
  // wgmma m64nN f32 accumulator layout (PTX ISA "Register Fragments"): thread t of the
  // warpgroup holds, for each 8-column block j, rows r and r + 8 with
  // r = 16 * warp + lane / 4, columns 8j + 2 * (lane % 4) + {0, 1}, as
  // acc[4j + {0, 1}] (row r) and acc[4j + {2, 3}] (row r + 8).
  static constexpr int kRowsPerWarp = 16;
  static constexpr int kHalfRows = 8;
  static constexpr int kColsPerBlock = 8;
  static constexpr int kColBlocks = Cfg::kBlockN / kColsPerBlock;

  // One wgmma row block's fragment (a ping-pong warpgroup stores its two in turn).
  using Acc = typename Cfg::Accumulator[Cfg::kBlockAccumulatorRegisters];
  using Frag = Fragment<typename Cfg::Accumulator>;

  // Rows from `rows` on are masked (C's M, or a grouped tile's group end).
  template <class Out>
  __device__ static void store_as(const Acc& acc, const OutputParams& out, int batch, int row0, int col0, int rows) {
    const int t = hopper::thread_in_warpgroup();
    const int warp = t / hopper::kWarpSize;
    const int lane = t % hopper::kWarpSize;
    const int r = row0 + warp * kRowsPerWarp + lane / 4;
    const int c = col0 + 2 * (lane % 4);
    Out* base = static_cast<Out*>(out.c) + batch * out.batch_stride;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = r + half * kHalfRows;
      if (row >= rows) continue;
      Out* dst_row = base + static_cast<int64_t>(row) * out.ldc;
#pragma unroll
      for (int j = 0; j < kColBlocks; ++j) {
        const float2 v = Frag::pair(acc, 4 * j + 2 * half);
        store_pair<Out>(out, dst_row, c + j * kColsPerBlock, v.x, v.y);
      }
    }
  }

  // Columns col and col + 1 of one row of C, masked at N; one store where pairs are aligned.
  template <class Out>
  __device__ static void store_pair(const OutputParams& out, Out* dst_row, int col, float x, float y) {
    using Pair = PairOf<Out>;
    const auto pair = Pair::convert(x, y);
    if (out.paired_stores && col + 1 < out.n) {
      *reinterpret_cast<typename Pair::type*>(dst_row + col) = pair;
    } else {
      Out a, b;
      Pair::split(pair, a, b);
      if (col < out.n) dst_row[col] = a;
      if (col + 1 < out.n) dst_row[col + 1] = b;
    }
  }

  // The same for C's element (row, col) and its neighbour, in C's type (f32 or 16-bit).
  __device__ static void store_pair(const OutputParams& out, int batch, int row, int col, float x, float y) {
    const int64_t offset = batch * out.batch_stride + static_cast<int64_t>(row) * out.ldc;
    if (out.f32) {
      store_pair<float>(out, static_cast<float*>(out.c) + offset, col, x, y);
    } else {
      store_pair<typename Cfg::Element>(out, static_cast<typename Cfg::Element*>(out.c) + offset, col, x, y);
    }
  }

  __device__ static void store(const Acc& acc, const OutputParams& out, int batch, int row0, int col0) {
    store(acc, out, batch, row0, col0, out.m);
  }
  __device__ static void store(const Acc& acc, const OutputParams& out, int batch, int row0, int col0, int rows) {
    if (out.f32) {
      store_as<float>(acc, out, batch, row0, col0, rows);
    } else {
      store_as<typename Cfg::Element>(acc, out, batch, row0, col0, rows);
    }
  }
};

}  // namespace jax_hopper
