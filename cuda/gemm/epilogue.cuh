// Epilogues: accumulators (f32; f16 in the opt-in kind) -> output type -> global memory. The output type is
// chosen at run time (the 16-bit input type, or f32 straight from the accumulator) so
// one kernel instance serves both.
//  DirectStoreEpilogue  (V5) each thread stores its registers, masked at partial tiles.
//  TmaStoreEpilogue     registers -> swizzled shared-memory sub-tiles -> TMA stores
//                       that run while the consumers start the next tile (or, for C
//                       rows TMA cannot address, the warpgroup's own coalesced stores).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include <cuda.h>

#include "gemm/column_sums.cuh"
#include "gemm/gemm.h"
#include "hopper/tma.cuh"
#include "hopper/warpgroup.cuh"

namespace jax_hopper {

struct OutputParams {
  void* c;
  int64_t ldc;
  int64_t batch_stride;  // elements between the outputs of consecutive batch entries
  int m, n;
  bool f32;            // C is f32; else the kernel's 16-bit element type
  bool paired_stores;  // ldc even and c aligned for two-element stores
  bool tma_store;      // C's tensor map is valid (aligned for TMA); else registers store
  // Fused epilogue (FusedOps; kinds with Cfg::kFusedEpilogue only), operand-typed.
  const void* bias;      // [n] or null
  const void* residual;  // [m][ld_residual] or null
  int64_t ld_residual;
  bool paired_inputs;  // bias, residual, ld_residual and n allow two-element loads
  Activation activation;
  // The backward form's bias gradient (kStagedOperand kinds only): f32 column sums of C
  // per 64-row block, [ceil(m / 64)][n], or null for none (column_sums.cuh).
  float* column_sums;
};

// Two adjacent columns as one store.
template <class T>
struct PairOf;
template <>
struct PairOf<__half> {
  using type = __half2;
  __device__ static type convert(float x, float y) { return __floats2half2_rn(x, y); }
  __device__ static void split(type p, __half& x, __half& y) { x = p.x, y = p.y; }
  __device__ static float2 to_float2(type p) { return __half22float2(p); }
};
template <>
struct PairOf<__nv_bfloat16> {
  using type = __nv_bfloat162;
  __device__ static type convert(float x, float y) { return __floats2bfloat162_rn(x, y); }
  __device__ static void split(type p, __nv_bfloat16& x, __nv_bfloat16& y) { x = p.x, y = p.y; }
  __device__ static float2 to_float2(type p) { return __bfloat1622float2(p); }
};
template <class T>
__device__ __forceinline__ uint32_t pack_pair(float x, float y) {
  const auto p = PairOf<T>::convert(x, y);
  return *reinterpret_cast<const uint32_t*>(&p);
}
template <>
struct PairOf<float> {
  using type = float2;
  __device__ static type convert(float x, float y) { return make_float2(x, y); }
  __device__ static void split(type p, float& x, float& y) { x = p.x, y = p.y; }
};

// The accumulator fragment read as pairs of adjacent f32-layout elements i, i + 1 (i
// even): f32 accumulators hold one element per register, f16 ones (f16x2) two.
template <class Accumulator>
struct Fragment;
template <>
struct Fragment<float> {
  template <int N>
  __device__ static float2 pair(const float (&acc)[N], int i) {
    return make_float2(acc[i], acc[i + 1]);
  }
  template <class Out, int N>
  __device__ static uint32_t packed(const float (&acc)[N], int i) {
    return pack_pair<Out>(acc[i], acc[i + 1]);
  }
};
template <>
struct Fragment<uint32_t> {
  template <int N>
  __device__ static float2 pair(const uint32_t (&acc)[N], int i) {
    return __half22float2(*reinterpret_cast<const __half2*>(&acc[i / 2]));
  }
  template <class Out, int N>
  __device__ static uint32_t packed(const uint32_t (&acc)[N], int i) {
    static_assert(std::is_same_v<Out, __half>, "an f16 accumulator is stored as f16 as it is");
    return acc[i / 2];
  }
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

