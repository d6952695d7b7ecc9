// Host-side TMA descriptor encoding through the runtime's driver entry point, so the
// library never links libcuda itself.
#pragma once
#include <cuda.h>

#include <cstdint>

#include "gemm/gemm.h"

namespace jax_hopper::hopper {

struct TensorMap2d {
  const void* base;
  uint64_t inner, outer;    // extents in elements (innermost is contiguous)
  uint64_t row_stride;      // elements between consecutive outer indices
  uint32_t box_inner, box_outer;
};

// 16-bit elements, 128-byte swizzle, zero fill out of bounds.
Status encode_tensor_map_2d(CUtensorMap* map, const TensorMap2d& desc);

}  // namespace jax_hopper::hopper
