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

// The dynamic tile order's hand-over between the two producers (tile_scheduler.cuh:
// TileTickets): a store into the peer's shared memory, published by an arrival with
// cluster-scope release that the peer's cluster-scope acquire wait (mbarrier.cuh) pairs
// with. Once per tile on one thread, so the release's fence is off the MMAs' path.
__device__ __forceinline__ void store_cluster_u32(const void* local, uint32_t cta, uint32_t value) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "st.shared::cluster.u32 [remote], %2;\n"
      "}\n" ::"r"(smem_addr(local)),
      "r"(cta), "r"(value)
      : "memory");
}

__device__ __forceinline__ void mbarrier_arrive_cluster_release(uint64_t* bar, uint32_t cta) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(cta)
      : "memory");
}

}  // namespace jax_hopper::hopper
