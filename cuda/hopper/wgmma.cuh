// wgmma (warpgroup MMA) PTX wrappers, PTX ISA "Asynchronous Warpgroup Level Matrix
// Multiply-Accumulate". The only place wgmma asm lives.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "hopper/mbarrier.cuh"

namespace jax_hopper::hopper {

// Shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format"): start address,
// leading/stride byte offsets (all >> 4) and the swizzle mode in bits 62-63.
enum class SmemSwizzle : uint64_t { k128B = 1 };

constexpr int kSmemDescUnitShift = 4;  // addresses and offsets in 16-byte units
__device__ __forceinline__ uint64_t make_smem_desc(const void* ptr, uint32_t leading_byte_offset,
                                                   uint32_t stride_byte_offset) {
  constexpr uint64_t kFieldMask = 0x3FFF;  // 14-bit fields
  const uint64_t addr = smem_addr(ptr);
  return ((addr >> kSmemDescUnitShift) & kFieldMask) |
         (((leading_byte_offset >> kSmemDescUnitShift) & kFieldMask) << 16) |
         (((stride_byte_offset >> kSmemDescUnitShift) & kFieldMask) << 32) |
         (static_cast<uint64_t>(SmemSwizzle::k128B) << 62);
}

// What to add to a descriptor to move its start address `bytes` further: the address
// is the low field, so a plain add does it as long as the sum stays in the field's 14
// bits (shared memory below 256 KB; a block has at most 227 KB).
constexpr uint64_t smem_desc_advance(uint64_t bytes) { return bytes >> kSmemDescUnitShift; }

// Orders this warpgroup's register/shared accesses before the wgmma that follows.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }

__device__ __forceinline__ void wgmma_commit_group() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

// Waits until at most kPending committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Eight consecutive accumulator registers as read-write asm operands: "+f" (f32) or
// "+r" (f16x2).
#define JAX_HOPPER_WGMMA_ACC8_AS(C, i)                                                                   \
  C(d[(i)]), C(d[(i) + 1]), C(d[(i) + 2]), C(d[(i) + 3]), C(d[(i) + 4]), C(d[(i) + 5]), C(d[(i) + 6]), \
      C(d[(i) + 7])
#define JAX_HOPPER_WGMMA_ACC8(i) JAX_HOPPER_WGMMA_ACC8_AS("+f", i)
#define JAX_HOPPER_WGMMA_ACC8_F16X2(i) JAX_HOPPER_WGMMA_ACC8_AS("+r", i)

// D[64x256] (+)= A[64x16] * B[16x256], f32 accumulate. kTransA/kTransB are the
// instruction's transpose immediates: 0 = K-major operand, 1 = MN-major operand.
// scale_d == 0 ignores the old accumulator (first MMA of a tile needs no zeroing).
#define JAX_HOPPER_WGMMA_M64N256K16(TYPE)                                                  \
  asm volatile(                                                                            \
      "{\n"                                                                                \
      ".reg .pred p;\n"                                                                    \
      "setp.ne.b32 p, %130, 0;\n"                                                          \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE "\n"                     \
      "{"                                                                                  \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"              \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"    \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"    \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,"    \
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,"    \
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95,"    \
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111,"\
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"\
      "},"                                                                                 \
      " %128, %129, p, 1, 1, %131, %132;\n"                                                \
      "}\n"                                                                                \
      : JAX_HOPPER_WGMMA_ACC8(0), JAX_HOPPER_WGMMA_ACC8(8), JAX_HOPPER_WGMMA_ACC8(16), JAX_HOPPER_WGMMA_ACC8(24), \
        JAX_HOPPER_WGMMA_ACC8(32), JAX_HOPPER_WGMMA_ACC8(40), JAX_HOPPER_WGMMA_ACC8(48), JAX_HOPPER_WGMMA_ACC8(56), \
        JAX_HOPPER_WGMMA_ACC8(64), JAX_HOPPER_WGMMA_ACC8(72), JAX_HOPPER_WGMMA_ACC8(80), JAX_HOPPER_WGMMA_ACC8(88), \
        JAX_HOPPER_WGMMA_ACC8(96), JAX_HOPPER_WGMMA_ACC8(104), JAX_HOPPER_WGMMA_ACC8(112), JAX_HOPPER_WGMMA_ACC8(120) \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB))

