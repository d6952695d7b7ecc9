// Tile shape, pipeline depth, thread roles and the shared-memory budget of each kernel kind.
#pragma once
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "gemm/gemm.h"
#include "gemm/scheduler/group_table.cuh"
#include "gemm/smem_layout.cuh"
#include "hopper/warpgroup.cuh"

namespace jax_hopper {

constexpr size_t kMaxSmemPerBlock = 227 * 1024;  // sm_90 opt-in limit per block
constexpr size_t kSmemPerSm = 228 * 1024;        // shared with every CTA resident on the SM
constexpr size_t kSmemPerCtaReserved = 1024;     // the driver's own share of each CTA's
constexpr size_t kSmemAlignment = 1024;          // 128B-swizzle atoms repeat every 1 KB
constexpr int kRegisterFileSize = 64 * 1024;     // 32-bit registers per SM

template <KernelKind kKind_, class Element_, Major kMajorA_, Major kMajorB_, int kStages_>
struct GemmConfig {
  using Element = Element_;
  static constexpr KernelKind kKind = kKind_;
  static constexpr Major kMajorA = kMajorA_;
  static constexpr Major kMajorB = kMajorB_;
  static constexpr int kStages = kStages_;
  // Decode-sized M (a few rows against a large B): the product is a stream over B, so
  // every SM must pull its share of B at once. One 64-row consumer warpgroup (no wgmma
  // on rows that are not there) on 64x128 tiles, no multicast cluster (a second CTA
  // along M would hold rows past M), and every tile's K range cut into equal pieces, one
  // CTA each (kSplitK), small enough that two CTAs share an SM (kCtasPerSm), in as few
  // waves as the tiles allow (launch.cuh: split_k_pieces); a tile's pieces form a
  // cluster of their own where they fit, to be summed in shared memory (SplitKReduce):
  // faster than a stream-K split with one CTA per SM and a finisher waiting on its
  // contributors' flags (16x8192x8192: 38 us instead of 46).
  // Persistent (the other kinds): one CTA per SM walks the tiles, so the producer fills
  // the next tile's stages while the consumers run the epilogue. Clusters of kClusterM
  // CTAs along M compute neighbouring M tiles of one N column: each loads 1/kClusterM of
  // the shared B tile and multicasts it to all, cutting B's L2->SM traffic by kClusterM.
  static constexpr bool kSmallM = kKind == KernelKind::kSmallM;
  static constexpr bool kSplitK = kSmallM;
  static constexpr int kCtasPerSm = kSmallM ? 2 : 1;
  static constexpr bool kPersistent = kKind != KernelKind::kV5 && !kSplitK;
  static constexpr int kClusterM = kPersistent ? 2 : 1;
  // Epilogue: accumulators -> shared memory -> TMA store (asynchronous: the consumers
  // go on to the next tile while the copy engine writes this one), or straight from
  // registers to global memory (the seed's).
  // Fused epilogue: bias, activation and residual (FusedOps), or, in the gradient kind,
  // only the backward form acc * act'(z) (so neither kind carries the other's paths).
  // The derivative kind: the forward form (bias, activation) that also writes act'(z) as
  // a second output D, for the backward pass to multiply by.
  static constexpr bool kActivationGrad = kKind == KernelKind::kPersistentFusedGrad;
  static constexpr bool kSavesDerivative = kKind == KernelKind::kPersistentFusedDerivative;
  static constexpr bool kFusedEpilogue =
      kKind == KernelKind::kPersistentFused || kActivationGrad || kSavesDerivative;
  // The tail wave split along K over the clusters (scheduler/work_list.cuh: WorkList).
  static constexpr bool kStreamK = kKind == KernelKind::kPersistentStreamK;
  // Pieces one tail tile's K range may be cut into (a finisher sums the others' partials).
  static constexpr int kMaxSplitsPerTile = 4;
  // Opt-in: accumulate in f16 (wgmma's f16 accumulator) with four consumer warpgroups
  // on a 256-row tile -- the tutorial's final version.
  static constexpr bool kF16Accumulate = kKind == KernelKind::kPersistentF16Acc;
  // Ping-pong: each consumer warpgroup owns whole 128x128 tiles -- the CTA's even ones
  // for warpgroup 0, odd ones for 1 -- so every stage of the ring has one reader per CTA
  // and one warpgroup's epilogue runs while the other's MMAs keep the tensor cores busy.
  static constexpr bool kPingpong = kKind == KernelKind::kPersistentPingpong;
  // The dynamic tile order (scheduler/tile_tickets.cuh): the default kernel and the
  // fused kinds hand tiles out by a global ticket counter in the order clusters finish;
  // the default's ablations and the experimental kinds walk them in a grid stride.
  static constexpr bool kDynamicTiles = kKind == KernelKind::kPersistent || kFusedEpilogue;
  // Grouped products (ragged_dot, grouped_kernel.cuh): the group sizes live on the
  // device, so each CTA reads them into a table (scheduler/group_table.cuh) and walks
  // the tiles of every group in a grid stride. Ragged rows (kGrouped: a group's rows of
  // A times its own B) or a ragged contraction (kGroupedK: per group, the transposed
  // rows of A times the same rows of B, a batch entry of C each). Tiles cross group
  // boundaries, so C leaves through the warps' own stores (the deferred store's copy),
  // masked at the group's last row.
  static constexpr bool kGrouped = kKind == KernelKind::kGrouped || kKind == KernelKind::kGroupedK;
  static constexpr bool kRaggedK = kKind == KernelKind::kGroupedK;
  static constexpr bool kDefaultOrStatic = kKind == KernelKind::kPersistent || kKind == KernelKind::kPersistentStatic;
  static constexpr bool kTmaStoreEpilogue = kKind == KernelKind::kPersistentTma || kDefaultOrStatic ||
                                            kKind == KernelKind::kPersistentImmediate ||
                                            kKind == KernelKind::kPersistentWait0 || kFusedEpilogue || kStreamK ||
                                            kSplitK || kF16Accumulate || kPingpong;
  // A whole producer warpgroup (only one thread issues TMA) so that setmaxnreg, which
  // works per warpgroup, can move registers from the producer to the consumers.
  // (Not for the small-M kind: one consumer warpgroup has registers to spare.)
  static constexpr bool kProducerWarpgroup = kDefaultOrStatic || kKind == KernelKind::kPersistentImmediate ||
                                             kKind == KernelKind::kPersistentWait0 || kFusedEpilogue ||
                                             kKind == KernelKind::kPersistentStreamK || kF16Accumulate || kPingpong ||
                                             kGrouped;
  // The deferred store (epilogue/deferred_store.cuh): a tile's 16-bit output is packed into registers
  // and staged and stored during the next tile's first K tiles, under its MMAs, instead
  // of between the two tiles while the tensor cores wait. The packed tile (64 registers)
  // sits next to the next tile's 128 f32 accumulators, which the consumers' setmaxnreg
  // share (232) holds. f32 output and the register-store fallback store at once.
  // The grouped kinds defer theirs too, and copy it out of the staging buffer with row
  // stores masked at the group's end (a TMA store would write whole boxes).
  static constexpr bool kDeferredStore = kDefaultOrStatic || kKind == KernelKind::kPersistentWait0 || kGrouped;
  // wgmma groups left in flight after each K tile; the stage release lags by as many.
  // The backward form has 3 stages (its staged operand takes the fourth's shared
  // memory): with one group in flight the consumers would hold two of them, leaving the
  // producer one stage of lead, and ncu showed its consumers waiting for data about five
  // times as long as the 4-stage kernel's. Retiring each group before the next frees a stage.
  static constexpr int kMmaInFlight = kKind == KernelKind::kPersistentWait0 || kActivationGrad ? 0 : 1;
  // Tile order: consecutive CTAs sweep this many neighbouring N tiles, then step in M.
  // 8 measured best of 2/4/8/16 on every shape tried, about 1% over the seed's 4.
  static constexpr int kRasterSwizzle = 8;

