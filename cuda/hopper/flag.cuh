// Global-memory flags between CTAs of one grid (release/acquire at GPU scope), for
// handing a partial result from one CTA to another.
#pragma once
#include <cstdint>

#include "hopper/mbarrier.cuh"  // the debug build's wait limit

namespace jax_hopper::hopper {

// Makes this thread's earlier writes (and those ordered before it by a barrier)
// visible to a thread that acquires the flag.
__device__ __forceinline__ void flag_release(uint32_t* flag, uint32_t value) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(flag), "r"(value) : "memory");
}

__device__ __forceinline__ uint32_t flag_acquire(const uint32_t* flag) {
  uint32_t value;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
  return value;
}

// Spins until the flag holds `value`, backing off so the spinning warp leaves issue
// slots to the warps still computing on this SM.
__device__ __forceinline__ void flag_wait(const uint32_t* flag, uint32_t value) {
  constexpr unsigned kBackoffNs = 64;
#ifdef JAX_HOPPER_WAIT_LIMIT_NS
  const uint64_t start = global_time_ns();
  while (flag_acquire(flag) != value) {
    __nanosleep(kBackoffNs);
    trap_past_wait_limit(start);
  }
#else
  while (flag_acquire(flag) != value) __nanosleep(kBackoffNs);
#endif
}

// Adds one to a counter and returns its old value; release for this thread's earlier
// writes (and those ordered before it by a barrier), acquire for what the counter's
// earlier arrivals published, at GPU scope.
__device__ __forceinline__ uint32_t arrive_count(uint32_t* counter) {
  uint32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
  return old;
}

}  // namespace jax_hopper::hopper
