// The dynamic tile order (the default kind and the fused kinds): tiles handed to the
// clusters by a global ticket counter in the order they finish.
#pragma once
#include <cstdint>

#include "gemm/scheduler/tile_order.cuh"
#include "gemm/scheduler/work_list.cuh"
#include "hopper/cluster.cuh"
#include "hopper/mbarrier.cuh"

namespace jax_hopper {

// ---- The dynamic tile order (the default kind, kPersistent) -------------------------
// With the static grid stride, CTAs drift apart (SM active cycles spread 7% at 8192^3),
// so clusters that share an operand stop reading it together: cuBLASLt hands tiles out
// in the order clusters finish instead, which kept its reads merged in L2 and its clock
// up. Here, cluster q starts with tile q; each later
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
