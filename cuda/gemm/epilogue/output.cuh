// What the epilogues write (OutputParams), and a thread's accumulator fragment read as
// pairs of adjacent output elements. The output type is chosen at run time (the 16-bit
// input type, or f32 straight from the accumulator) so one kernel instance serves both.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "gemm/gemm.h"

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

}  // namespace jax_hopper
