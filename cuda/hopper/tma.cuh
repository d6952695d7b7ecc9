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
