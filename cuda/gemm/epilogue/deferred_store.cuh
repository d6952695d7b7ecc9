// The deferred store (config.cuh: kDeferredStore): a finished tile's 16-bit output waits
// in registers and is staged and stored during the next tile's first K tiles, under its
// MMAs.
#pragma once
#include <cuda.h>

#include <cstdint>

#include "gemm/epilogue/direct_store.cuh"
#include "gemm/epilogue/output.cuh"
#include "gemm/epilogue/tma_store.cuh"
#include "hopper/warpgroup.cuh"

namespace jax_hopper {

template <class Cfg>
struct DeferredStore {
  using Direct = DirectStore<Cfg>;
  using Tma = TmaStore<Cfg>;
  using Buffers = typename Tma::Buffers;

  // A finished tile's 16-bit output waits in `pending` (packed pairs, 64 registers) while
  // the next tile's mainloop starts: its sub-tile s is staged and stored during that
  // tile's K tile s, under the MMAs already issued, so the tensor cores wait only for
  // the packing between tiles instead of the whole staging walk.
  static constexpr int kPendingCols = Cfg::kStoreRowBytes / 2;
  static constexpr int kPendingSubtiles = Cfg::kBlockN / kPendingCols;
  // The next tile's sub-tile 0 reuses buffer 0 right after this tile's last sub-tile:
  // with two buffers that must be the other one, or the wait above would not cover its
  // store (a single buffer, copied out by the warps themselves, waits by __syncwarp).
  static_assert(!Cfg::kDeferredStore || kPendingSubtiles % Cfg::kStoreBuffers == 0,
                "consecutive tiles' sub-tiles must alternate staging buffers");
  struct Pending {
    uint32_t words[Cfg::kBlockAccumulatorRegisters / 2];  // words[i]: accumulator elements 2i, 2i + 1
    int batch, row0, col0;
    int row_end;  // the grouped kinds' row limit (the group's end); the others mask at C's M
    bool valid;
  };

  __device__ static void defer(const typename Direct::Acc& acc, Pending& pending, int batch, int row0, int col0,
                               int row_end = 0) {
    using Frag = typename Direct::Frag;
#pragma unroll
    for (int i = 0; i < Cfg::kBlockAccumulatorRegisters / 2; ++i)
      pending.words[i] = Frag::template packed<typename Cfg::Element>(acc, 2 * i);
    pending.batch = batch, pending.row0 = row0, pending.col0 = col0, pending.row_end = row_end;
    pending.valid = true;
  }

  // C rows TMA cannot address (a row of ldc 16-bit elements that is not a multiple of 16
  // bytes, e.g. an odd N, or a misaligned C), and the grouped kinds' tiles, which a group's
  // end may cut short (rows from `row_end` on are masked): the staged sub-tile leaves through the
  // warpgroup's own stores instead of a TMA store, still under the next tile's MMAs. Each
  // warp copies 16 of its 64 rows, one row per instruction: lane l takes columns 2l, 2l + 1
  // as one 4-byte store where the pair is 4-byte aligned in C (every other row of an odd
  // ldc), else as two 2-byte ones. The registers-to-C stores this replaces wrote 8 bytes
  // to each of 8 rows per instruction while the tensor cores waited: 0.11 ms of a 0.47 ms
  // kernel at 4096x8191x4096.
  __device__ static void copy_out(const uint8_t* buf, const OutputParams& out, int batch, int row0, int col,
                                  int row_end) {
    constexpr int kRowsPerWarp = Cfg::kStoreRows / hopper::kWarpsPerWarpgroup;
    constexpr int kElementBytes = sizeof(typename Cfg::Element);
    constexpr int kPairBytes = 2 * kElementBytes;
    constexpr int kHalfBits = 16;
    static_assert(Cfg::kStoreRowBytes == hopper::kWarpSize * kPairBytes, "a staged row is one pair per lane");
    const int t = hopper::thread_in_warpgroup();
    const int first_row = t / hopper::kWarpSize * kRowsPerWarp;
    const int lane = t % hopper::kWarpSize;
    const int c = col + 2 * lane;
    const bool first_in = c < out.n, second_in = c + 1 < out.n;
    const int rows = min(kRowsPerWarp, row_end - row0 - first_row);  // this warp's rows to store
    const uint32_t src = hopper::smem_addr(buf);
    const int64_t row_bytes = out.ldc * kElementBytes;
    char* dst = static_cast<char*>(out.c) +
                ((batch * out.batch_stride + c) * kElementBytes + (row0 + first_row) * row_bytes);
#pragma unroll 1  // a loop, not 16 copies: this runs between the next tile's wgmma issues, beside 192 live registers
    for (int i = 0; i < rows; ++i, dst += row_bytes) {
      const uint32_t pair = hopper::load_shared_u32(src + Tma::swizzled(first_row + i, kPairBytes * lane));
      if (second_in && reinterpret_cast<uintptr_t>(dst) % kPairBytes == 0) {
        *reinterpret_cast<uint32_t*>(dst) = pair;
      } else {
        if (first_in) *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(pair);
        if (second_in) *reinterpret_cast<uint16_t*>(dst + kElementBytes) = static_cast<uint16_t>(pair >> kHalfBits);
      }
    }
  }

