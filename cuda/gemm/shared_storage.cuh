// The kernel's shared memory: the ring's stages, then what the kind's epilogue and
// scheduler keep there. Each part is an empty struct for kinds without it, and the
// order of the members is the layout (the dynamic order's slots last, so the other
// kinds' offsets stay as they are).
#pragma once
#include <cstddef>
#include <cstdint>

#include "gemm/config.cuh"
#include "gemm/scheduler/group_table.cuh"
#include "gemm/scheduler/tile_tickets.cuh"
#include "hopper/warpgroup.cuh"

namespace jax_hopper {

// Staging buffers of the TMA-store epilogue and the deferred store (none for the
// register epilogue).
template <class Cfg, bool = Cfg::kTmaStoreEpilogue || Cfg::kDeferredStore>
struct EpilogueStorage {
  alignas(kSmemAlignment) uint8_t buffers[Cfg::kConsumerWarpgroups][Cfg::kStoreBuffers][Cfg::kStoreBufferBytes];
};
template <class Cfg>
struct EpilogueStorage<Cfg, false> {};

// The fused epilogue's bias slice of the current tile, one 16-bit pair per thread of
// each consumer warpgroup (FusedOps::prefetch / apply).
template <class Cfg, bool = Cfg::kFusedEpilogue>
struct FusedStorage {
  uint32_t bias[Cfg::kConsumerWarpgroups][hopper::kWarpgroupSize];
};
template <class Cfg>
struct FusedStorage<Cfg, false> {};

// Ping-pong: turn[w] completes a phase each time the other warpgroup has waited for all
// of its tile's stages (all its threads arrive), which warpgroup w awaits before its own
// next tile. Besides serializing the two mainloops, this keeps a warpgroup from waiting
// on a stage more than one ring lap ahead of the producer, where the phase parity would
// be ambiguous.
template <class Cfg, bool = Cfg::kPingpong>
struct TurnStorage {
  uint64_t turn[Cfg::kConsumerWarpgroups];
};
template <class Cfg>
struct TurnStorage<Cfg, false> {};

// The staged operand's barrier, one per consumer warpgroup: its loads complete on it
// (transaction bytes), one phase per tile.
template <class Cfg, bool = Cfg::kStagedOperand>
struct OperandStorage {
  uint64_t full[Cfg::kConsumerWarpgroups];
};
template <class Cfg>
struct OperandStorage<Cfg, false> {};

// The backward form's bias-gradient scratch, one per consumer warpgroup.
template <class Cfg, bool = Cfg::kStagedOperand>
struct ColumnSumStorage {
  float sums[Cfg::kConsumerWarpgroups][hopper::kWarpsPerWarpgroup][Cfg::kBlockN];
};
template <class Cfg>
struct ColumnSumStorage<Cfg, false> {};

// What the scheduler keeps: the dynamic tile order's per-stage tile slots and producer
// mailbox, or the grouped kinds' table of groups.
template <class Cfg, bool = Cfg::kDynamicTiles, bool = Cfg::kGrouped>
struct SchedulerStorage {
  TicketStorage<Cfg::kStages> tickets;
};
template <class Cfg>
struct SchedulerStorage<Cfg, false, true> {
  GroupTableStorage groups;
};
template <class Cfg>
struct SchedulerStorage<Cfg, false, false> {};

template <class Cfg>
struct SharedStorage {
  struct alignas(kSmemAlignment) Stage {
    typename Cfg::Element a[Cfg::LayoutA::kElements];
    typename Cfg::Element b[Cfg::LayoutB::kElements];
  };
  Stage stages[Cfg::kStages];
  EpilogueStorage<Cfg> epilogue;
  FusedStorage<Cfg> fused;
  TurnStorage<Cfg> turns;
  OperandStorage<Cfg> operand;
  ColumnSumStorage<Cfg> column_sums;
  uint64_t full[Cfg::kStages];   // TMA -> consumers: the stage holds fresh data
  uint64_t empty[Cfg::kStages];  // consumers -> TMA: the stage may be overwritten
  SchedulerStorage<Cfg> scheduler;  // last: the other kinds' offsets stay as they were
};

// Dynamic shared memory requested at launch: the storage plus slack to align its base.
template <class Cfg>
constexpr size_t smem_bytes() {
  return sizeof(SharedStorage<Cfg>) + kSmemAlignment;
}

}  // namespace jax_hopper
