// The tile schedulers: which units of work (a tile, or a piece of its K range) a CTA
// takes and in what order, and what becomes of a unit's partial sum. One type per family
// of kinds; TileScheduler<Cfg> picks it:
//  StaticScheduler   whole tiles in a grid stride over the clusters (V5: one tile per
//                    CTA); with kStreamK the last, partial wave split along K and the
//                    partial sums handed to each tile's finisher (stream_k.cuh); with
//                    kPingpong the consumer warpgroups take the CTA's tiles in turn
//  DynamicScheduler  whole tiles by ticket, in the order clusters finish (tile_tickets.cuh)
//  SplitKScheduler   one piece of a tile's K range per CTA, the pieces summed (split_k.cuh)
// The parts: tile_order.cuh (tile index -> coordinates), work_list.cuh (the static
// walks), tile_tickets.cuh (the dynamic order), stream_k.cuh, split_k.cuh (partial sums).
//
// The producer thread walks the units (kTicketed: tile indices from a Producer,
// first() .. kNoTile, each tile's first stage marked with a StageMark; otherwise the
// WorkUnits of producer()), loads each tile(), then end() closes the work, taking
// kEndStages stages; the whole producer warp then calls producer_done(). Each consumer
// warpgroup walks its Consumer (consumer_units):
//   for (WorkUnit unit; units.next(unit);) { tile = units.tile(scheduler, unit); ...
//     units.hand_over() once the unit's MMAs are issued (or its stages passed);
//     units.skipped() for a unit with no rows inside M;
//     if kPartialSums, units.finish_unit(acc, unit, tile, row0, col0): whether this
//     warpgroup stores the tile }
//   units.finish();
// Each object is built where it is used, from the kernel's parameters (tools/
// sass_check.py: built through another object's fields, they changed the machine code).
#pragma once
#include <cstdint>
#include <type_traits>

#include "gemm/config.cuh"
#include "gemm/epilogue/output.cuh"
#include "gemm/mainloop.cuh"
#include "gemm/scheduler/split_k.cuh"
#include "gemm/scheduler/stream_k.cuh"
#include "gemm/scheduler/tile_order.cuh"
#include "gemm/scheduler/tile_tickets.cuh"
#include "gemm/scheduler/work_list.cuh"
#include "gemm/shared_storage.cuh"
#include "gemm/timeline.cuh"
#include "hopper/mbarrier.cuh"
#include "hopper/warpgroup.cuh"

namespace jax_hopper {

template <class Cfg>
using TileOrderOf = SwizzledTileOrder<Cfg::kRasterSwizzle, Cfg::kClusterM>;

// What every scheduler reads: the kernel's parameters and this CTA's place.
template <class Cfg>
struct SchedulerBase {
  using Storage = SharedStorage<Cfg>;
  using Pipe = typename Mainloop<Cfg>::Pipe;
  using State = typename Mainloop<Cfg>::State;

  const WorkList& work;
  const TileOrderOf<Cfg>& order;
  const StreamKParams& partials;  // stream-K's and split K's workspace
  uint32_t* tile_counter;         // the dynamic order's tickets
  const OutputParams& out;
  Storage& smem;
  int64_t cluster;  // V5: one tile per CTA, one unit
  int cta_rank;

  __device__ static void init(Storage&) {}
  // Whether a unit's partial sum may be finished by another CTA (Consumer::finish_unit).
  static constexpr bool kPartialSums = false;

  static constexpr bool kTicketed = false;  // the producer's units: WorkUnits from a cursor
  __device__ TileCoord tile(const WorkUnit& unit) const { return order.tile(unit.tile, cta_rank); }

  // Nothing marks the end of the work.
  static constexpr int kEndStages = 0;
  __device__ void end(const Pipe&, State&) const {}
  __device__ void producer_done() const {}

