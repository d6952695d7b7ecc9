// mbarrier PTX wrappers (shared::cta barriers, PTX ISA "Parallel Synchronization and
// Communication Instructions: mbarrier"). The only place mbarrier asm lives.
#pragma once
#include <cstdint>

namespace jax_hopper::hopper {

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrival_count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrival_count));
}

// Makes barrier initialisation visible to the async proxy (TMA) before first use.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// One arrival that also raises the phase's expected transaction byte count: the phase
// completes when the arrival count is reached and `bytes` have landed through TMA.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// try_wait's suspend-time hint (ns): a waiting thread may sleep up to this long in hardware
// before retrying, instead of spinning on the barrier (CUTLASS passes the same value).
constexpr uint32_t kWaitSuspendHintNs = 0x989680;

#ifdef JAX_HOPPER_WAIT_LIMIT_NS
// The debug build's bounded waits (CMake option JAX_HOPPER_BOUNDED_WAITS): a wait that
// lasts past the limit traps, so a hang (host and device disagreeing on a count, a phase
// or a flag) becomes a launch error instead of a GPU that never finishes.
__device__ __forceinline__ uint64_t global_time_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void trap_past_wait_limit(uint64_t start) {
  if (global_time_ns() - start > uint64_t{JAX_HOPPER_WAIT_LIMIT_NS}) __trap();
}
#define JH_MBARRIER_TRY_WAIT(SCOPE)                                                                        \
  uint32_t done;                                                                                         \
  asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity" SCOPE ".shared::cta.b64 p, [%1], %2, %3;\n" \
               "selp.u32 %0, 1, 0, p;\n}"                                                               \
               : "=r"(done)                                                                              \
               : "r"(smem_addr(bar)), "r"(phase), "r"(kWaitSuspendHintNs)                                \
               : "memory");                                                                              \
  return done != 0
__device__ __forceinline__ bool mbarrier_try_wait(uint64_t* bar, uint32_t phase) { JH_MBARRIER_TRY_WAIT(""); }
__device__ __forceinline__ bool mbarrier_try_wait_cluster(uint64_t* bar, uint32_t phase) {
  JH_MBARRIER_TRY_WAIT(".acquire.cluster");
}
#undef JH_MBARRIER_TRY_WAIT
#endif

// Blocks until the phase with parity `phase` has completed. A fresh barrier is in
// phase 0, so waiting on parity 1 returns at once (the "previous" phase counts as done).
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t phase) {
#ifdef JAX_HOPPER_WAIT_LIMIT_NS
  const uint64_t start = global_time_ns();
  while (!mbarrier_try_wait(bar, phase)) trap_past_wait_limit(start);
  return;
#endif
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1, %2;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(phase), "r"(kWaitSuspendHintNs)
      : "memory");
}

// mbarrier_wait with cluster-scope acquire: what a peer CTA's thread released onto this
// barrier (st.async's complete-tx is a cluster-scope release) is visible after it.
__device__ __forceinline__ void mbarrier_wait_cluster(uint64_t* bar, uint32_t phase) {
#ifdef JAX_HOPPER_WAIT_LIMIT_NS
  const uint64_t start = global_time_ns();
  while (!mbarrier_try_wait_cluster(bar, phase)) trap_past_wait_limit(start);
  return;
#endif
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1, %2;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(phase), "r"(kWaitSuspendHintNs)
      : "memory");
}

// A plain shared-memory load through the 32-bit shared window; volatile, so it stays
// after the barrier wait that makes the value visible.
__device__ __forceinline__ int32_t load_shared_s32(const int32_t* ptr) {
  int32_t value;
  asm volatile("ld.shared.s32 %0, [%1];" : "=r"(value) : "r"(smem_addr(ptr)));
  return value;
}

__device__ __forceinline__ int4 load_shared_v4(const int4* ptr) {
  int4 v;
  asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(smem_addr(ptr)));
  return v;
}

}  // namespace jax_hopper::hopper