  // One wgmma row block's fragment (a ping-pong warpgroup stores its two in turn).
  using Acc = typename Cfg::Accumulator[Cfg::kBlockAccumulatorRegisters];
  using Frag = Fragment<typename Cfg::Accumulator>;

  template <class Out>
  __device__ static void store_as(const Acc& acc, const OutputParams& out, int batch, int row0, int col0) {
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
    if (out.f32) {
      store_as<float>(acc, out, batch, row0, col0);
    } else {
      store_as<typename Cfg::Element>(acc, out, batch, row0, col0);
    }
  }
};

// The standard normal CDF Phi(v), and exp(-v^2 / 2) (the density times sqrt(2 pi)), from
// one exp: with a = |v| / sqrt2, Phi(v) = erfc(a) / 2 for v < 0 and 1 - erfc(a) / 2 for
// v >= 0, where erfc(a) = exp(-a^2) erfcx(a) and erfcx(a) = t (c0 + c1 t + ... + c7 t^7),
// t = 1 / (1 + p a): a minimax fit in relative error, 1.5e-7 on [0, 12] (beyond, exp(-a^2)
// is 0 in f32). In f32, Phi and v Phi(v) stay within 8e-6 relative of the truth wherever
// they exceed 1e-37 (worst at v ~ -13, from rounding v^2 before the exp; 1.5e-6 for
// |v| < 5), far below 2^-11 (f16) and 2^-8 (bf16). With act' this is 21 instructions
// against erff's 25 plus a second exp, and, unlike 0.5 (1 + erff(v / sqrt2)), nothing
// cancels in the lower tail: that form loses 10% of Phi(-5) = 2.9e-7 and all of it below
// v = -5.5.
// ex2.approx.ftz and rcp.approx.ftz (within 2 ulp): the flush changes a result only where
// exp(-v^2 / 2) < 2^-126, |v| > 13.2: Phi is then within 2^-126 of 0 or 1, and GELU and its
// derivative for v < -13.2, below 2^-123 in magnitude, come out 0.
struct NormalCdf {
  float cdf;         // Phi(v)
  float exp_square;  // exp(-v^2 / 2)
};
__device__ __forceinline__ NormalCdf normal_cdf(float v) {
  constexpr float kHalfSquareLog2E = -0.7213475f;  // exp(-v^2 / 2) = 2^(v^2 kHalfSquareLog2E)
  constexpr float kTScale = 0.30749205f;           // p / sqrt2: t = 1 / (1 + kTScale |v|)
  // c_k / 2 (the halving of erfc folded in), fitted with scipy.special.erfcx, p = 0.43485943
  constexpr float kHalfErfcx[] = {0.12264624238014221f,  0.12324454635381699f, 0.1056860163807869f,
                                  0.11531910300254822f,  -0.026070870459079742f, 0.17022182047367096f,
                                  -0.14734487235546112f, 0.036298081278800964f};
  constexpr int kTerms = sizeof(kHalfErfcx) / sizeof(kHalfErfcx[0]);
  float e, t;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(v * v * kHalfSquareLog2E));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(t) : "f"(fmaf(fabsf(v), kTScale, 1.0f)));
  float poly = kHalfErfcx[kTerms - 1];
#pragma unroll
  for (int k = kTerms - 2; k >= 0; --k) poly = fmaf(poly, t, kHalfErfcx[k]);
  const float half_erfc = e * (poly * t);
  return {v < 0.0f ? half_erfc : 1.0f - half_erfc, e};
}

// Exact GELU and its derivative, v Phi(v) and Phi(v) + v phi(v).
__device__ __forceinline__ float2 gelu_erf_with_derivative(float v) {
  constexpr float kInvSqrt2Pi = 0.3989422804014327f;
  const NormalCdf n = normal_cdf(v);
  return make_float2(v * n.cdf, fmaf(v * kInvSqrt2Pi, n.exp_square, n.cdf));
}