  // Consumers of whole tiles: nothing to hand over or sum (no finish_unit: kPartialSums
  // is false).
  struct WholeTiles {
    __device__ void hand_over() const {}
    __device__ void skipped() const {}
    __device__ void finish() const {}
  };
};

// ---- Grid stride, optionally with a stream-K tail or ping-pong consumers --------------
template <class Cfg>
struct StaticScheduler : SchedulerBase<Cfg> {
  using Base = SchedulerBase<Cfg>;
  using typename Base::Pipe;
  using typename Base::State;
  using typename Base::Storage;
  using Cursor = WorkCursor<Cfg::kStreamK>;
  static constexpr bool kPartialSums = Cfg::kStreamK;

  // Ping-pong: turn[w] completes a phase each time the other warpgroup has waited for all
  // of its tile's stages (shared_storage.cuh: TurnStorage).
  __device__ static void init(Storage& smem) {
    if constexpr (Cfg::kPingpong)
      for (int w = 0; w < Cfg::kConsumerWarpgroups; ++w)
        hopper::mbarrier_init(&smem.turns.turn[w], hopper::kWarpgroupSize);
  }

  // The producer's walk: the same units as the consumers'.
  __device__ static Cursor producer(const WorkList& work, int64_t cluster) { return Cursor(work, cluster); }

  // What the consumers keep beyond the cursor: stream-K's place; ping-pong's turns too.
  struct Place {
    const StaticScheduler& s;
    int warpgroup;
    __device__ Place(const StaticScheduler& sched, State&, int wg) : s(sched), warpgroup(wg) {}
  };
  struct Turns {
    const StaticScheduler& s;
    int warpgroup;
    State& read;
    int64_t unit_index = 0;  // this CTA's units so far (whose turn it is)
    int64_t own_units = 0;   // this warpgroup's units so far
    __device__ Turns(const StaticScheduler& sched, State& r, int wg) : s(sched), warpgroup(wg), read(r) {}
  };
  struct Nothing {
    __device__ Nothing(const StaticScheduler&, State&, int) {}
  };
  using ConsumerExtras =
      std::conditional_t<Cfg::kPingpong, Turns, std::conditional_t<Cfg::kStreamK, Place, Nothing>>;

  struct Consumer : Base::WholeTiles, ConsumerExtras {
    Cursor cursor;

    __device__ Consumer(const StaticScheduler& sched, Storage&, const WorkList& work, int64_t cluster, const Pipe&,
                        State& read, int wg)
        : ConsumerExtras(sched, read, wg), cursor(work, cluster) {}

    // Ping-pong: this warpgroup's units only, each once the other warpgroup's mainloop
    // before it has waited for all its stages.
    __device__ bool next(WorkUnit& unit) {
      if constexpr (!Cfg::kPingpong) {
        return cursor.next(unit);
      } else {
        static_assert(Cfg::kConsumerWarpgroups == 2, "ping-pong alternates two warpgroups");
        for (; cursor.next(unit); ++this->unit_index) {
          if (this->unit_index % Cfg::kConsumerWarpgroups != this->warpgroup) {
            Mainloop<Cfg>::skip(unit.k_end - unit.k_begin, this->read);
            continue;
          }
          // Unit u waits until the mainloop of unit u - 1 (the other warpgroup's) has
          // waited for all its stages: the c-th hand-over to this warpgroup (c = 1, 2,
          // ...) completes phase c - 1, whose parity the wait names.
          const int64_t handovers_needed = this->warpgroup == 0 ? this->own_units : this->own_units + 1;
          if (handovers_needed > 0)
            hopper::mbarrier_wait(&this->s.smem.turns.turn[this->warpgroup],
                                  static_cast<uint32_t>((handovers_needed - 1) & 1));
          ++this->own_units;
          ++this->unit_index;
          return true;
        }
        return false;
      }
    }

    __device__ TileCoord tile(const StaticScheduler& s, const WorkUnit& unit) const { return s.tile(unit); }

