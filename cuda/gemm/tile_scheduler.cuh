// Which output tile a CTA computes. The seed's swizzled order: CTAs are taken in groups
// that cover kRasterSwizzle neighbouring N tiles over all M tiles; inside a group,
// consecutive CTAs sweep those N tiles, then step down M. CTAs resident together thus
// share a few B column panels and stream through A, which keeps both in L2.
#pragma once

namespace jax_hopper {

struct TileCoord {
  int m_block;
  int n_block;
};

template <int kRasterSwizzle>
struct SwizzledTileScheduler {
  int num_m_blocks;
  int num_n_blocks;

  __host__ __device__ int num_tiles() const { return num_m_blocks * num_n_blocks; }

  __device__ TileCoord tile(int linear) const {
    const int group_size = num_m_blocks * kRasterSwizzle;
    const int group = linear / group_size;
    const int first_n = group * kRasterSwizzle;
    const int remaining_n = num_n_blocks - first_n;
    const int width = remaining_n < kRasterSwizzle ? remaining_n : kRasterSwizzle;
    const int t = linear - group * group_size;
    return {t / width, first_n + t % width};
  }
};

}  // namespace jax_hopper
