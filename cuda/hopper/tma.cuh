// TMA (cp.async.bulk.tensor) PTX wrappers. Loads complete on an mbarrier through its
// transaction count; out-of-bounds box elements are zero-filled by the hardware.
#pragma once
#include <cuda.h>

#include <cstdint>

#include "hopper/mbarrier.cuh"

namespace jax_hopper::hopper {

// Pulls the descriptor into the constant cache before the first load uses it.
__device__ __forceinline__ void tma_prefetch_descriptor(const CUtensorMap* tmap) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(tmap)) : "memory");
}

// Asks L2 for the 128-byte line holding `p` (no register, no completion to wait for):
// plain loads issued later then hit L2 instead of DRAM.
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<uint64_t>(p)));
}

// 3-D tile load: coordinates are (innermost, outer, batch) in elements.
__device__ __forceinline__ void tma_load_3d(void* smem_dst, const CUtensorMap* tmap, uint64_t* bar,
                                            int32_t inner, int32_t outer, int32_t batch) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(smem_addr(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(smem_addr(bar)), "r"(inner), "r"(outer), "r"(batch)
      : "memory");
}

// The same load delivered to the same shared-memory offset of every CTA in `cta_mask`;
// each destination's mbarrier (same offset) receives the transaction bytes.
__device__ __forceinline__ void tma_load_3d_multicast(void* smem_dst, const CUtensorMap* tmap, uint64_t* bar,
                                                      int32_t inner, int32_t outer, int32_t batch,
                                                      uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4, %5}], [%2], %6;" ::"r"(smem_addr(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(smem_addr(bar)), "r"(inner), "r"(outer), "r"(batch),
      "h"(cta_mask)
      : "memory");
}

}  // namespace jax_hopper::hopper

namespace jax_hopper::hopper {

// Ordinary shared-memory stores -> visible to the async proxy (a TMA store that reads
// them next). Each writing thread fences its own stores before the barrier that
// hands the buffer to the thread issuing the store.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// 3-D tile store from shared memory; the hardware clips the parts of the box that lie
// outside the tensor, so partial tiles need no masking. Tracked per issuing thread in
// bulk async-groups.
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* tmap, const void* smem_src, int32_t inner,
                                             int32_t outer, int32_t batch) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(tmap)),
               "r"(smem_addr(smem_src)), "r"(inner), "r"(outer), "r"(batch)
               : "memory");
}

__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Until at most kPending of this thread's bulk groups still read their shared memory
// (the buffer of an older group may then be overwritten).
template <int kPending>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

}  // namespace jax_hopper::hopper