// The same for two adjacent pairs of elements, (v0, v1) and (v2, v3), as a called
// function returning (act pair 0, act' pair 0, act pair 1, act' pair 1) packed in Element:
// inlined at every element, its ~40 instructions (when Phi came from erff) made the
// derivative kind's unrolled epilogue walk too long for the instruction cache (ncu: "no
// instruction" stalls, 14% of the kernel's samples against 2% in the forward fused kind).
// Now 21 per element; the call stays (not measured inlined). Four elements per call keep
// four independent dependency chains in flight.
template <class Element>
__device__ __noinline__ uint4 gelu_erf_with_derivative_x4(float v0, float v1, float v2, float v3) {
  const float2 r0 = gelu_erf_with_derivative(v0), r1 = gelu_erf_with_derivative(v1);
  const float2 r2 = gelu_erf_with_derivative(v2), r3 = gelu_erf_with_derivative(v3);
  return make_uint4(pack_pair<Element>(r0.x, r1.x), pack_pair<Element>(r0.y, r1.y), pack_pair<Element>(r2.x, r3.x),
                    pack_pair<Element>(r2.y, r3.y));
}

// Calls f(std::integral_constant<Activation, a>{}) for the run-time activation a, so each
// epilogue form is compiled once per activation and the choice is not re-made per element.
template <class F>
__device__ __forceinline__ void with_activation(Activation a, F&& f) {
  switch (a) {
    case Activation::kRelu:
      return f(std::integral_constant<Activation, Activation::kRelu>{});
    case Activation::kGeluTanh:
      return f(std::integral_constant<Activation, Activation::kGeluTanh>{});
    case Activation::kGeluErf:
      return f(std::integral_constant<Activation, Activation::kGeluErf>{});
    case Activation::kSilu:
      return f(std::integral_constant<Activation, Activation::kSilu>{});
    default:
      return f(std::integral_constant<Activation, Activation::kNone>{});
  }
}

// The fused epilogue's arithmetic, on the f32 accumulator before any rounding:
// acc = act(acc + bias[col]) + residual[row][col] (cuBLASLt's bias/activation epilogues
// plus a residual add); for the backward form, acc * act'(z[row][col]) with the
// forward's pre-activation z staged where the output goes (cuBLASLt's DGELU;
// TmaStoreEpilogue::store_times_operand). One loop per activation, so the choice is not
// re-made per element.
// The activations run on both consumer warpgroups at once while the tensor cores idle,
// so they use the SFU's ex2/rcp approximations where the answer stays far below 16-bit
// rounding: 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)) exactly, and ex2.approx / rcp.approx
// keep 1 / (1 + exp(-y)) within |y| 2^-24 + a few ulp relative (2^-17 at |y| = 88, past
// which exp overflows and the result is 0: truly below 1e-37) -- against 2^-11 (f16) and
// 2^-8 (bf16) for the rounding that follows. Unlike 1 + tanhf(u), nothing cancels as the
// result nears 0. Every instruction here is issued per output element (about 20 for
// tanh-GELU with its derivative), so the constants are folded: GELU(tanh)'s exponent
// comes from one FMUL, one FFMA and one FMUL, and its slope from one FFMA on the same v^2.
template <class Cfg>
struct FusedOps {
  using Element = typename Cfg::Element;
  using Pair = PairOf<Element>;
  using Direct = DirectStoreEpilogue<Cfg>;

