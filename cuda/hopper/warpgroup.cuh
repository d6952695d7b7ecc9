// Thread-role helpers: warpgroups are 4 consecutive warps (128 threads), the unit that
// issues wgmma and the granularity of the kernel's producer/consumer split.
#pragma once

namespace jax_hopper::hopper {

constexpr int kWarpSize = 32;
constexpr int kWarpgroupSize = 128;

__device__ __forceinline__ int warpgroup_index() { return threadIdx.x / kWarpgroupSize; }
__device__ __forceinline__ int thread_in_warpgroup() { return threadIdx.x % kWarpgroupSize; }
__device__ __forceinline__ int lane_index() { return threadIdx.x % kWarpSize; }

}  // namespace jax_hopper::hopper