    // Ping-pong: the other warpgroup may start its next mainloop. Every thread arrives
    // (not one elected): a phase then also proves that each of this warpgroup's warps
    // passed its own turn wait, so no warp can fall two phases behind (K <= 64 or a unit
    // past M has no wgmma to keep the warps together).
    __device__ void hand_over() const {
      if constexpr (Cfg::kPingpong) hopper::mbarrier_arrive(&this->s.smem.turns.turn[1 - this->warpgroup]);
    }

    // Stream-K: a contributor publishes its partial sum and stores nothing; a finisher
    // adds its contributors' partial sums first. A finisher and its contributors share a
    // tile, CTA rank and warpgroup, so they skip a unit past M together.
    template <class Acc>
    __device__ bool finish_unit(Acc& acc, const WorkUnit& unit, const TileCoord&, int row0, int) const {
      static_assert(Cfg::kStreamK, "whole tiles have no partial sums");
      using Fixup = StreamKFixup<Cfg>;
      const StaticScheduler& s = this->s;
      const WorkList& work = s.work;
      if (unit.role == UnitRole::kContributor) {
        Fixup::publish(acc, s.partials, s.cluster, s.cta_rank, this->warpgroup, s.out.m - row0);
        return false;
      }
      if (unit.role == UnitRole::kFinisher) {
        const int64_t tile_end = work.tail_tile_end(unit.tile);
        for (int64_t r = work.range_of(s.cluster) + 1; r < work.ranges() && work.tail_begin(r) < tile_end; ++r)
          if (work.has_tail_work(r))
            Fixup::accumulate(acc, s.partials, work.cluster_of(r), s.cta_rank, this->warpgroup, s.out.m - row0);
      }
      return true;
    }
  };
};

// ---- The dynamic order: tiles by ticket (tile_tickets.cuh) ---------------------------
template <class Cfg>
struct DynamicScheduler : SchedulerBase<Cfg> {
  using Base = SchedulerBase<Cfg>;
  using typename Base::Pipe;
  using typename Base::State;
  using typename Base::Storage;
  using Tickets = TileTickets<Cfg::kStages, Cfg::kClusterM>;

  __device__ static void init(Storage& smem) { Tickets::init(smem.scheduler.tickets); }

  // The producer's tiles, the same on both ranks: rank 0 takes a ticket per tile and
  // hands it to rank 1. A unit is its tile index (kNoTile after the last).
  static constexpr bool kTicketed = true;
  struct Producer : Tickets {
    __device__ Producer(Storage& smem, uint32_t* counter, const WorkList& work, int64_t cluster, int cta_rank)
        : Tickets(smem.scheduler.tickets, counter, work.num_tiles, work.clusters, cluster, cta_rank) {}
  };
  // Tiles fit in int32 (host-checked): 32-bit division.
  __device__ TileCoord tile(int32_t t) const { return this->order.tile(t, this->cta_rank); }

  // Each tile's first stage carries the tile, for the consumers (tile_tickets.cuh).
  struct StageMark {
    TicketStorage<Cfg::kStages>& slots;
    TileCoord tile;
    int cta_rank;
    __device__ StageMark(const DynamicScheduler& s, const TileCoord& t)
        : slots(s.smem.scheduler.tickets), tile(t), cta_rank(s.cta_rank) {}
    __device__ uint32_t operator()(int index, uint64_t* bar) const {
      return mark_stage(slots, index, tile, static_cast<uint32_t>(cta_rank), bar);
    }
  };

  // The end mark: a fresh stage with no loads, only the mark.
  static constexpr int kEndStages = 1;
  __device__ void end(const Pipe& pipe, State& st) const {
    auto& slots = this->smem.scheduler.tickets;
    pipe.producer_acquire(st);
    uint64_t* bar = pipe.producer_barrier(st);
    const TileCoord end{kNoTile, 0, 0};
    pipe.producer_expect(st, mark_stage(slots, st.index, end, static_cast<uint32_t>(this->cta_rank), bar));
    st.advance();
  }