  // sigmoid(y) = 1 / (1 + 2^t), t = -y log2(e) given, on the SFU with denormals flushed:
  // ex2.approx.ftz and rcp.approx.ftz. The plain forms add a range check and a rescale
  // each (three instructions per element, and predicates and registers that made the
  // backward form spill). Flushing changes nothing here: a subnormal 2^t (y > 87) is
  // lost against the 1 it is added to, and a reciprocal below 2^-126 (y < -87) becomes
  // 0 -- the limit, as __fdividef gives for a denominator past 2^126 -- so act(v) is 0
  // instead of a value below 1e-36 and act'(z) below about 2^-119 times g.
  __device__ static float sigmoid_of_exponent(float t) {
    float e, s;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(t));
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(s) : "f"(1.0f + e));
    return s;
  }
  static constexpr float kMinusLog2E = -1.4426950408889634f;
  __device__ static float sigmoid_ftz(float y) { return sigmoid_of_exponent(y * kMinusLog2E); }

  // GELU(tanh) is z sigmoid(y(z)), y = 2 sqrt(2/pi) (z + kCubic z^3): its exponent
  // -y log2(e) = z (kExpLinear + kExpCubic z^2) and its slope y'(z) = kTwoSqrt2OverPi +
  // kSlopeCubic z^2, both from v2 = z^2 (the constants' roundings, 2^-24 relative each,
  // are no larger than the multiplies they replace).
  static constexpr float kTwoSqrt2OverPi = 2.0f * 0.7978845608028654f;
  static constexpr float kCubic = 0.044715f;
  static constexpr float kExpLinear = kTwoSqrt2OverPi * kMinusLog2E;
  static constexpr float kExpCubic = kExpLinear * kCubic;
  static constexpr float kSlopeCubic = 3.0f * kCubic * kTwoSqrt2OverPi;
  __device__ static float gelu_tanh_sigmoid(float z, float z2) {
    return sigmoid_of_exponent(z * fmaf(z2, kExpCubic, kExpLinear));
  }
  __device__ static float gelu_tanh_slope(float z2) { return fmaf(z2, kSlopeCubic, kTwoSqrt2OverPi); }

  template <Activation kAct>
  __device__ static float activate(float v) {
    if constexpr (kAct == Activation::kRelu) {
      return fmaxf(v, 0.0f);
    } else if constexpr (kAct == Activation::kGeluTanh) {  // jax.nn.gelu(approximate=True)
      return v * gelu_tanh_sigmoid(v, v * v);
    } else if constexpr (kAct == Activation::kGeluErf) {  // jax.nn.gelu(approximate=False)
      return v * normal_cdf(v).cdf;
    } else if constexpr (kAct == Activation::kSilu) {  // jax.nn.silu: x * sigmoid(x)
      return v * sigmoid_ftz(v);
    } else {
      return v;
    }
  }

  // The backward form: the cotangent g of act(z) times act'(z), on the SFU as above.
  // ReLU selects, as jax.nn.relu's derivative does (0 at z = 0, and an infinite g stays out).
  // Without an activation the loaded tensor is act'(z) itself, saved by the forward
  // pass (jax_hopper.mlp's saved-derivative form): a multiply.
  template <Activation kAct>
  __device__ static float times_derivative(float g, float z) {
    if constexpr (kAct == Activation::kRelu) {
      return z > 0.0f ? g : 0.0f;
    } else if constexpr (kAct == Activation::kGeluTanh) {  // s + z s (1 - s) y'(z), s = sigmoid(y(z))
      const float z2 = z * z;
      const float s = gelu_tanh_sigmoid(z, z2);
      return g * fmaf(z * s * (1.0f - s), gelu_tanh_slope(z2), s);
    } else if constexpr (kAct == Activation::kGeluErf) {  // Phi(z) + z phi(z)
      return g * gelu_erf_with_derivative(z).y;
    } else if constexpr (kAct == Activation::kSilu) {  // s + z s (1 - s) = s (1 + z (1 - s)), s = sigmoid(z)
      const float s = sigmoid_ftz(z);
      return g * s * fmaf(z, 1.0f - s, 1.0f);
    } else {  // z holds act'(z) already (__fmul_rn: as g * z, but this form does not spill)
      return __fmul_rn(g, z);
    }
  }

  // The forward form that also saves the derivative (kind kPersistentFusedDerivative):
  // act(v) and act'(v) of one pre-activation v, sharing what the two have in common
  // (sigmoid, Phi). The backward pass then multiplies by act'(z) instead of recomputing
  // it from z.
  template <Activation kAct>
  __device__ static float2 activate_with_derivative(float v) {
    if constexpr (kAct == Activation::kRelu) {
      return make_float2(fmaxf(v, 0.0f), v > 0.0f ? 1.0f : 0.0f);
    } else if constexpr (kAct == Activation::kGeluTanh) {  // v s, s + v s (1 - s) y'(v)
      const float v2 = v * v;
      const float s = gelu_tanh_sigmoid(v, v2);
      const float vs = v * s;
      return make_float2(vs, fmaf(vs * (1.0f - s), gelu_tanh_slope(v2), s));
    } else if constexpr (kAct == Activation::kGeluErf) {
      return gelu_erf_with_derivative(v);
    } else if constexpr (kAct == Activation::kSilu) {  // v s, s (1 + v (1 - s))
      const float s = sigmoid_ftz(v);
      return make_float2(v * s, s * fmaf(v, 1.0f - s, 1.0f));
    } else {
      return make_float2(v, 1.0f);
    }
  }

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

  // Same fragment walk as DirectStoreEpilogue: rows r, r + 8 and columns
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
          v0 = activate<kAct>(v0 + b.x) + loaded.x;
          v1 = activate<kAct>(v1 + b.y) + loaded.y;
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

