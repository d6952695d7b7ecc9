// Which output tile a CTA computes. The seed's swizzled order: tiles are taken in
// groups that cover kRasterSwizzle neighbouring N tiles over all M tiles; inside a
// group, consecutive tiles sweep those N tiles, then step down M. Tiles in flight
// together thus share a few B column panels and stream through A, which keeps both in
// L2. With clusters, a tile index names kClusterM vertically adjacent tiles (one per CTA
// of the cluster, same N column).
#pragma once
#include <cstdint>

#include "hopper/cluster.cuh"
#include "hopper/mbarrier.cuh"

namespace jax_hopper {

struct TileCoord {
  int m_block;
  int n_block;
  int batch;
};

template <int kRasterSwizzle, int kClusterM = 1>
struct SwizzledTileScheduler {
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

namespace jax_hopper {

// One piece of a cluster's work: K tiles [k_begin, k_end) of cluster tile `tile` (an
// index into SwizzledTileScheduler's order).
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

// ---- The dynamic tile order (the default kind, kPersistent) -------------------------
// With the static grid stride, CTAs drift apart (SM active cycles spread 7% at 8192^3),
// so clusters that share an operand stop reading it together: cuBLASLt hands tiles out
// in the order clusters finish instead, which kept its reads merged in L2 and its clock
// up (BENCHMARKS.md, 2026-11-30 18:37). Here, cluster q starts with tile q; each later
// tile is C + a ticket from a global counter (zeroed by the host per call), which the
// cluster's rank-0 producer takes one tile ahead, so the atomic's round trip hides
// under a tile's loads. It hands each tile to rank 1's producer through a one-slot
// mailbox in rank 1's shared memory (st.async, no fence), and each producer writes the
// tile into the stage that holds its first K tile, where the consumers read it after
// the wait they do anyway (a fresh stage after the last tile carries kNoTile). So no
// consumer pays a fence or an extra barrier per tile.
constexpr int32_t kNoTile = -1;

template <int kStages>
struct TicketStorage {
  // The tile whose first K tile the stage holds, decoded for this CTA by its producer
  // (m_block, n_block, batch; m_block kNoTile after the last), so the consumers' path
  // between tiles has no division in it.
  int4 stage_tile[kStages];
  int32_t mailbox;              // rank 1: the cluster's next tile
  uint64_t mailbox_full;        // rank 1's: its own arrival + the 4 bytes rank 0 stores
  uint64_t mailbox_empty;       // rank 0's: rank 1 has read it
};

// Producer side: the cluster's tiles in order, the same on both ranks; kNoTile at the end.
template <int kStages, int kClusterSize>
struct TileTickets {
  TicketStorage<kStages>& slots;
  uint32_t* counter;
  int64_t num_tiles, clusters;
  int cta_rank;
  int64_t next_tile;     // the cluster's first tile; then (rank 0) the one after the current one
  uint32_t handovers = 0;

  __device__ TileTickets(TicketStorage<kStages>& s, uint32_t* c, int64_t tiles, int64_t cl, int64_t cluster,
                         int rank)
      : slots(s), counter(c), num_tiles(tiles), clusters(cl), cta_rank(rank), next_tile(cluster) {}

  // Barrier init (one thread, before the cluster sync that publishes it).
  __device__ static void init(TicketStorage<kStages>& s) {
    hopper::mbarrier_init(&s.mailbox_full, 1);
    hopper::mbarrier_init(&s.mailbox_empty, 1);
  }

  // The cluster's first tile, its own index (the host launched no more clusters than
  // tiles), known to both ranks without a handover, so no producer waits at the start.
  __device__ int32_t first() {
    const int32_t tile = static_cast<int32_t>(next_tile);
    if (cta_rank == 0) take_ticket();
    return tile;
  }

  // Each later tile (kNoTile at the end): rank 0's ticket, handed to rank 1.
  __device__ int32_t next() {
    int32_t tile;
    if (cta_rank == 0) {
      tile = next_tile < num_tiles ? static_cast<int32_t>(next_tile) : kNoTile;
      if (tile != kNoTile) take_ticket();
      if constexpr (kClusterSize > 1) {
        static_assert(kClusterSize == 2, "one mailbox: rank 0 feeds rank 1");
        // Producer-start parity: the first wait passes on the fresh barrier.
        hopper::mbarrier_wait(&slots.mailbox_empty, (handovers & 1) ^ 1);
        hopper::store_async_cluster_u32(&slots.mailbox, 1, static_cast<uint32_t>(tile), &slots.mailbox_full);
      }
    } else {
      hopper::mbarrier_arrive_expect_tx(&slots.mailbox_full, sizeof(int32_t));
      hopper::mbarrier_wait_cluster(&slots.mailbox_full, handovers & 1);
      tile = hopper::load_shared_s32(&slots.mailbox);
      // Read: rank 0 may refill it (a plain remote arrival after an ordinary shared
      // load, as CUTLASS's pipelines release a consumed slot).
      hopper::mbarrier_arrive_cluster(&slots.mailbox_empty, 0);
    }
    ++handovers;
    return tile;
  }

 private:
  // The ticket for the tile after the current one; its value is first used a tile later.
  // With no more tiles than clusters there are no tickets (and no counter).
  __device__ void take_ticket() {
    next_tile = num_tiles > clusters ? clusters + atomicAdd(counter, 1u) : num_tiles;
  }
};

// Producer side: writes `tile` (this CTA's coordinates) into stage `index`'s slot as 16
// transaction bytes completing on the stage's full barrier (st.async to this CTA), so the
// consumers read it after their wait exactly as they read the stage's TMA data, and the
// next overwrite is ordered after their release the same way. Returns the bytes to expect.
template <int kStages>
__device__ uint32_t mark_stage(TicketStorage<kStages>& slots, int index, TileCoord tile, uint32_t own_rank,
                               uint64_t* full_barrier) {
  const int4 mark = make_int4(tile.m_block, tile.n_block, tile.batch, 0);
  hopper::store_async_cluster_v4(&slots.stage_tile[index], own_rank, mark, full_barrier);
  return sizeof(int4);
}

// Consumer side: waits for the stage of the next tile's first K tile (the mainloop's
// own wait on it then passes at once) and reads the tile the producer left there.
template <class Pipe, class State>
struct StageTileCursor {
  const Pipe& pipe;
  const int4* stage_tile;
  const State& read;  // the consumer's ring cursor, advanced by the mainloop
  int k_tiles;
  TileCoord coord;  // the tile of the last unit next() returned

  __device__ bool next(WorkUnit& unit) {
    pipe.consumer_wait(read);
    // A shared-window load (not a generic one), reduced over the warp (all lanes hold
    // the same values): redux.sync's result is a uniform register, so the loop exit is
    // provably warp-uniform and the ring cursor, hence the wgmma descriptors, stay in
    // uniform registers. (A shfl from lane 0 was not enough: ptxas moved the descriptors
    // to vector registers, and the consumers spilled.)
    const int4 mark = hopper::load_shared_v4(&stage_tile[read.index]);
    const int32_t m_block = __reduce_max_sync(0xffffffffu, mark.x);
    if (m_block == kNoTile) return false;
    coord = TileCoord{m_block, __reduce_max_sync(0xffffffffu, mark.y), __reduce_max_sync(0xffffffffu, mark.z)};
    unit = WorkUnit{0, 0, k_tiles, UnitRole::kWhole};
    return true;
  }
};

}  // namespace jax_hopper