// D[64x128] (+)= A[64x16] * B[16x128], f32 accumulate (the ping-pong kind's tiles are
// two of these row blocks). Same operands and immediates as the n256 form.
#define JAX_HOPPER_WGMMA_M64N128K16(TYPE)                                               \
  asm volatile(                                                                         \
      "{\n"                                                                             \
      ".reg .pred p;\n"                                                                 \
      "setp.ne.b32 p, %66, 0;\n"                                                        \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE "\n"                  \
      "{"                                                                               \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"\
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"\
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"\
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"\
      "},"                                                                              \
      " %64, %65, p, 1, 1, %67, %68;\n"                                                 \
      "}\n"                                                                             \
      : JAX_HOPPER_WGMMA_ACC8(0), JAX_HOPPER_WGMMA_ACC8(8), JAX_HOPPER_WGMMA_ACC8(16), JAX_HOPPER_WGMMA_ACC8(24), \
        JAX_HOPPER_WGMMA_ACC8(32), JAX_HOPPER_WGMMA_ACC8(40), JAX_HOPPER_WGMMA_ACC8(48), JAX_HOPPER_WGMMA_ACC8(56) \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB))

// D[64xN] (+)= A[64x16] * B[16xN] with an f32 accumulator of N / 2 registers per thread,
// for the widths the kernels use (N = 256; 128 in the ping-pong kind).
template <class Element, int kTransA, int kTransB, int kN>
__device__ __forceinline__ void wgmma_m64nNk16(float (&d)[kN / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  static_assert(std::is_same_v<Element, __half> || std::is_same_v<Element, __nv_bfloat16>);
  static_assert(kN == 256 || kN == 128, "wgmma wrappers exist for N = 256 and 128");
  constexpr bool kF16 = std::is_same_v<Element, __half>;
  if constexpr (kN == 256) {
    if constexpr (kF16) {
      JAX_HOPPER_WGMMA_M64N256K16("f16");
    } else {
      JAX_HOPPER_WGMMA_M64N256K16("bf16");
    }
  } else {
    if constexpr (kF16) {
      JAX_HOPPER_WGMMA_M64N128K16("f16");
    } else {
      JAX_HOPPER_WGMMA_M64N128K16("bf16");
    }
  }
}

#undef JAX_HOPPER_WGMMA_M64N256K16
#undef JAX_HOPPER_WGMMA_M64N128K16
#undef JAX_HOPPER_WGMMA_ACC8

// D[64x256] (+)= A[64x16] * B[16x256] accumulated in f16: each register holds two
// adjacent accumulator elements (f16x2) in the f32 layout's order, so the fragment is
// half the size. f16 operands only (the instruction has no bf16 accumulator).
template <class Element, int kTransA, int kTransB, int kN>
__device__ __forceinline__ void wgmma_m64nNk16(uint32_t (&d)[kN / 4], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  static_assert(std::is_same_v<Element, __half>, "f16 accumulation takes f16 operands");
  static_assert(kN == 256, "the f16-accumulating kind's tiles are 256 wide");
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f16.f16.f16\n"
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "},"
      " %64, %65, p, 1, 1, %67, %68;\n"
      "}\n"
      : JAX_HOPPER_WGMMA_ACC8_F16X2(0), JAX_HOPPER_WGMMA_ACC8_F16X2(8), JAX_HOPPER_WGMMA_ACC8_F16X2(16),
        JAX_HOPPER_WGMMA_ACC8_F16X2(24), JAX_HOPPER_WGMMA_ACC8_F16X2(32), JAX_HOPPER_WGMMA_ACC8_F16X2(40),
        JAX_HOPPER_WGMMA_ACC8_F16X2(48), JAX_HOPPER_WGMMA_ACC8_F16X2(56)
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));
}

#undef JAX_HOPPER_WGMMA_ACC8_F16X2
#undef JAX_HOPPER_WGMMA_ACC8_AS

}  // namespace jax_hopper::hopper