template <class Cfg>
struct TmaStoreEpilogue {
  using Direct = DirectStoreEpilogue<Cfg>;
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

  // ---- The deferred store (config.cuh: kDeferredStore) ----
  // A finished tile's 16-bit output waits in `pending` (packed pairs, 64 registers) while
  // the next tile's mainloop starts: its sub-tile s is staged and stored during that
  // tile's K tile s, under the MMAs already issued, so the tensor cores wait only for
  // the packing between tiles instead of the whole staging walk.
  static constexpr int kPendingCols = Cfg::kStoreRowBytes / 2;
  static constexpr int kPendingSubtiles = Cfg::kBlockN / kPendingCols;
  // The next tile's sub-tile 0 reuses buffer 0 right after this tile's last sub-tile:
  // that must be the other buffer, or the wait above would not cover its store.
  static_assert(!Cfg::kDeferredStore || kPendingSubtiles % Cfg::kStoreBuffers == 0,
                "consecutive tiles' sub-tiles must alternate staging buffers");
  struct Pending {
    uint32_t words[Cfg::kBlockAccumulatorRegisters / 2];  // words[i]: accumulator elements 2i, 2i + 1
    int batch, row0, col0;
    bool valid;
  };

  __device__ static void defer(const typename Direct::Acc& acc, Pending& pending, int batch, int row0, int col0) {
    using Frag = typename Direct::Frag;
#pragma unroll
    for (int i = 0; i < Cfg::kBlockAccumulatorRegisters / 2; ++i)
      pending.words[i] = Frag::template packed<typename Cfg::Element>(acc, 2 * i);
    pending.batch = batch, pending.row0 = row0, pending.col0 = col0, pending.valid = true;
  }

  // C rows TMA cannot address (a row of ldc 16-bit elements that is not a multiple of 16
  // bytes, e.g. an odd N, or a misaligned C): the staged sub-tile leaves through the
  // warpgroup's own stores instead of a TMA store, still under the next tile's MMAs. Each
  // warp copies 16 of its 64 rows, one row per instruction: lane l takes columns 2l, 2l + 1
  // as one 4-byte store where the pair is 4-byte aligned in C (every other row of an odd
  // ldc), else as two 2-byte ones. The registers-to-C stores this replaces wrote 8 bytes
  // to each of 8 rows per instruction while the tensor cores waited: 0.11 ms of a 0.47 ms
  // kernel at 4096x8191x4096 (BENCHMARKS.md, 2026-12-02 07:48).
  __device__ static void copy_out(const uint8_t* buf, const OutputParams& out, int batch, int row0, int col) {
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
    const int rows = min(kRowsPerWarp, out.m - row0 - first_row);  // this warp's rows inside M
    const uint32_t src = hopper::smem_addr(buf);
    const int64_t row_bytes = out.ldc * kElementBytes;
    char* dst = static_cast<char*>(out.c) +
                ((batch * out.batch_stride + c) * kElementBytes + (row0 + first_row) * row_bytes);
#pragma unroll 1  // a loop, not 16 copies: this runs between the next tile's wgmma issues, beside 192 live registers
    for (int i = 0; i < rows; ++i, dst += row_bytes) {
      const uint32_t pair = hopper::load_shared_u32(src + swizzled(first_row + i, kPairBytes * lane));
      if (second_in && reinterpret_cast<uintptr_t>(dst) % kPairBytes == 0) {
        *reinterpret_cast<uint32_t*>(dst) = pair;
      } else {
        if (first_in) *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(pair);
        if (second_in) *reinterpret_cast<uint16_t*>(dst + kElementBytes) = static_cast<uint16_t>(pair >> kHalfBits);
      }
    }
  }

