// The TMA-store epilogue: registers -> swizzled shared-memory sub-tiles (64 rows, one
// 128-byte swizzle row wide) -> TMA stores that run while the consumers start the next
// tile. The deferred store, the derivative store and the staged operand build on its
// sub-tile walk.
#pragma once
#include <cuda.h>

#include <cstdint>

#include "gemm/epilogue/direct_store.cuh"
#include "gemm/epilogue/output.cuh"
#include "hopper/tma.cuh"
#include "hopper/warpgroup.cuh"

namespace jax_hopper {

template <class Cfg>
struct TmaStore {
  using Direct = DirectStore<Cfg>;
  using Buffers = uint8_t[Cfg::kStoreBuffers][Cfg::kStoreBufferBytes];
  static constexpr int kChunkBytes = 16;  // 128B swizzle permutes 16-byte chunks of a row
  static constexpr int kSwizzleRows = 8;  // ... by XOR with the row index modulo 8

  // Byte offset of (row, byte column) in a 128-byte-row buffer with the 128B swizzle
  // TMA applies: chunk c of row r sits at chunk c ^ (r % 8). Warps writing 8 rows at
  // the same columns thus hit 8 different bank groups.
  __device__ static uint32_t swizzled(int row, int byte_col) {
    const int chunk = byte_col / kChunkBytes;
    return row * Cfg::kStoreRowBytes + ((chunk ^ (row % kSwizzleRows)) * kChunkBytes) + byte_col % kChunkBytes;
  }

  // Sub-tile `s` of 16-bit output into `buf` (64 rows x 128 bytes): four 8x8 matrices
  // per stmatrix.x4 -- column blocks j, j + 1, each as rows 0-7 and 8-15 of the warp's
  // 16 rows. `word(i)` is accumulator elements i, i + 1 as one packed pair.
  template <class Word>
  __device__ static void stage_words(Word word, uint8_t* buf, int s) {
    constexpr int kBlocks = Cfg::kStoreRowBytes / 2 / Direct::kColsPerBlock;  // 8-column accumulator blocks
    constexpr int kMatrixRows = 8;
    const int t = hopper::thread_in_warpgroup();
    const int warp = t / hopper::kWarpSize;
    const int lane = t % hopper::kWarpSize;
    const uint32_t base = hopper::smem_addr(buf);
    const int matrix = lane / kMatrixRows;
    const int row = warp * Direct::kRowsPerWarp + (matrix % 2) * Direct::kHalfRows + lane % kMatrixRows;
#pragma unroll
    for (int p = 0; p < kBlocks; p += 2) {
      const int j = s * kBlocks + p;  // first accumulator column block of the pair
      const int byte_col = (p + matrix / 2) * Direct::kColsPerBlock * 2;
      hopper::stmatrix_x4(base + swizzled(row, byte_col), word(4 * j), word(4 * j + 2), word(4 * j + 4),
                          word(4 * j + 6));
    }
  }

  // Sub-tile `s` of this thread's accumulators into `buf` (64 rows x 128 bytes).
  template <class Out>
  __device__ static void stage_subtile(const typename Direct::Acc& acc, uint8_t* buf, int s) {
    using Frag = typename Direct::Frag;
    constexpr int kCols = Cfg::kStoreRowBytes / sizeof(Out);
    constexpr int kBlocks = kCols / Direct::kColsPerBlock;  // 8-column accumulator blocks
    const int t = hopper::thread_in_warpgroup();
    const int warp = t / hopper::kWarpSize;
    const int lane = t % hopper::kWarpSize;
    const uint32_t base = hopper::smem_addr(buf);
    if constexpr (sizeof(Out) == 2) {
      stage_words([&](int i) { return Frag::template packed<Out>(acc, i); }, buf, s);
    } else {
      const int row = warp * Direct::kRowsPerWarp + lane / 4;
#pragma unroll
      for (int p = 0; p < kBlocks; ++p) {
        const int j = s * kBlocks + p;
        const int byte_col = (p * Direct::kColsPerBlock + 2 * (lane % 4)) * int(sizeof(Out));
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float2* dst = reinterpret_cast<float2*>(buf + swizzled(row + half * Direct::kHalfRows, byte_col));
          *dst = Frag::pair(acc, 4 * j + 2 * half);
        }
      }
    }
  }

