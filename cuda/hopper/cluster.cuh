// Thread-block cluster PTX wrappers: rank, cluster-wide barrier, and arrivals on a
// peer CTA's mbarrier (PTX ISA "Distributed Shared Memory").
#pragma once
#include <cstdint>

#include "hopper/mbarrier.cuh"

namespace jax_hopper::hopper {

__device__ __forceinline__ uint32_t cluster_cta_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

// All threads of all CTAs in the cluster; release/acquire orders shared-memory
// accesses (barrier initialisation included) across the cluster.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// A cluster-wide barrier for threads with no shared-memory writes to publish (or whose
// peers need none of them): the relaxed arrival skips the release fence (a MEMBAR); the
// wait still acquires.
__device__ __forceinline__ void cluster_sync_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The two halves of cluster_sync_relaxed, for a thread with other work between its
// arrival and the point where it must know every peer has arrived.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

// The float4 at `local`'s shared-memory offset in CTA `cta` of the cluster (distributed
// shared memory: one SM-to-SM round trip, no L2).
__device__ __forceinline__ float4 load_shared_cluster_v4(const void* local, uint32_t cta) {
  float4 v;
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %4, %5;\n"
      "ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [remote];\n"
      "}\n"
      : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
      : "r"(smem_addr(local)), "r"(cta)
      : "memory");
  return v;
}

// Arrives on the mbarrier at the same shared-memory offset in CTA `cta` of the cluster.
// Default (CTA-scope) semantics, as CUTLASS's ClusterBarrier does: the consumers' reads
// of the stage were wgmma (async proxy) reads already retired by wgmma.wait_group, so
// there is nothing for a cluster-scope release to order, and `.release.cluster` would
// cost a MEMBAR.ALL.GPU per release.
__device__ __forceinline__ void mbarrier_arrive_cluster(uint64_t* bar, uint32_t cta) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(cta)
      : "memory");
}

// Stores `value` into the word at `word`'s offset in CTA `cta`, as 4 transaction bytes
// completed on the mbarrier at `bar`'s offset there (st.async): the peer reads it after
// its wait on that barrier, as it would TMA data. A store plus a cluster-scope release
// arrival would do the same with a MEMBAR.ALL.GPU each time (measured: the dynamic tile
// order's producers then stalled at every tile).
__device__ __forceinline__ void store_async_cluster_u32(const void* word, uint32_t cta, uint32_t value,
                                                        uint64_t* bar) {
  asm volatile(
      "{\n"
      ".reg .b32 remote_word, remote_bar;\n"
      "mapa.shared::cluster.u32 remote_word, %0, %2;\n"
      "mapa.shared::cluster.u32 remote_bar, %1, %2;\n"
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.u32 [remote_word], %3, [remote_bar];\n"
      "}\n" ::"r"(smem_addr(word)),
      "r"(smem_addr(bar)), "r"(cta), "r"(value)
      : "memory");
}

// The same for four words (16-byte aligned), completing 16 transaction bytes.
__device__ __forceinline__ void store_async_cluster_v4(const void* words, uint32_t cta, int4 value, uint64_t* bar) {
  asm volatile(
      "{\n"
      ".reg .b32 remote_words, remote_bar;\n"
      "mapa.shared::cluster.u32 remote_words, %0, %2;\n"
      "mapa.shared::cluster.u32 remote_bar, %1, %2;\n"
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [remote_words], {%3, %4, %5, %6}, [remote_bar];\n"
      "}\n" ::"r"(smem_addr(words)),
      "r"(smem_addr(bar)), "r"(cta), "r"(value.x), "r"(value.y), "r"(value.z), "r"(value.w)
      : "memory");
}

}  // namespace jax_hopper::hopper