  static constexpr int kConsumerWarpgroups = kF16Accumulate ? 4 : (kSmallM ? 1 : 2);
  static constexpr int kMmaM = 64;  // rows of one wgmma
  // Cooperative kinds split a tile's rows between the consumer warpgroups (64 each);
  // a ping-pong warpgroup holds a whole tile: two 64-row blocks.
  static constexpr int kWarpgroupM = kPingpong ? 2 * kMmaM : kMmaM;
  static constexpr int kBlockM = kPingpong ? kWarpgroupM : kConsumerWarpgroups * kWarpgroupM;
  static constexpr int kBlockN = kPingpong || kSmallM ? 128 : 256;
  static constexpr int kBlockK = 64;  // 64 16-bit elements = one 128-byte swizzle row
  static constexpr int kMmaK = 16;    // K of one wgmma.m64nNk16
  static constexpr int kMmasPerKTile = kBlockK / kMmaK;
  static constexpr int kMmaBlocksM = kWarpgroupM / kMmaM;  // wgmma row blocks per warpgroup
  // Consumer warpgroups that read (and release) each stage of one CTA's ring.
  static constexpr int kStageReaders = kPingpong ? 1 : kConsumerWarpgroups;
  static constexpr int kProducerThreads = kProducerWarpgroup ? hopper::kWarpgroupSize : hopper::kWarpSize;
  static constexpr int kThreads = kConsumerWarpgroups * hopper::kWarpgroupSize + kProducerThreads;
  // Each thread's share of its warpgroup's 64x256 (ping-pong: 128x128) accumulator: 128
  // elements (small M's 64x128: 64), in f32 registers, or two per register as f16x2;
  // ping-pong keeps its two 64-row blocks one after the other (kBlockAccumulatorRegisters each).
  static constexpr int kAccumulators = kWarpgroupM * kBlockN / hopper::kWarpgroupSize;
  using Accumulator = std::conditional_t<kF16Accumulate, uint32_t, float>;
  static constexpr int kAccumulatorRegisters = kF16Accumulate ? kAccumulators / 2 : kAccumulators;
  static constexpr int kBlockAccumulatorRegisters = kAccumulatorRegisters / kMmaBlocksM;  // one wgmma row block's
  // setmaxnreg moves registers within the CTA's pool, which is what the kernel was
  // launched with: kThreads x its register count, at most this many per thread (ptxas
  // caps the count here under __launch_bounds__(kThreads, kCtasPerSm); tests/test_sass.py checks
  // the built kernels use exactly it). A split beyond the pool would hang in .inc.
  // The producer keeps 40 (CUTLASS's cooperative default); the consumers share the
  // rest: 232 each with two consumer warpgroups (128 x 40 + 256 x 232 = 64512), 104
  // with four.
  static constexpr int kLaunchRegisters = kRegisterFileSize / kCtasPerSm / kThreads / 8 * 8;
  static constexpr int kProducerRegisters = 40;
  static constexpr int kConsumerRegisters =
      (kThreads * kLaunchRegisters - kProducerThreads * kProducerRegisters) /
      (kConsumerWarpgroups * hopper::kWarpgroupSize) / 8 * 8;

