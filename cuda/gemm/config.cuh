// Tile shape, pipeline depth and the shared-memory budget of the V5 kernel.
#pragma once
#include <cstddef>

#include "gemm/gemm.h"
#include "gemm/smem_layout.cuh"
#include "hopper/warpgroup.cuh"

namespace jax_hopper {

constexpr size_t kMaxSmemPerBlock = 227 * 1024;  // sm_90 opt-in limit per block
constexpr size_t kSmemAlignment = 1024;          // 128B-swizzle atoms repeat every 1 KB

template <KernelKind kKind_, class Element_, Major kMajorA_, Major kMajorB_, int kStages_, int kRasterSwizzle_ = 4>
struct GemmConfig {
  using Element = Element_;
  static constexpr KernelKind kKind = kKind_;
  static constexpr Major kMajorA = kMajorA_;
  static constexpr Major kMajorB = kMajorB_;
  static constexpr int kStages = kStages_;
  // Persistent: one CTA per SM walks the tiles, so the producer fills the next tile's
  // stages while the consumers run the epilogue. Clusters of kClusterM CTAs along M
  // compute neighbouring M tiles of one N column: each loads 1/kClusterM of the shared
  // B tile and multicasts it to all, cutting B's L2->SM traffic by kClusterM.
  static constexpr bool kPersistent = kKind == KernelKind::kPersistent;
  static constexpr int kClusterM = kPersistent ? 2 : 1;
  // Tile order: consecutive CTAs sweep this many neighbouring N tiles, then step in M.
  static constexpr int kRasterSwizzle = kRasterSwizzle_;

  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 256;
  static constexpr int kBlockK = 64;  // 64 16-bit elements = one 128-byte swizzle row
  static constexpr int kMmaK = 16;    // K of one wgmma.m64n256k16
  static constexpr int kMmasPerKTile = kBlockK / kMmaK;

  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kWarpgroupM = kBlockM / kConsumerWarpgroups;  // 64 rows each
  static constexpr int kProducerThreads = hopper::kWarpSize;           // one TMA warp
  static constexpr int kThreads = kConsumerWarpgroups * hopper::kWarpgroupSize + kProducerThreads;
  static constexpr int kAccumulators = kWarpgroupM * kBlockN / hopper::kWarpgroupSize;  // 128

  using LayoutA = OperandLayout<Element, kMajorA, kBlockM, kBlockK>;
  using LayoutB = OperandLayout<Element, kMajorB, kBlockN, kBlockK, kClusterM>;
  static constexpr uint32_t kStageBytes = LayoutA::kBytes + LayoutB::kBytes;  // TMA tx bytes

  static_assert(kStages >= 2, "the lagging release needs at least two stages");
  static_assert(kWarpgroupM == 64, "one wgmma m64 row block per consumer warpgroup");
  static_assert(kAccumulators == 128, "64x256 f32 accumulator = 128 registers per thread");
};

template <class Cfg>
struct SharedStorage {
  struct alignas(kSmemAlignment) Stage {
    typename Cfg::Element a[Cfg::LayoutA::kElements];
    typename Cfg::Element b[Cfg::LayoutB::kElements];
  };
  Stage stages[Cfg::kStages];
  uint64_t full[Cfg::kStages];   // TMA -> consumers: the stage holds fresh data
  uint64_t empty[Cfg::kStages];  // consumers -> TMA: the stage may be overwritten
};

// Dynamic shared memory requested at launch: the storage plus slack to align its base.
template <class Cfg>
constexpr size_t smem_bytes() {
  return sizeof(SharedStorage<Cfg>) + kSmemAlignment;
}

}  // namespace jax_hopper
