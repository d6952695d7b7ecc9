// Thread-role helpers: warpgroups are 4 consecutive warps (128 threads), the unit that
// issues wgmma and the granularity of the kernel's producer/consumer split.
#pragma once
#include <cstdint>

namespace jax_hopper::hopper {

constexpr int kWarpSize = 32;
constexpr int kWarpgroupSize = 128;
constexpr int kWarpsPerWarpgroup = kWarpgroupSize / kWarpSize;

__device__ __forceinline__ int warpgroup_index() { return threadIdx.x / kWarpgroupSize; }
// The same, broadcast from lane 0 (every lane of the warp must be active): a value the
// compiler can prove warp-uniform, so what is derived from it (a consumer's A slice,
// hence its wgmma descriptors) lives in uniform registers instead of being computed per
// thread and moved over (R2UR) for every wgmma.
__device__ __forceinline__ int warpgroup_index_uniform() {
  return __shfl_sync(0xffffffffu, warpgroup_index(), 0);
}
__device__ __forceinline__ int thread_in_warpgroup() { return threadIdx.x % kWarpgroupSize; }
__device__ __forceinline__ int lane_index() { return threadIdx.x % kWarpSize; }

// Barrier among `threads` threads of the CTA on hardware barrier `id` (0 is the one
// __syncthreads uses), so one warpgroup can synchronise without stalling the others.
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// The same barrier, also returning whether any of the threads passed `pred` true.
__device__ __forceinline__ bool named_barrier_any(uint32_t id, uint32_t threads, bool pred) {
  uint32_t any;
  asm volatile(
      "{\n"
      ".reg .pred p, q;\n"
      "setp.ne.u32 p, %1, 0;\n"
      "bar.red.or.pred q, %2, %3, p;\n"
      "selp.u32 %0, 1, 0, q;\n"
      "}"
      : "=r"(any)
      : "r"(static_cast<uint32_t>(pred)), "r"(id), "r"(threads)
      : "memory");
  return any != 0;
}

// Register reallocation between warpgroups (PTX setmaxnreg; every warp of the
// warpgroup executes it). The producer gives registers back to the pool, the
// consumers take them; kRegs is a multiple of 8 in [24, 256].
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg range");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg range");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// Stores four 8x8 b16 matrices; lane i supplies the shared address of row i % 8 of
// matrix i / 8, and each thread's register q holds its mma-fragment pair of matrix q
// (row lane / 4, columns 2 * (lane % 4) + {0, 1}) -- the wgmma accumulator layout.
__device__ __forceinline__ void stmatrix_x4(uint32_t smem_row_addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                            uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(smem_row_addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// Its inverse: loads four 8x8 b16 matrices from the same addresses into the same
// fragment registers, so a thread gets exactly the elements stmatrix_x4 would write
// from its registers.
__device__ __forceinline__ uint4 ldmatrix_x4(uint32_t smem_row_addr) {
  uint4 r;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "r"(smem_row_addr)
               : "memory");
  return r;
}

// One 32-bit word of shared memory at a shared-window address (the address form, as
// ldmatrix and stmatrix here take; mbarrier.cuh has the pointer-form load_shared_s32 and
// load_shared_v4). The epilogues reach their shared storage through a pointer computed
// from the aligned dynamic base, which the compiler cannot tell is shared: plain C++
// reads there become generic loads (LD), with a longer latency and, next to the
// volatile stmatrix, no room to be hoisted.
__device__ __forceinline__ uint32_t load_shared_u32(uint32_t smem_addr) {
  uint32_t r;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(smem_addr) : "memory");
  return r;
}

}  // namespace jax_hopper::hopper
