// The shared-memory ring between the TMA producer and the consumer warpgroups: per
// stage a `full` barrier (1 arrival + TMA bytes) and an `empty` barrier (one elected
// arrival per warpgroup that reads the stage: every consumer warpgroup in the
// cooperative kinds, one in ping-pong), and an {index, phase} cursor for each side.
#pragma once
#include <cstdint>

#include "hopper/cluster.cuh"
#include "hopper/mbarrier.cuh"

namespace jax_hopper {

template <int kStages>
struct PipelineState {
  int index = 0;
  uint32_t phase = 0;
  // Stage wraps to 0 => the barriers of the ring enter their next phase.
  __device__ void advance() {
    if (++index == kStages) {
      index = 0;
      phase ^= 1;
    }
  }
};

// The producer starts at phase 1: a fresh barrier is in phase 0, so its first wait on
// each empty barrier passes at once (every stage starts out free).
template <int kStages>
__device__ PipelineState<kStages> producer_start_state() {
  return {0, 1};
}
template <int kStages>
__device__ PipelineState<kStages> consumer_start_state() {
  return {0, 0};
}

// kClusterSize > 1: every CTA's stage s is also written by its peers' multicast loads,
// so a stage is free only once the consumers of every CTA in the cluster released it:
// each warpgroup that read it arrives on stage s's empty barrier in all the cluster's CTAs.
template <int kStages, int kClusterSize = 1>
struct Pipeline {
  uint64_t* full;
  uint64_t* empty;

  // One thread initialises; the caller fences and syncs the block before first use.
  __device__ void init(int consumer_arrivals) const {
    for (int s = 0; s < kStages; ++s) {
      hopper::mbarrier_init(&full[s], 1);
      hopper::mbarrier_init(&empty[s], consumer_arrivals);
    }
    hopper::fence_barrier_init();
  }

  __device__ void producer_acquire(const PipelineState<kStages>& st) const {
    hopper::mbarrier_wait(&empty[st.index], st.phase);
  }
  // Arrives on full[stage] announcing the bytes the TMA loads that follow will deliver.
  __device__ void producer_expect(const PipelineState<kStages>& st, uint32_t bytes) const {
    hopper::mbarrier_arrive_expect_tx(&full[st.index], bytes);
  }
  __device__ uint64_t* producer_barrier(const PipelineState<kStages>& st) const {
    return &full[st.index];
  }
  __device__ void consumer_wait(const PipelineState<kStages>& st) const {
    hopper::mbarrier_wait(&full[st.index], st.phase);
  }
  // Called by one elected thread per reading warpgroup, only once nothing reads the
  // stage any more: the wgmma that read it has retired (wgmma.wait_group), never merely
  // been issued; a warpgroup that only passes a stage (Mainloop::pass) releases it
  // once all its warps have waited for it.
  __device__ void consumer_release(const PipelineState<kStages>& st) const {
    if constexpr (kClusterSize == 1) {
      hopper::mbarrier_arrive(&empty[st.index]);
    } else {
#pragma unroll
      for (int cta = 0; cta < kClusterSize; ++cta) hopper::mbarrier_arrive_cluster(&empty[st.index], cta);
    }
  }
};

}  // namespace jax_hopper
