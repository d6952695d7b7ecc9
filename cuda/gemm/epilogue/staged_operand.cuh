// The backward form's epilogue (kPersistentFusedGrad, config.cuh: kStagedOperand):
// C = acc * act'(z), with z (or the saved act'(z)) TMA-loaded into the store buffers
// while the tile's mainloop runs, and optionally C's column sums (column_sums.cuh).
#pragma once
#include <cuda.h>

#include <cstdint>

#include "gemm/epilogue/activations.cuh"
#include "gemm/epilogue/column_sums.cuh"
#include "gemm/epilogue/fused_ops.cuh"
#include "gemm/epilogue/tma_store.cuh"
#include "hopper/mbarrier.cuh"
#include "hopper/tma.cuh"
#include "hopper/warpgroup.cuh"

namespace jax_hopper {

template <class Cfg>
struct StagedOperand {
  using Direct = DirectStore<Cfg>;
  using Tma = TmaStore<Cfg>;
  using Buffers = typename Tma::Buffers;

  // This warpgroup's rows of z (or of the saved act'(z)) for the tile at (row0, col0),
  // sub-tile s into buffer s, completing on `full`. The elected thread issues them once
  // its previous tile's stores have read the buffers (it issued those too).
  __device__ static void load_operand(Buffers& buffers, const CUtensorMap* tmap_z, uint64_t* full, int row0,
                                      int col0) {
    constexpr int kCols = Cfg::kStoreRowBytes / sizeof(typename Cfg::Element);
    constexpr int kBatch = 0;  // the fused kinds compute one product
    if (hopper::thread_in_warpgroup() != 0) return;
    hopper::bulk_wait_group_read<0>();
    // Boxes past M or N are zero-filled and still count their bytes.
    hopper::mbarrier_arrive_expect_tx(full, Cfg::kOperandSubtiles * Cfg::kStoreBufferBytes);
#pragma unroll
    for (int s = 0; s < Cfg::kOperandSubtiles; ++s)
      hopper::tma_load_3d(buffers[s], tmap_z, full, col0 + s * kCols, row0, kBatch);
  }

  // C = acc * act'(z) (or acc * the saved act'(z)) in place of the staged operand, one
  // sub-tile at a time: each thread reads (ldmatrix) exactly the elements that it then
  // overwrites (stmatrix at the same addresses), so no barrier parts the read from the
  // write; each buffer then leaves by its own TMA store. kColumnSums: C's f32 column sums
  // too, as row row0 / 64 of out.column_sums (column_sums.cuh).
  template <Activation kAct, bool kColumnSums>
  __device__ static void store_times_operand_as(const typename Direct::Acc& acc, Buffers& buffers,
                                                const CUtensorMap* tmap_c, const OutputParams& out, uint64_t* full,
                                                uint32_t phase, typename ColumnSums<Cfg>::Scratch& sums_scratch,
                                                int warpgroup, int row0, int col0) {
    using Element = typename Cfg::Element;
    using Ops = FusedOps<Cfg>;
    using Sums = ColumnSums<Cfg>;
    constexpr int kCols = Cfg::kStoreRowBytes / sizeof(Element);
    constexpr int kBatch = 0;
    const uint32_t barrier = Cfg::kFirstEpilogueBarrier + warpgroup;
    const bool elected = hopper::thread_in_warpgroup() == 0;
    bool inside[2] = {true, true};
    if constexpr (kColumnSums) Sums::rows_inside(row0, out.m, inside);
    hopper::mbarrier_wait(full, phase);
#pragma unroll
    for (int s = 0; s < Cfg::kOperandSubtiles; ++s) {
      typename Sums::SubtileSums sums;
      // The sub-tile's loads first, so their latencies overlap (ldmatrix and stmatrix are
      // volatile: the compiler keeps each load next to the store after it).
      uint32_t addr[Tma::kPairSteps];
      uint4 z4[Tma::kPairSteps];
#pragma unroll
      for (int p = 0; p < Tma::kPairSteps; ++p) {
        addr[p] = hopper::smem_addr(buffers[s]) + Tma::stmatrix_offset(p);
        z4[p] = hopper::ldmatrix_x4(addr[p]);
      }
#pragma unroll
      for (int p = 0; p < Tma::kPairSteps; ++p) {
        const int j = s * 2 * Tma::kPairSteps + 2 * p;  // first accumulator column block of the pair
        const uint32_t z[Tma::kMatrices] = {z4[p].x, z4[p].y, z4[p].z, z4[p].w};
        uint32_t c[Tma::kMatrices];
#pragma unroll
        for (int q = 0; q < Tma::kMatrices; ++q) {  // matrix q holds accumulator pair 4j + 2q
          const float2 zq = Ops::unpack(z[q]);
          const int i = 4 * j + 2 * q;
          const float2 v = make_float2(Activations::times_derivative<kAct>(acc[i], zq.x),
                                       Activations::times_derivative<kAct>(acc[i + 1], zq.y));
          c[q] = pack_pair<Element>(v.x, v.y);
          if constexpr (kColumnSums) {  // q = 0, 1: rows r, r + 8 of block 2p; q = 2, 3: of block 2p + 1
            float2& sum = sums[2 * p + q / 2];
            const float2 w = inside[q % 2] ? v : make_float2(0.0f, 0.0f);
            sum = q % 2 == 0 ? w : Sums::add(sum, w);
          }
        }
        hopper::stmatrix_x4(addr[p], c[0], c[1], c[2], c[3]);
      }
      float2 total;
      if constexpr (kColumnSums) total = Sums::reduce_scatter(sums);
      hopper::fence_proxy_async_shared();
      hopper::named_barrier_sync(barrier, hopper::kWarpgroupSize);
      if (elected) {
        hopper::tma_store_3d(tmap_c, buffers[s], col0 + s * kCols, row0, kBatch);
        hopper::bulk_commit_group();
      }
      if constexpr (kColumnSums) Sums::publish(sums_scratch, s, total);
    }
    if constexpr (kColumnSums)
      Sums::write(sums_scratch, out.column_sums, out.n, row0 / Cfg::kMmaM, col0, out.n, barrier);
  }

  // `phase`: the parity of this warpgroup's staged tiles so far.
  __device__ static void store_times_operand(const typename Direct::Acc& acc, Buffers& buffers,
                                             const CUtensorMap* tmap_c, const OutputParams& out, uint64_t* full,
                                             uint32_t phase, typename ColumnSums<Cfg>::Scratch& sums_scratch,
                                             int warpgroup, int row0, int col0) {
    with_activation(out.activation, [&](auto act) {
      constexpr Activation kAct = decltype(act)::value;
      if (out.column_sums != nullptr) {
        store_times_operand_as<kAct, true>(acc, buffers, tmap_c, out, full, phase, sums_scratch, warpgroup, row0,
                                           col0);
      } else {
        store_times_operand_as<kAct, false>(acc, buffers, tmap_c, out, full, phase, sums_scratch, warpgroup, row0,
                                            col0);
      }
    });
  }
};

}  // namespace jax_hopper
