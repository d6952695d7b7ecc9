// The kernel's view of tile scheduling: which units of work (a tile, or a piece of its K
// range) a CTA takes and in what order, and what becomes of a unit's partial sum.
//  tile_order.cuh    the swizzled order of output tiles (a tile index -> coordinates)
//  work_list.cuh     the static walks: whole tiles in a grid stride (V5: one per CTA),
//                    the stream-K tail, split K's pieces
//  tile_tickets.cuh  the dynamic order: tiles by ticket, in the order clusters finish
//  stream_k.cuh      partial sums handed between CTAs through a global workspace
//  split_k.cuh       split K's sum of a tile's pieces (in a cluster, or the last piece)
#pragma once
#include <cstdint>

#include "gemm/scheduler/split_k.cuh"
#include "gemm/scheduler/stream_k.cuh"
#include "gemm/scheduler/tile_order.cuh"
#include "gemm/scheduler/tile_tickets.cuh"
#include "gemm/scheduler/work_list.cuh"

namespace jax_hopper {

template <class Cfg>
using TileOrderOf = SwizzledTileOrder<Cfg::kRasterSwizzle, Cfg::kClusterM>;

// The walk over this CTA's units of work (all but the dynamic order's).
template <class Cfg>
__device__ auto work_cursor(const WorkList& work, int64_t cluster) {
  if constexpr (Cfg::kSplitK) {
    return SplitKCursor{work, cluster};
  } else {
    return WorkCursor<Cfg::kStreamK>(work, cluster);
  }
}

}  // namespace jax_hopper