  // The consumers read each tile from its first stage.
  struct Consumer : Base::WholeTiles {
    StageTileCursor<Pipe, State> cursor;
    __device__ Consumer(const DynamicScheduler&, Storage& smem, const WorkList& work, int64_t, const Pipe& pipe,
                        State& read, int)
        : cursor{pipe, smem.scheduler.tickets.stage_tile, read, work.k_tiles} {}
    __device__ bool next(WorkUnit& unit) { return cursor.next(unit); }
    // Decoded by the producer.
    __device__ TileCoord tile(const DynamicScheduler&, const WorkUnit&) const { return cursor.coord; }
  };
};

// ---- Split K: one piece of a tile's K range per CTA (split_k.cuh) ----------------------
template <class Cfg>
struct SplitKScheduler : SchedulerBase<Cfg> {
  using Base = SchedulerBase<Cfg>;
  using typename Base::Pipe;
  using typename Base::State;
  using typename Base::Storage;
  using Reduce = SplitKReduce<Cfg>;
  static constexpr bool kPartialSums = true;

  __device__ static SplitKCursor producer(const WorkList& work, int64_t cluster) {
    return SplitKCursor{work, cluster};
  }

  // The producer warp passes the in-cluster sum's barriers with the consumers.
  __device__ void producer_done() const {  // the warp converged (kernel.cuh), as the .aligned barriers need
    Reduce::hold_for_peers(this->work);
  }

  struct Consumer {
    const SplitKScheduler& s;
    int warpgroup;
    SplitKCursor cursor;
    bool summed = false;  // this CTA's piece went through SplitKReduce

    __device__ Consumer(const SplitKScheduler& sched, Storage&, const WorkList& work, int64_t cluster, const Pipe&,
                        State&, int wg)
        : s(sched), warpgroup(wg), cursor{work, cluster} {}
    __device__ bool next(WorkUnit& unit) { return cursor.next(unit); }
    __device__ TileCoord tile(const SplitKScheduler& sched, const WorkUnit& unit) const { return sched.tile(unit); }
    __device__ void hand_over() const {}
    // A piece past M still passes its cluster's barriers.
    __device__ void skipped() const { Reduce::hold_for_peers(s.work); }

    // Whether this warpgroup holds the tile's total and stores it (in a cluster every
    // piece stores its own columns of it inside the reduce: never).
    template <class Acc>
    __device__ bool finish_unit(Acc& acc, const WorkUnit& unit, const TileCoord& tile, int row0, int col0) {
      summed = unit.role == UnitRole::kContributor;
      if (summed && !Reduce::reduce(acc, s.partials, s.work, unit, s.smem, warpgroup, s.out, tile.batch, row0, col0))
        return false;  // another piece of the tile stores it, or (in a cluster) each piece its columns
      JH_TIMELINE_MARK(threadIdx.x == 0, kTimelineSummed);
      return true;
    }
    __device__ void finish() const { Reduce::finish(s.work, summed); }
  };
};

template <class Cfg>
using TileScheduler =
    std::conditional_t<Cfg::kDynamicTiles, DynamicScheduler<Cfg>,
                       std::conditional_t<Cfg::kSplitK, SplitKScheduler<Cfg>, StaticScheduler<Cfg>>>;

// A consumer warpgroup's walk over its units.
template <class Scheduler>
__device__ typename Scheduler::Consumer consumer_units(const Scheduler& scheduler, typename Scheduler::Storage& smem,
                                                       const WorkList& work, int64_t cluster,
                                                       const typename Scheduler::Pipe& pipe,
                                                       typename Scheduler::State& read, int warpgroup) {
  return typename Scheduler::Consumer(scheduler, smem, work, cluster, pipe, read, warpgroup);
}

}  // namespace jax_hopper
