// The derivative kind's epilogue (kPersistentFusedDerivative): C = act(acc + bias) and
// D = act'(acc + bias), each rounded once, both stored by TMA.
#pragma once
#include <cuda.h>

#include <cstdint>
#include <type_traits>

#include "gemm/epilogue/activations.cuh"
#include "gemm/epilogue/fused_ops.cuh"
#include "gemm/epilogue/tma_store.cuh"
#include "hopper/tma.cuh"
#include "hopper/warpgroup.cuh"

namespace jax_hopper {

template <class Cfg>
struct DerivativeStore {
  using Direct = DirectStore<Cfg>;
  using Tma = TmaStore<Cfg>;
  using Buffers = typename Tma::Buffers;

  // The activation and its derivative of the biased f32
  // accumulator, C = act(acc + bias) and D = act'(acc + bias), each rounded once.
  // Sub-tile s of both, each element's pair computed once for both: the same stmatrix
  // walk as stage_subtile puts C into buf_c; D's packed pairs are returned in `d` (16
  // registers, which the sub-tile's dead accumulators free) to be staged once D's
  // buffer is free.
  using PackedSubtile = uint32_t[Tma::kPairSteps][Tma::kMatrices];

  template <Activation kAct>
  __device__ static void stage_with_derivative(const typename Direct::Acc& acc, uint8_t* buf_c, PackedSubtile& d,
                                               int s, const uint32_t (&bias_smem)[hopper::kWarpgroupSize],
                                               bool has_bias) {
    using Element = typename Cfg::Element;
    using Ops = FusedOps<Cfg>;
    static_assert(sizeof(Element) == 2 && std::is_same_v<typename Cfg::Accumulator, float>,
                  "16-bit outputs of an f32 accumulator");
    constexpr int kSubtileBlocks = 2 * Tma::kPairSteps;
    uint32_t bias[kSubtileBlocks];
    Ops::load_bias(bias_smem, has_bias, s * kSubtileBlocks, bias);
#pragma unroll
    for (int p = 0; p < Tma::kPairSteps; ++p) {
      const int j = s * kSubtileBlocks + 2 * p;  // first accumulator column block of the pair
      uint32_t c[Tma::kMatrices];
      // Accumulator pairs 4j + 2q, 4j + 2q + 2: block j + q / 2, both halves.
#pragma unroll
      for (int q = 0; q < Tma::kMatrices; q += 2) {
        const float2 b = Ops::unpack(bias[2 * p + q / 2]);
        const int i = 4 * j + 2 * q;
        if constexpr (kAct == Activation::kGeluErf) {
          const uint4 r = gelu_erf_with_derivative_x4<Element>(acc[i] + b.x, acc[i + 1] + b.y, acc[i + 2] + b.x,
                                                               acc[i + 3] + b.y);
          c[q] = r.x, d[p][q] = r.y, c[q + 1] = r.z, d[p][q + 1] = r.w;
        } else {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float2 v0 = Activations::activate_with_derivative<kAct>(acc[i + 2 * e] + b.x);
            const float2 v1 = Activations::activate_with_derivative<kAct>(acc[i + 2 * e + 1] + b.y);
            c[q + e] = pack_pair<Element>(v0.x, v1.x);
            d[p][q + e] = pack_pair<Element>(v0.y, v1.y);
          }
        }
      }
      hopper::stmatrix_x4(hopper::smem_addr(buf_c) + Tma::stmatrix_offset(p), c[0], c[1], c[2], c[3]);
    }
  }

  // One buffer for C's sub-tiles, one for D's, stored alternately (C0, D0, C1, D1, ...,
  // one bulk group each): before a buffer is refilled only the group issued two before
  // must have read it, so the sub-tile's arithmetic overlaps the last store's read.
  // (Waiting for both stores before each sub-tile measured 0.965x jnp's two passes for
  // exact GELU, where the stores wait on each other.)
  template <Activation kAct>
  __device__ static void store_with_derivative_as(const typename Direct::Acc& acc, Buffers& buffers,
                                                  const CUtensorMap* tmap_c, const CUtensorMap* tmap_d,
                                                  const uint32_t (&bias_smem)[hopper::kWarpgroupSize],
                                                  bool has_bias, int warpgroup, int row0, int col0) {
    static_assert(Cfg::kStoreBuffers == 2, "one staging buffer for C, one for D");
    constexpr int kCols = Cfg::kStoreRowBytes / sizeof(typename Cfg::Element);
    constexpr int kSubtiles = Cfg::kBlockN / kCols;
    constexpr int kBatch = 0;  // the fused kinds compute one product
    const uint32_t barrier = Cfg::kFirstEpilogueBarrier + warpgroup;
    const bool elected = hopper::thread_in_warpgroup() == 0;
    const auto issue = [&](const CUtensorMap* map, uint8_t* buf, int s) {
      hopper::fence_proxy_async_shared();
      hopper::named_barrier_sync(barrier, hopper::kWarpgroupSize);
      if (elected) {
        hopper::tma_store_3d(map, buf, col0 + s * kCols, row0, kBatch);
        hopper::bulk_commit_group();
      }
    };
#pragma unroll
    for (int s = 0; s < kSubtiles; ++s) {
      PackedSubtile d;
      if (elected) hopper::bulk_wait_group_read<1>();  // C's previous sub-tile has left buffer 0
      hopper::named_barrier_sync(barrier, hopper::kWarpgroupSize);
      stage_with_derivative<kAct>(acc, buffers[0], d, s, bias_smem, has_bias);
      issue(tmap_c, buffers[0], s);
      if (elected) hopper::bulk_wait_group_read<1>();  // D's previous sub-tile has left buffer 1
      hopper::named_barrier_sync(barrier, hopper::kWarpgroupSize);
#pragma unroll
      for (int p = 0; p < Tma::kPairSteps; ++p)
        hopper::stmatrix_x4(hopper::smem_addr(buffers[1]) + Tma::stmatrix_offset(p), d[p][0], d[p][1], d[p][2],
                            d[p][3]);
      issue(tmap_d, buffers[1], s);
    }
  }

  // The host guarantees TMA-storable C and D and an activation (gemm.cc).
  __device__ static void store_with_derivative(const typename Direct::Acc& acc, Buffers& buffers,
                                               const CUtensorMap* tmap_c, const CUtensorMap* tmap_d,
                                               const OutputParams& out,
                                               const uint32_t (&bias_smem)[hopper::kWarpgroupSize], int warpgroup,
                                               int row0, int col0) {
    const bool has_bias = out.bias != nullptr;
    with_activation(out.activation, [&](auto act) {
      constexpr Activation kAct = decltype(act)::value;
      if constexpr (kAct != Activation::kNone) {  // kNone is refused by the host
        store_with_derivative_as<kAct>(acc, buffers, tmap_c, tmap_d, bias_smem, has_bias, warpgroup, row0, col0);
      }
    });
  }
};

}  // namespace jax_hopper
