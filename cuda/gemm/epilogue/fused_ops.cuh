// The forward fused epilogue: bias, activation and residual applied to the f32
// accumulator (kPersistentFused), and the bias staging the derivative kind shares.
#pragma once
#include <cstdint>

#include "gemm/epilogue/activations.cuh"
#include "gemm/epilogue/direct_store.cuh"
#include "gemm/epilogue/output.cuh"
#include "hopper/tma.cuh"
#include "hopper/warpgroup.cuh"

namespace jax_hopper {

// The fused epilogue's arithmetic, on the f32 accumulator before any rounding:
// acc = act(acc + bias[col]) + residual[row][col] (cuBLASLt's bias/activation epilogues
// plus a residual add); for the backward form, acc * act'(z[row][col]) with the
// forward's pre-activation z staged where the output goes (cuBLASLt's DGELU;
// staged_operand.cuh). One loop per activation, so the choice is not
// re-made per element.
template <class Cfg>
struct FusedOps {
  using Element = typename Cfg::Element;
  using Pair = PairOf<Element>;
  using Direct = DirectStore<Cfg>;

  // Elements col, col + 1 of a row as floats; pairs as one 4-byte load where allowed
  // (col is always even), elements outside [0, n) as 0 and never read.
  __device__ static float2 load_pair(const Element* row, int col, int n, bool paired) {
    if (paired && col + 1 < n) return Pair::to_float2(*reinterpret_cast<const typename Pair::type*>(row + col));
    return make_float2(col < n ? static_cast<float>(row[col]) : 0.0f,
                       col + 1 < n ? static_cast<float>(row[col + 1]) : 0.0f);
  }

  // Read after the mainloop, each bias or residual element would be a global load on
  // the tile's critical path, and the loads of one thread come one after another (each
  // feeds the next element's arithmetic). So, before the mainloop: thread t loads the
  // bias pair at columns col0 + 2t (one register held through the mainloop; apply
  // shares the pairs through shared memory) and asks L2 for its part of the residual
  // rows (two threads per row, 256 bytes each: 64 rows x 512 bytes).
  static constexpr int kThreadsPerResidualRow = hopper::kWarpgroupSize / Cfg::kWarpgroupM;  // 2
  static constexpr int kLineElements = 128 / sizeof(Element);
  static constexpr int kResidualLinesPerThread = Cfg::kBlockN / kThreadsPerResidualRow / kLineElements;  // 2

  __device__ static uint32_t prefetch(const OutputParams& out, int row0, int col0) {
    const int t = hopper::thread_in_warpgroup();
    if (out.residual != nullptr) {
      const int row = row0 + t / kThreadsPerResidualRow;
      const int col = col0 + (t % kThreadsPerResidualRow) * kResidualLinesPerThread * kLineElements;
      if (row < out.m && col < out.n) {
        const auto* span =
            static_cast<const Element*>(out.residual) + static_cast<int64_t>(row) * out.ld_residual + col;
        // The span need not start on a line: its first element of every line's worth,
        // and its last element, cover all the lines it touches.
        const int last = min(kResidualLinesPerThread * kLineElements, out.n - col) - 1;
#pragma unroll
        for (int i = 0; i < kResidualLinesPerThread; ++i)
          if (i * kLineElements <= last) hopper::prefetch_l2(span + i * kLineElements);
        hopper::prefetch_l2(span + last);
      }
    }
    if (out.bias == nullptr) return 0;
    const float2 b = load_pair(static_cast<const Element*>(out.bias), col0 + 2 * t, out.n, out.paired_inputs);
    return pack_pair<Element>(b.x, b.y);  // exact: both were Element values
  }

  __device__ static float2 unpack(uint32_t raw) {
    return Pair::to_float2(*reinterpret_cast<const typename Pair::type*>(&raw));
  }

  // Residual elements col, col + 1 of a row as raw 16-bit bits (element col in the low
  // half); -0 where there is none (outside the row or [0, n), or no residual at all):
  // x + (-0) is x for every x, -0 included, so adding it changes nothing. Written as
  // selects, not branches, so the loads of a chunk can all be in flight at once.
  // kPaired: one 4-byte load (n even, rows 4-byte aligned: col < n covers both).
  static constexpr uint32_t kNegativeZero = 0x8000;  // sign bit of f16 and bf16
  static constexpr uint32_t kNegativeZeroPair = kNegativeZero | (kNegativeZero << 16);
  template <bool kPaired>
  __device__ static uint32_t load_raw(const Element* row, bool row_ok, int col, int n) {
    if constexpr (kPaired) {
      return row_ok && col < n ? *reinterpret_cast<const uint32_t*>(row + col) : kNegativeZeroPair;
    } else {
      const auto* bits = reinterpret_cast<const uint16_t*>(row);
      const uint32_t lo = row_ok && col < n ? bits[col] : kNegativeZero;
      const uint32_t hi = row_ok && col + 1 < n ? bits[col + 1] : kNegativeZero;
      return lo | (hi << 16);
    }
  }

