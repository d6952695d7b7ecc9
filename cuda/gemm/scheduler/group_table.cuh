// The grouped kinds' schedule (ragged_dot). The group sizes are a device array whose
// values the host never sees, so every CTA reads them at its start into a table in
// shared memory: where each group's rows begin and, for ragged rows, where its tiles
// begin in the walk. A tile index then names a group and a tile of it (a binary search
// over the table), in the seed's swizzled order inside the group.
//
// Ragged rows (kGrouped): group g owns rows [row_begin[g], row_begin[g + 1]) of A and C
// and multiplies them by B's batch entry g; its cluster tiles are ceil(rows / BM / 2)
// (2-CTA clusters along M, sharing g's B tile) times the N tiles, so an empty group costs
// nothing. A tile reaching past the group's last row computes rows of the next group
// (or TMA's zeros past M) but stores only its own.
// Ragged contraction (kGroupedK): C's batch entry g is the sum over g's rows r of
// A[r, :]^T B[r, :]; every group has the same output tiles (A's columns by B's), over
// K tiles that start at the group's first row (TMA boxes may start anywhere) and end with
// a partial one whose rows past the group the consumers zero (grouped_kernel.cuh).
// Sizes are clamped so that groups never reach past A's rows: a negative size counts as
// 0, and rows past the sizes' sum are no group's (ragged rows: zeros in C).
#pragma once
#include <cstdint>

#include "gemm/scheduler/tile_order.cuh"

namespace jax_hopper {

// Groups a launch takes (the table's shared memory: 8 KB).
constexpr int kMaxGroups = 1024;

struct GroupTableStorage {
  int32_t row_begin[kMaxGroups + 1];   // row_begin[G]: the rows the groups cover
  int32_t tile_begin[kMaxGroups + 1];  // ragged rows: tile_begin[G] tiles in all
};

// The launch's grouped work (host-filled).
struct GroupedWork {
  const int32_t* group_sizes;  // [groups], on the device
  int groups;
  int rows;      // A's rows (ragged rows: C's too; ragged contraction: the rows summed over)
  int c_rows;    // rows of C (of each batch entry)
  int k_tiles;   // ragged rows: K tiles of every tile
  int m_blocks;  // ragged contraction: C's row tiles per group
  int n_blocks;
  int clusters;  // launched
  // Ragged rows, batched (vmap of a shared rhs): 0, or every `period` groups form one
  // batch entry whose last group is a gap (rows that are zeros); group g multiplies B's
  // entry g % period. 0: group g multiplies entry g.
  int period;
};

// One tile of the walk, as the producer and the consumers both derive it.
struct GroupTile {
  int group;
  int b_entry;  // ragged rows: B's entry for the group
  int row0;     // C's first row (ragged rows: a row of A and C; contraction: of C's entry)
  int row_end;  // rows from here on are not this tile's to store
  int n0;       // first column
  int k0;       // first K element (contraction: the group's first row)
  int k_tiles;  // contraction: 0 for an empty group (C's tile is zeros)
  int last_k_rows;  // contraction: rows of the last K tile inside the group
};

template <int kBlockM, int kBlockN, int kBlockK, int kClusterM, int kRasterSwizzle, bool kRaggedK>
struct GroupTable {
  const GroupTableStorage& t;
  const GroupedWork& work;

  // Run by the CTA's first warp; the kernel's start-up barrier publishes the table.
  // Sums in 64 bits (sizes may sum past int32; the clamp to A's rows brings them back).
  __device__ static void build(GroupTableStorage& t, const GroupedWork& work) {
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    int64_t rows_before = 0, tiles_before = 0;
    if (lane == 0) t.row_begin[0] = t.tile_begin[0] = 0;
    for (int base = 0; base < work.groups; base += 32) {
      const int g = base + lane;
      const int64_t size = g < work.groups ? max(work.group_sizes[g], 0) : 0;
      int64_t rows = size;  // inclusive scan of the sizes
#pragma unroll
      for (int offset = 1; offset < 32; offset *= 2) {
        const int64_t v = __shfl_up_sync(0xffffffffu, rows, offset);
        if (lane >= offset) rows += v;
      }
      rows += rows_before;
      const int64_t end = min(rows, int64_t{work.rows});
      const int64_t begin = min(rows - size, int64_t{work.rows});
      const int64_t m_tiles = (end - begin + kBlockM - 1) / kBlockM;
      int64_t tiles = kRaggedK ? 0 : (m_tiles + kClusterM - 1) / kClusterM * work.n_blocks;
#pragma unroll
      for (int offset = 1; offset < 32; offset *= 2) {
        const int64_t v = __shfl_up_sync(0xffffffffu, tiles, offset);
        if (lane >= offset) tiles += v;
      }
      tiles += tiles_before;
      if (g < work.groups) {
        t.row_begin[g + 1] = static_cast<int32_t>(end);
        t.tile_begin[g + 1] = static_cast<int32_t>(tiles);  // the host bounds the total below 2^31
      }
      rows_before = __shfl_sync(0xffffffffu, rows, 31);
      tiles_before = __shfl_sync(0xffffffffu, tiles, 31);
    }
  }

  __device__ int tiles_per_group() const { return (work.m_blocks + kClusterM - 1) / kClusterM * work.n_blocks; }
  __device__ int num_tiles() const { return kRaggedK ? work.groups * tiles_per_group() : t.tile_begin[work.groups]; }
  __device__ int rows_covered() const { return t.row_begin[work.groups]; }

  // Tile `index` (< num_tiles()) as CTA `cta_rank` of its cluster sees it.
  __device__ GroupTile tile(int index, int cta_rank) const {
    GroupTile tile;
    int local;
    if constexpr (kRaggedK) {
      const int per_group = tiles_per_group();
      tile.group = index / per_group;
      local = index - tile.group * per_group;
    } else {  // the group whose tiles hold `index`: tile_begin[g] <= index < tile_begin[g + 1]
      int lo = 0, hi = work.groups;
      while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (t.tile_begin[mid] <= index) lo = mid; else hi = mid;
      }
      tile.group = lo;
      local = index - t.tile_begin[lo];
    }
    const int begin = t.row_begin[tile.group], end = t.row_begin[tile.group + 1];
    const int m_blocks = kRaggedK ? work.m_blocks : (end - begin + kBlockM - 1) / kBlockM;
    const SwizzledTileOrder<kRasterSwizzle, kClusterM> order{m_blocks, work.n_blocks, 1};
    const TileCoord c = order.tile(local, cta_rank);
    tile.n0 = c.n_block * kBlockN;
    if constexpr (kRaggedK) {
      tile.row0 = c.m_block * kBlockM;
      tile.b_entry = 0;
      tile.row_end = work.c_rows;
      tile.k0 = begin;
      tile.k_tiles = (end - begin + kBlockK - 1) / kBlockK;
      tile.last_k_rows = end - begin - (tile.k_tiles - 1) * kBlockK;
    } else {
      tile.b_entry = work.period > 0 ? tile.group % work.period : tile.group;
      const bool gap = work.period > 0 && tile.b_entry == work.period - 1;
      tile.row0 = begin + c.m_block * kBlockM;
      tile.row_end = end;
      tile.k0 = 0;
      tile.k_tiles = gap ? 0 : work.k_tiles;  // a gap's tile is zeros, loaded from nothing
      tile.last_k_rows = kBlockK;
    }
    return tile;
  }
};

}  // namespace jax_hopper
