// Per-thread asynchronous global -> shared copies (cp.async, 16 bytes each, through L2
// only): many loads in flight without holding a register for each.
#pragma once
#include <cstdint>

#include "hopper/mbarrier.cuh"

namespace jax_hopper::hopper {

__device__ __forceinline__ void copy_async_16(void* smem_dst, const void* global_src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(smem_dst)),
               "l"(reinterpret_cast<uint64_t>(global_src))
               : "memory");
}

// Waits for all of this thread's copies; what they wrote is then visible to it.
__device__ __forceinline__ void copy_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

}  // namespace jax_hopper::hopper