  // TMA-store epilogue: each consumer warpgroup writes its part (64 x 256; ping-pong: a
  // 128 x 128 tile, one 64-row block after the other) as sub-tiles of 64 rows, one
  // 128-byte swizzle row wide (64 16-bit or 32 f32 columns), through staging buffers
  // that get what the ring leaves of shared memory (after the alignment slack and
  // kSmemReserve for barriers and the fused bias slice), at most two per warpgroup: two
  // (32 KB instead of a whole extra 64 KB output tile) next to the default's 4 x 48 KB
  // ring, one next to the f16-accumulating kind's 3 x 64 KB.
  static constexpr int kStoreRowBytes = 128;
  static constexpr int kStoreRows = kMmaM;  // one wgmma row block per sub-tile
  static constexpr int kStoreBufferBytes = kStoreRows * kStoreRowBytes;  // 8 KB
  // The backward form stages its second operand (z, or the saved act'(z)): while the
  // tile's mainloop runs, one thread of each consumer warpgroup TMA-loads the
  // warpgroup's 64 x 256 slice of it into the store buffers, one sub-tile each; the
  // epilogue reads each sub-tile from there (ldmatrix, the inverse of the stmatrix that
  // then writes the result in its place) and stores it. Loaded by the epilogue itself
  // instead, a chunk of registers at a time, the operand's L2 round trips were on every
  // tile's critical path. Its 64 KB take the place of a fourth stage.
  // The kind has no other path: the host requires z and C that TMA can address.
  static constexpr bool kStagedOperand = kActivationGrad;
  static constexpr int kOperandSubtiles = kBlockN * static_cast<int>(sizeof(Element)) / kStoreRowBytes;  // 4
  static constexpr int kMaxStoreBuffers = kStagedOperand ? kOperandSubtiles : 2;  // two already hide a store
  // Named hardware barriers of the consumer warpgroups' epilogues (0 is __syncthreads').
  static constexpr int kFirstEpilogueBarrier = 1;
  static constexpr int kHardwareBarriers = 16;
  static_assert(kFirstEpilogueBarrier + kConsumerWarpgroups <= kHardwareBarriers, "one named barrier per warpgroup");

  using LayoutA = OperandLayout<Element, kMajorA, kBlockM, kBlockK>;  // a ping-pong stage holds one tile
  using LayoutB = OperandLayout<Element, kMajorB, kBlockN, kBlockK, kClusterM>;
  static constexpr uint32_t kStageBytes = LayoutA::kBytes + LayoutB::kBytes;  // TMA tx bytes
  // Decode-sized M with K-major A (A [M, K], the usual activations): a stage loads only
  // A's rows up to M, rounded up to a swizzle atom (8 rows), not the tile's 64. TMA's
  // zero fill of a box's rows past M is no saving: Nsight counted those rows as L2
  // reads like the others (16x4096x4096: 52 MB from L2 to the SMs, of which 33.7 MB
  // are B, where XLA's kernel reads 38; 40 MB trimmed): 1x8192x8192 40.4 -> 36.6 us,
  // 16x4096x4096 13.7 -> 11.3. The
  // rows past the box keep whatever the ring held; wgmma multiplies them into
  // accumulator rows past M, which are never summed with others or stored (each output
  // row depends only on its own row of A).
  static constexpr bool kTrimmedA = kSmallM && LayoutA::kKMajor;
  __host__ __device__ static constexpr int a_box_rows(int64_t m) {
    return kTrimmedA && m < kBlockM ? static_cast<int>((m + kSwizzleAtomRows - 1) / kSwizzleAtomRows) *
                                          kSwizzleAtomRows
                                    : LayoutA::kBoxOuter;
  }
  static_assert(!kTrimmedA || LayoutA::kBytes == LayoutA::kBoxOuter * kSwizzleBytes,
                "K-major A: one swizzle row per row");
  // A stage's TMA transaction bytes when A's box has `a_rows` rows.
  __host__ __device__ static constexpr uint32_t stage_bytes(int a_rows) {
    return kTrimmedA ? static_cast<uint32_t>(a_rows) * kSwizzleBytes + LayoutB::kBytes : kStageBytes;
  }

