// The fused epilogues' elementwise functions, in f32: act(v), act'(v) and g * act'(z)
// for each Activation, and the run-time choice of one as a compile-time constant.
#pragma once
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "gemm/epilogue/output.cuh"
#include "gemm/gemm.h"

namespace jax_hopper {

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

// max(v, 0) that keeps a NaN, as jax.nn.relu (jnp.maximum) does: fmaxf(NaN, 0) is 0.
__device__ __forceinline__ float relu(float v) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(v), "f"(0.0f));
  return r;
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

// The activations run on both consumer warpgroups at once while the tensor cores idle,
// so they use the SFU's ex2/rcp approximations where the answer stays far below 16-bit
// rounding: 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)) exactly, and ex2.approx / rcp.approx
// keep 1 / (1 + exp(-y)) within |y| 2^-24 + a few ulp relative (2^-17 at |y| = 88, past
// which exp overflows and the result is 0: truly below 1e-37) -- against 2^-11 (f16) and
// 2^-8 (bf16) for the rounding that follows. Unlike 1 + tanhf(u), nothing cancels as the
// result nears 0. Every instruction here is issued per output element (about 20 for
// tanh-GELU with its derivative), so the constants are folded: GELU(tanh)'s exponent
// comes from one FMUL, one FFMA and one FMUL, and its slope from one FFMA on the same v^2.
struct Activations {
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
      return relu(v);
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
  // ReLU selects, as jax.nn.relu's derivative does (0 at z = 0 and at a NaN z, and an
  // infinite g stays out).
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
      return make_float2(relu(v), v > 0.0f ? 1.0f : 0.0f);
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
};

}  // namespace jax_hopper
