// Which output tile a CTA computes. The seed's swizzled order: tiles are taken in
// groups that cover kRasterSwizzle neighbouring N tiles over all M tiles; inside a
// group, consecutive tiles sweep those N tiles, then step down M. Tiles in flight
// together thus share a few B column panels and stream through A, which keeps both in
// L2. With clusters, a tile index names kClusterM vertically adjacent tiles (one per CTA
// of the cluster, same N column).
#pragma once
#include <cstdint>

namespace jax_hopper {

struct TileCoord {
  int m_block;
  int n_block;
  int batch;
};

template <int kRasterSwizzle, int kClusterM = 1>
struct SwizzledTileOrder {
  int num_m_blocks;
  int num_n_blocks;
  int batch;

  __host__ __device__ int num_m_groups() const { return (num_m_blocks + kClusterM - 1) / kClusterM; }
  __host__ __device__ int64_t tiles_per_batch() const { return int64_t(num_m_groups()) * num_n_blocks; }
  // Cluster tiles: each covers kClusterM M tiles.
  __host__ __device__ int64_t num_tiles() const { return tiles_per_batch() * batch; }

  // Batches are taken one after another; the swizzled order applies within each.
  // `Index`: int64_t, or int32_t where the caller knows the tiles fit (32-bit division
  // is inlined; the 64-bit one is a call, whose return address spills in the producer).
  template <class Index>
  __device__ TileCoord tile(Index index, int cta_rank) const {
    const Index per_batch = static_cast<Index>(tiles_per_batch());
    const int b = static_cast<int>(index / per_batch);
    const int linear = static_cast<int>(index - b * per_batch);
    const int num_m = num_m_groups();
    const int group_size = num_m * kRasterSwizzle;
    const int group = linear / group_size;
    const int first_n = group * kRasterSwizzle;
    const int remaining_n = num_n_blocks - first_n;
    const int width = remaining_n < kRasterSwizzle ? remaining_n : kRasterSwizzle;
    const int t = linear - group * group_size;
    return {(t / width) * kClusterM + cta_rank, first_n + t % width, b};
  }
};

}  // namespace jax_hopper