  static constexpr int64_t kSmemReserve = 2 * 1024;
  // The backward form's bias-gradient scratch (column_sums.cuh): [4 warps][kBlockN] f32
  // per consumer warpgroup.
  static constexpr int64_t kColumnSumBytes =
      kStagedOperand ? int64_t{kConsumerWarpgroups} * hopper::kWarpsPerWarpgroup * kBlockN * sizeof(float) : 0;
  // What one CTA may take: the block limit, or its share of the SM's when several share one.
  static constexpr int64_t kSmemBudget =
      kCtasPerSm == 1 ? int64_t{kMaxSmemPerBlock} : int64_t{kSmemPerSm} / kCtasPerSm - int64_t{kSmemPerCtaReserved};
  static constexpr int64_t kSchedulerBytes = kGrouped ? int64_t{sizeof(GroupTableStorage)} : 0;
  static constexpr int64_t kStoreBudget = kSmemBudget - int64_t{kSmemAlignment} - kSmemReserve -
                                          kColumnSumBytes - kSchedulerBytes - int64_t{kStages} * kStageBytes;
  static constexpr int kStoreBuffersThatFit =
      kStoreBudget > 0 ? static_cast<int>(kStoreBudget / (kConsumerWarpgroups * kStoreBufferBytes)) : 0;
  static constexpr int kStoreBuffers = kStoreBuffersThatFit < kMaxStoreBuffers ? kStoreBuffersThatFit : kMaxStoreBuffers;

  static_assert(kStages >= 1 + kMmaInFlight, "the lagging release needs a stage per group in flight");
  static_assert(kWarpgroupM % kMmaM == 0, "whole wgmma m64 row blocks per consumer warpgroup");
  static_assert(kAccumulators == (kSmallM ? 64 : 128), "64x256 / 128x128 accumulators: 128 per thread; 64x128: 64");
  static_assert(!kPingpong || (!kFusedEpilogue && !kStreamK && !kF16Accumulate && kConsumerWarpgroups == 2),
                "ping-pong: two f32 warpgroups, plain epilogue, whole tiles");
  static_assert(!(kTmaStoreEpilogue || kDeferredStore) || kStoreBuffers >= 1,
                "no room left for the epilogue's staging buffer");
  static_assert(!kSavesDerivative || kStoreBuffers == 2, "the derivative kind stages C and D side by side");
  static_assert(!kDeferredStore || ((kTmaStoreEpilogue || kGrouped) && kProducerWarpgroup && kMmaBlocksM == 1 &&
                                    !kFusedEpilogue && !kStreamK && !kSplitK && !kF16Accumulate),
                "the deferred store: one f32 row block per warpgroup, plain epilogue, the consumers' extra registers");
  static_assert(!kSplitK || (!kPersistent && !kFusedEpilogue && kConsumerWarpgroups == 1),
                "split K: one CTA per piece, one consumer warpgroup, plain epilogue");
  static_assert(!kGrouped || (kPersistent && !kTmaStoreEpilogue && !kDynamicTiles && kClusterM == 2 &&
                              kConsumerWarpgroups == 2 && kMmaBlocksM == 1),
                "grouped: 2-CTA clusters in a grid stride, two 64-row warpgroups, no TMA store");
  static_assert(!kDynamicTiles || (kPersistent && !kStreamK && !kPingpong && kClusterM == 2),
                "the dynamic order hands whole tiles to 2-CTA clusters");
  static_assert(!kStagedOperand || kStoreBuffers == kOperandSubtiles, "a store buffer per sub-tile of the operand");
  static_assert(!kProducerWarpgroup || kProducerThreads * kProducerRegisters +
                                               kConsumerWarpgroups * hopper::kWarpgroupSize * kConsumerRegisters <=
                                           kThreads * kLaunchRegisters,
                "the register split exceeds the CTA's register pool");
};

}  // namespace jax_hopper