  // Same fragment walk as DirectStore: rows r, r + 8 and columns
  // 8j + 2 (lane % 4) + {0, 1} of the warpgroup's 64-row block. Elements outside
  // [m, n) are never stored (their residual is never loaded); `bias_smem` (read only
  // with has_bias) holds the tile's bias pairs, 0 past n. The residual is read a chunk
  // of column blocks at a time, every load of the chunk issued before its first use.
  static constexpr int kResidualChunk = 4;  // column blocks: 8 loads (8 registers) in flight
  template <Activation kAct, bool kPaired>
  __device__ static void apply_as(float (&acc)[Cfg::kAccumulators], const OutputParams& out, int row0, int col0,
                                  const uint32_t (&bias_smem)[hopper::kWarpgroupSize], bool has_bias) {
    static_assert(Direct::kColBlocks % kResidualChunk == 0, "whole chunks of column blocks");
    const auto* residual = static_cast<const Element*>(out.residual);
    const int t = hopper::thread_in_warpgroup();
    const int warp = t / hopper::kWarpSize;
    const int lane = t % hopper::kWarpSize;
    const int r = row0 + warp * Direct::kRowsPerWarp + lane / 4;
    const int c = col0 + 2 * (lane % 4);
    const Element* rows[2];
    bool row_ok[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = r + half * Direct::kHalfRows;
      row_ok[half] = residual != nullptr && row < out.m;
      // Never loaded from unless row_ok (an absent residual has ld_residual 0: null + 0).
      rows[half] = residual + static_cast<int64_t>(row) * out.ld_residual;
    }
#pragma unroll
    for (int j0 = 0; j0 < Direct::kColBlocks; j0 += kResidualChunk) {
      uint32_t res[kResidualChunk][2];
#pragma unroll
      for (int i = 0; i < kResidualChunk; ++i)
#pragma unroll
        for (int half = 0; half < 2; ++half)
          res[i][half] = load_raw<kPaired>(rows[half], row_ok[half], c + (j0 + i) * Direct::kColsPerBlock, out.n);
      uint32_t bias[kResidualChunk];
      load_bias(bias_smem, has_bias, j0, bias);
#pragma unroll
      for (int i = 0; i < kResidualChunk; ++i) {
        const int j = j0 + i;
        const float2 b = unpack(bias[i]);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float2 loaded = unpack(res[i][half]);
          float& v0 = acc[4 * j + 2 * half];
          float& v1 = acc[4 * j + 2 * half + 1];
          v0 = Activations::activate<kAct>(v0 + b.x) + loaded.x;
          v1 = Activations::activate<kAct>(v1 + b.y) + loaded.y;
        }
      }
    }
  }

  __device__ static void apply_form(float (&acc)[Cfg::kAccumulators], const OutputParams& out, int row0, int col0,
                                    const uint32_t (&bias_smem)[hopper::kWarpgroupSize], bool has_bias) {
    with_activation(out.activation, [&](auto act) {
      constexpr Activation kAct = decltype(act)::value;
      if (out.paired_inputs) {
        apply_as<kAct, true>(acc, out, row0, col0, bias_smem, has_bias);
      } else {
        apply_as<kAct, false>(acc, out, row0, col0, bias_smem, has_bias);
      }
    });
  }

  // `bias_pair` is what prefetch returned for this tile; `bias_smem` this warpgroup's
  // slot array, `barrier` a named barrier of this warpgroup alone.
  __device__ static void share_bias(const OutputParams& out, uint32_t bias_pair,
                                    uint32_t (&bias_smem)[hopper::kWarpgroupSize], uint32_t barrier) {
    if (out.bias == nullptr) return;
    hopper::named_barrier_sync(barrier, hopper::kWarpgroupSize);  // the last tile's readers are done
    bias_smem[hopper::thread_in_warpgroup()] = bias_pair;
    hopper::named_barrier_sync(barrier, hopper::kWarpgroupSize);
  }

  __device__ static void apply(float (&acc)[Cfg::kAccumulators], const OutputParams& out, int row0, int col0,
                               uint32_t bias_pair, uint32_t (&bias_smem)[hopper::kWarpgroupSize],
                               uint32_t barrier) {
    const bool has_bias = out.bias != nullptr;
    if (has_bias) {
      hopper::named_barrier_sync(barrier, hopper::kWarpgroupSize);  // the last tile's readers are done
      bias_smem[hopper::thread_in_warpgroup()] = bias_pair;
      hopper::named_barrier_sync(barrier, hopper::kWarpgroupSize);
    }
    apply_form(acc, out, row0, col0, bias_smem, has_bias);
  }

  // Bias pairs of the thread's accumulator column blocks j0 .. j0 + kBlocks - 1 (block j:
  // columns 8j + 2 (lane % 4) + {0, 1}), packed; -0 without a bias (x + (-0) = x: a -0
  // product stays -0). Pair index (col - col0) / 2 = lane % 4 + 4j: lanes with equal
  // lane % 4 read one word (broadcast). All of them issued before the first is used, as
  // shared loads (hopper::load_shared_u32).
  template <int kBlocks>
  __device__ static void load_bias(const uint32_t (&bias_smem)[hopper::kWarpgroupSize], bool has_bias, int j0,
                                   uint32_t (&words)[kBlocks]) {
    const int lane = hopper::thread_in_warpgroup() % hopper::kWarpSize;
    const uint32_t base = hopper::smem_addr(&bias_smem[lane % 4]);
    constexpr uint32_t kBlockStride = Direct::kColsPerBlock / 2 * sizeof(uint32_t);
#pragma unroll
    for (int i = 0; i < kBlocks; ++i)
      words[i] = has_bias ? hopper::load_shared_u32(base + (j0 + i) * kBlockStride) : kNegativeZeroPair;
  }
};

}  // namespace jax_hopper