  // Sub-tile s of the pending tile: staged, then one TMA store, or (C rows TMA cannot
  // address, the grouped kinds) copy_out. There each warp stages (stmatrix) and copies
  // only its own 16 rows, so a __syncwarp orders the two; before the staging, one is
  // needed only where the buffer is the one the warp just copied out (a single buffer,
  // the grouped kinds': their group table takes the second's shared memory). With two,
  // the warp read this buffer two sub-tiles ago, before the __syncwarp after the last
  // staging. (A warpgroup barrier here made each warp wait for the slowest of four.)
  __device__ static void store_pending_subtile(const Pending& pending, Buffers& buffers, const CUtensorMap* tmap_c,
                                               const OutputParams& out, int warpgroup, int s) {
    const auto stage = [&](uint8_t* buf) { Tma::stage_words([&](int i) { return pending.words[i / 2]; }, buf, s); };
    const int col = pending.col0 + s * kPendingCols;
    if (Cfg::kTmaStoreEpilogue && out.tma_store) {
      Tma::store_subtile(stage, buffers, tmap_c, warpgroup, s, pending.batch, pending.row0, col);
    } else {
      uint8_t* buf = buffers[s % Cfg::kStoreBuffers];
      if constexpr (Cfg::kStoreBuffers == 1) __syncwarp();
      stage(buf);
      __syncwarp();
      copy_out(buf, out, pending.batch, pending.row0, col, Cfg::kGrouped ? pending.row_end : out.m);
    }
  }

  // Run once the MMAs of the next tile's K tile `kt` are issued.
  __device__ static void store_pending_during(const Pending& pending, Buffers& buffers, const CUtensorMap* tmap_c,
                                              const OutputParams& out, int warpgroup, int kt) {
    if (!pending.valid) return;
#pragma unroll
    for (int s = 0; s < kPendingSubtiles; ++s)  // a constant s per branch keeps the words in registers
      if (kt == s) store_pending_subtile(pending, buffers, tmap_c, out, warpgroup, s);
  }

  // The sub-tiles from `first` on (those the next tile's K tiles did not cover; all of
  // them before a tile with no MMAs, and after the last tile).
  __device__ static void flush(Pending& pending, Buffers& buffers, const CUtensorMap* tmap_c, const OutputParams& out,
                               int warpgroup, int first) {
    if (!pending.valid) return;
#pragma unroll
    for (int s = 0; s < kPendingSubtiles; ++s)
      if (s >= first) store_pending_subtile(pending, buffers, tmap_c, out, warpgroup, s);
    pending.valid = false;
  }
};

}  // namespace jax_hopper
