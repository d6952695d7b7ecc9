// Host-side TMA descriptor encoding through the runtime's driver entry point, so the
// library never links libcuda itself.
#pragma once
#include <cuda.h>

#include <cstdint>

#include "gemm/gemm.h"

namespace jax_hopper::hopper {

// A batch of 2-D matrices: the box covers one matrix of the batch at a time.
struct TensorMap3d {
  const void* base;
  uint64_t inner, outer, batch;  // extents in elements (innermost is contiguous)
  uint64_t row_stride;           // elements between consecutive outer indices
  uint64_t batch_stride;         // elements between consecutive matrices
  uint32_t box_inner, box_outer;
  uint32_t element_bytes = 2;  // 2 (f16/bf16 operands and outputs) or 4 (f32 outputs)
};

// 128-byte swizzle; loads zero-fill out of bounds, stores clip there.
Status encode_tensor_map_3d(CUtensorMap* map, const TensorMap3d& desc);

}  // namespace jax_hopper::hopper