  // Sub-tile s of the pending tile: staged, then one TMA store, or (C rows TMA cannot
  // address) copy_out. There each warp stages (stmatrix) and copies only its own 16 rows,
  // so a __syncwarp orders the two, and none is needed before the staging: the warp read
  // this buffer kStoreBuffers sub-tiles ago, before the __syncwarp after the last staging.
  // (A warpgroup barrier here made each warp wait for the slowest of four.)
  __device__ static void store_pending_subtile(const Pending& pending, Buffers& buffers, const CUtensorMap* tmap_c,
                                               const OutputParams& out, int warpgroup, int s) {
    static_assert(Cfg::kStoreBuffers >= 2, "copy_out reuses a buffer two sub-tiles later");
    const auto stage = [&](uint8_t* buf) { stage_words([&](int i) { return pending.words[i / 2]; }, buf, s); };
    const int col = pending.col0 + s * kPendingCols;
    if (out.tma_store) {
      store_subtile(stage, buffers, tmap_c, warpgroup, s, pending.batch, pending.row0, col);
    } else {
      uint8_t* buf = buffers[s % Cfg::kStoreBuffers];
      stage(buf);
      __syncwarp();
      copy_out(buf, out, pending.batch, pending.row0, col);
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

  // Kind kPersistentFusedDerivative: the activation and its derivative of the biased f32
  // accumulator, C = act(acc + bias) and D = act'(acc + bias), each rounded once.
  // Sub-tile s of both, each element's pair computed once for both: the same stmatrix
  // walk as stage_subtile puts C into buf_c; D's packed pairs are returned in `d` (16
  // registers, which the sub-tile's dead accumulators free) to be staged once D's
  // buffer is free.
  static constexpr int kMatrices = 4;  // of one stmatrix.x4: (block j, j + 1) x (rows r, r + 8)
  static constexpr int kPairSteps = Cfg::kStoreRowBytes / 2 / Direct::kColsPerBlock / 2;  // stmatrix per sub-tile
  using PackedSubtile = uint32_t[kPairSteps][kMatrices];

  __device__ static uint32_t stmatrix_offset(int p) {
    constexpr int kMatrixRows = 8;
    const int t = hopper::thread_in_warpgroup();
    const int warp = t / hopper::kWarpSize;
    const int lane = t % hopper::kWarpSize;
    const int matrix = lane / kMatrixRows;
    const int row = warp * Direct::kRowsPerWarp + (matrix % 2) * Direct::kHalfRows + lane % kMatrixRows;
    return swizzled(row, (2 * p + matrix / 2) * Direct::kColsPerBlock * 2);
  }

  template <Activation kAct>
  __device__ static void stage_with_derivative(const typename Direct::Acc& acc, uint8_t* buf_c, PackedSubtile& d,
                                               int s, const uint32_t (&bias_smem)[hopper::kWarpgroupSize],
                                               bool has_bias) {
    using Element = typename Cfg::Element;
    using Ops = FusedOps<Cfg>;
    static_assert(sizeof(Element) == 2 && std::is_same_v<typename Cfg::Accumulator, float>,
                  "16-bit outputs of an f32 accumulator");
    constexpr int kSubtileBlocks = 2 * kPairSteps;
    uint32_t bias[kSubtileBlocks];
    Ops::load_bias(bias_smem, has_bias, s * kSubtileBlocks, bias);
#pragma unroll
    for (int p = 0; p < kPairSteps; ++p) {
      const int j = s * kSubtileBlocks + 2 * p;  // first accumulator column block of the pair
      uint32_t c[kMatrices];
#pragma unroll
      for (int q = 0; q < kMatrices; q += 2) {  // accumulator pairs 4j + 2q, 4j + 2q + 2: block j + q / 2, both halves
        const float2 b = Ops::unpack(bias[2 * p + q / 2]);
        const int i = 4 * j + 2 * q;
        if constexpr (kAct == Activation::kGeluErf) {
          const uint4 r = gelu_erf_with_derivative_x4<Element>(acc[i] + b.x, acc[i + 1] + b.y, acc[i + 2] + b.x,
                                                               acc[i + 3] + b.y);
          c[q] = r.x, d[p][q] = r.y, c[q + 1] = r.z, d[p][q + 1] = r.w;
        } else {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float2 v0 = Ops::template activate_with_derivative<kAct>(acc[i + 2 * e] + b.x);
            const float2 v1 = Ops::template activate_with_derivative<kAct>(acc[i + 2 * e + 1] + b.y);
            c[q + e] = pack_pair<Element>(v0.x, v1.x);
            d[p][q + e] = pack_pair<Element>(v0.y, v1.y);
          }
        }
      }
      hopper::stmatrix_x4(hopper::smem_addr(buf_c) + stmatrix_offset(p), c[0], c[1], c[2], c[3]);
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
      for (int p = 0; p < kPairSteps; ++p)
        hopper::stmatrix_x4(hopper::smem_addr(buffers[1]) + stmatrix_offset(p), d[p][0], d[p][1], d[p][2], d[p][3]);
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

  // ---- The backward form's staged operand (config.cuh: kStagedOperand) ----
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
    hopper::mbarrier_wait(full, phase);
#pragma unroll
    for (int s = 0; s < Cfg::kOperandSubtiles; ++s) {
      typename Sums::SubtileSums sums;
      // The sub-tile's loads first, so their latencies overlap (ldmatrix and stmatrix are
      // volatile: the compiler keeps each load next to the store after it).
      uint32_t addr[kPairSteps];
      uint4 z4[kPairSteps];
#pragma unroll
      for (int p = 0; p < kPairSteps; ++p) {
        addr[p] = hopper::smem_addr(buffers[s]) + stmatrix_offset(p);
        z4[p] = hopper::ldmatrix_x4(addr[p]);
      }
#pragma unroll
      for (int p = 0; p < kPairSteps; ++p) {
        const int j = s * 2 * kPairSteps + 2 * p;  // first accumulator column block of the pair
        const uint32_t z[kMatrices] = {z4[p].x, z4[p].y, z4[p].z, z4[p].w};
        uint32_t c[kMatrices];
#pragma unroll
        for (int q = 0; q < kMatrices; ++q) {  // matrix q holds accumulator pair 4j + 2q
          const float2 zq = Ops::unpack(z[q]);
          const int i = 4 * j + 2 * q;
          const float2 v = make_float2(Ops::template times_derivative<kAct>(acc[i], zq.x),
                                       Ops::template times_derivative<kAct>(acc[i + 1], zq.y));
          c[q] = pack_pair<Element>(v.x, v.y);
          if constexpr (kColumnSums) {  // q = 0, 1: rows r, r + 8 of block 2p; q = 2, 3: of block 2p + 1
            float2& sum = sums[2 * p + q / 2];
            sum = q % 2 == 0 ? v : Sums::add(sum, v);
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

  // The stores must have read shared memory before the CTA exits; their writes need no
  // wait (the grid's completion covers them, as CUTLASS's store tail relies on). Waiting
  // for the writes cost about 0.13 us at each CTA's end (decode kind, per-CTA timeline).
  __device__ static void finish() {
    if (hopper::thread_in_warpgroup() == 0) hopper::bulk_wait_group_read<0>();
  }
};

}  // namespace jax_hopper
