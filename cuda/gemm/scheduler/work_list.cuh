// The static work of a CTA: whole tiles in a grid stride over the clusters, with
// optionally the last, partial wave split along K (stream-K), or one piece of a tile's K
// range per CTA (split K).
#pragma once
#include <cstdint>

namespace jax_hopper {


// One piece of a cluster's work: K tiles [k_begin, k_end) of cluster tile `tile` (an
// index into SwizzledTileOrder's order).
enum class UnitRole {
  kWhole,        // the whole K range: compute, store
  kFinisher,     // K from 0, not to the end: add the contributors' partial sums, store
  kContributor,  // K from the middle: publish the partial sum for the finisher
};
struct WorkUnit {
  int64_t tile;
  int k_begin, k_end;
  UnitRole role;
  int piece = 0;  // split K: which of the tile's pieces
};

// The persistent walk over cluster tiles, optionally with a stream-K tail. Cluster q
// takes tiles q, q + C, ... of the full waves (C clusters). With kSplitTail, the tiles
// of the last, partial wave are not handed out one per cluster (most clusters would
// idle) but as their R * k_tiles K iterations, split evenly into `ranges` ranges (at
// most C, and at most max_splits per tail tile, so a finisher never sums more
// than a few partials); cluster q takes range C - 1 - q if there is one. A tail tile is then finished by the cluster
// whose range holds its k = 0 (a finisher's segment is the last of its range); clusters
// whose range starts inside it contribute (a contributor's segment is the first of its
// range, so contributors never wait and the waits form no chains). Contributors hold
// later ranges, hence lower cluster indices: CTAs the hardware launched no later than
// the finisher, so a finisher never spins on a CTA still waiting for an SM.
// Deterministic: the split depends only on the shape and C.
// Split K: the most pieces of a tile that form one cluster (a portable cluster size).
constexpr int kMaxClusterPieces = 8;

struct WorkList {
  int64_t num_tiles;
  int64_t clusters;
  int k_tiles;
  bool split_tail;     // the host found the workspace for the partial sums
  int64_t max_splits;  // pieces per tail tile at most (the kind's kMaxSplitsPerTile)
  int pieces = 1;      // split K: pieces per tile (SplitKCursor)
  // Split K: a tile's pieces are one cluster (of at most kMaxClusterPieces), summed
  // through distributed shared memory (SplitKReduce), rather than separate CTAs meeting
  // in a global workspace.
  bool cluster_pieces = false;
  // Rows of A's TMA box, which each stage loads (GemmConfig::a_box_rows): the tile's,
  // or in the small-M kind only those up to M.
  int a_box_rows = 0;

  // Split K: the CTA (and, in a workspace, partial-sum slot) of a tile's piece. In
  // clusters, a tile's pieces are neighbours (cluster rank = piece); otherwise the pieces
  // follow one another, each a pass over all tiles.
  __host__ __device__ int64_t split_unit(int64_t tile, int piece) const {
    return cluster_pieces ? tile * pieces + piece : piece * num_tiles + tile;
  }

  __host__ __device__ int64_t whole_tiles() const {
    return split_tail ? num_tiles / clusters * clusters : num_tiles;
  }
  __host__ __device__ int64_t tail_iterations() const { return (num_tiles - whole_tiles()) * k_tiles; }
  __host__ __device__ int64_t ranges() const {
    const int64_t cap = (num_tiles - whole_tiles()) * max_splits;
    return cap < clusters ? cap : clusters;
  }
  // First tail iteration of range r (it ends where range r + 1 begins; ranges past the
  // last are empty), and its cluster.
  __host__ __device__ int64_t tail_begin(int64_t r) const {
    const int64_t n = ranges();
    return r >= n ? tail_iterations() : r * tail_iterations() / n;
  }
  __device__ int64_t range_of(int64_t cluster) const { return clusters - 1 - cluster; }
  __device__ int64_t cluster_of(int64_t range) const { return clusters - 1 - range; }

  // Contributors to the tail tile finished by range r hold ranges r + 1, r + 2, ... while
  // these begin before the tile's end; empty ranges (more clusters than tail
  // iterations) contribute nothing.
  __device__ int64_t tail_tile_end(int64_t tile) const { return (tile - whole_tiles() + 1) * k_tiles; }
  __device__ bool has_tail_work(int64_t r) const { return tail_begin(r + 1) > tail_begin(r); }
};

// Cluster q's units in order: for (WorkUnit u; cursor.next(u);) { ... }. kSplitTail is
// the kernel kind's (compile-time), work.split_tail the launch's.
template <bool kSplitTail>
struct WorkCursor {
  const WorkList work;
  int64_t next_tile, whole, i, end;

  __device__ WorkCursor(const WorkList& w, int64_t q)
      : work(w), next_tile(q), whole(kSplitTail ? w.whole_tiles() : w.num_tiles), i(0), end(0) {
    if constexpr (kSplitTail) {
      i = w.tail_begin(w.range_of(q));
      end = w.tail_begin(w.range_of(q) + 1);
    }
  }

  __device__ bool next(WorkUnit& unit) {
    if (next_tile < whole) {
      unit = WorkUnit{next_tile, 0, work.k_tiles, UnitRole::kWhole};
      next_tile += work.clusters;
      return true;
    }
    if constexpr (kSplitTail) {
      if (i < end) {
        const int64_t j = i / work.k_tiles;
        const int k_begin = static_cast<int>(i - j * work.k_tiles);
        const int64_t room = end - i;
        const int k_end = room < work.k_tiles - k_begin ? static_cast<int>(k_begin + room) : work.k_tiles;
        const UnitRole role =
            k_begin > 0 ? UnitRole::kContributor : (k_end < work.k_tiles ? UnitRole::kFinisher : UnitRole::kWhole);
        unit = WorkUnit{whole + j, k_begin, k_end, role};
        i += k_end - k_begin;
        return true;
      }
    }
    return false;
  }
};

// Split K (the small-M kind): one CTA per unit (WorkList::split_unit), each piece an
// equal share of the tile's K tiles. With more than one piece every unit contributes
// (SplitKReduce sums the tile).
struct SplitKCursor {
  const WorkList work;
  int64_t unit;
  bool taken = false;

  __device__ bool next(WorkUnit& u) {
    if (taken) return false;
    taken = true;
    const int64_t tile = work.cluster_pieces ? unit / work.pieces : unit % work.num_tiles;
    const int piece = static_cast<int>(work.cluster_pieces ? unit % work.pieces : unit / work.num_tiles);
    const int k_begin = static_cast<int>(piece * int64_t{work.k_tiles} / work.pieces);
    const int k_end = static_cast<int>((piece + 1) * int64_t{work.k_tiles} / work.pieces);
    u = WorkUnit{tile, k_begin, k_end, work.pieces > 1 ? UnitRole::kContributor : UnitRole::kWhole, piece};
    return true;
  }
};

}  // namespace jax_hopper