  // Sub-tile `s` of an output through buffer s % kStoreBuffers (2; 1 in the
  // f16-accumulating kind): wait until the store issued kStoreBuffers sub-tiles ago has
  // read the buffer, fill it (`stage(buf)`), fence it for the async proxy, and let one
  // thread issue its TMA store to (col, row0). The last stores stay in flight while this
  // warpgroup goes on; `finish` waits for them before the CTA exits.
  template <class Stage>
  __device__ static void store_subtile(Stage stage, Buffers& buffers, const CUtensorMap* tmap_c, int warpgroup,
                                       int s, int batch, int row0, int col) {
    const uint32_t barrier = Cfg::kFirstEpilogueBarrier + warpgroup;
    const bool elected = hopper::thread_in_warpgroup() == 0;
    uint8_t* buf = buffers[s % Cfg::kStoreBuffers];
    if (elected) hopper::bulk_wait_group_read<Cfg::kStoreBuffers - 1>();
    hopper::named_barrier_sync(barrier, hopper::kWarpgroupSize);
    stage(buf);
    hopper::fence_proxy_async_shared();
    hopper::named_barrier_sync(barrier, hopper::kWarpgroupSize);
    if (elected) {
      hopper::tma_store_3d(tmap_c, buf, col, row0, batch);
      hopper::bulk_commit_group();
    }
  }

  template <class Out>
  __device__ static void store_as(const typename Direct::Acc& acc, Buffers& buffers,
                                  const CUtensorMap* tmap_c, int warpgroup, int batch, int row0, int col0) {
    constexpr int kCols = Cfg::kStoreRowBytes / sizeof(Out);
    constexpr int kSubtiles = Cfg::kBlockN / kCols;
#pragma unroll
    for (int s = 0; s < kSubtiles; ++s)
      store_subtile([&](uint8_t* buf) { stage_subtile<Out>(acc, buf, s); }, buffers, tmap_c, warpgroup, s, batch,
                    row0, col0 + s * kCols);
  }

  __device__ static void store(const typename Direct::Acc& acc, Buffers& buffers, const CUtensorMap* tmap_c,
                               const OutputParams& out, int warpgroup, int batch, int row0, int col0) {
    if (!out.tma_store) {
      Direct::store(acc, out, batch, row0, col0);
    } else if (out.f32) {
      store_as<float>(acc, buffers, tmap_c, warpgroup, batch, row0, col0);
    } else {
      store_as<typename Cfg::Element>(acc, buffers, tmap_c, warpgroup, batch, row0, col0);
    }
  }

  // The stmatrix walk of one 16-bit sub-tile (stage_words' order), shared by the derivative
  // store and the staged operand: matrix q of step p holds accumulator pair 4j + 2q.
  static constexpr int kMatrices = 4;  // of one stmatrix.x4: (block j, j + 1) x (rows r, r + 8)
  static constexpr int kPairSteps = Cfg::kStoreRowBytes / 2 / Direct::kColsPerBlock / 2;  // stmatrix per sub-tile

  __device__ static uint32_t stmatrix_offset(int p) {
    constexpr int kMatrixRows = 8;
    const int t = hopper::thread_in_warpgroup();
    const int warp = t / hopper::kWarpSize;
    const int lane = t % hopper::kWarpSize;
    const int matrix = lane / kMatrixRows;
    const int row = warp * Direct::kRowsPerWarp + (matrix % 2) * Direct::kHalfRows + lane % kMatrixRows;
    return swizzled(row, (2 * p + matrix / 2) * Direct::kColsPerBlock * 2);
  }

  // The stores must have read shared memory before the CTA exits; their writes need no
  // wait (the grid's completion covers them, as CUTLASS's store tail relies on). Waiting
  // for the writes cost about 0.13 us at each CTA's end (decode kind, per-CTA timeline).
  __device__ static void finish() {
    if (hopper::thread_in_warpgroup() == 0) hopper::bulk_wait_group_read<0>();
  }
};

}  // namespace jax_hopper
