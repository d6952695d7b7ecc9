// Per-CTA event clock for probes only (scripts/probe_timeline.cu defines
// JAX_HOPPER_TIMELINE before including the kernel): where a CTA's time goes between its
// start, its first data, the end of its mainloop and the end of its epilogue. Without
// the macro every mark compiles to nothing, so the library's kernels are unchanged.
#pragma once
#include <cstdint>

namespace jax_hopper {

enum TimelineEvent : int {
  kTimelineEntry,         // thread 0, first instruction
  kTimelineProducer,      // the producer thread, about to issue its first load
  kTimelineFirstData,     // consumer thread 0, its first stage has landed
  kTimelineMainloopDone,  // consumer thread 0, its last MMA retired
  kTimelinePartialsReady, // split K: the partial sums are there to read (in a cluster, every piece; else the last)
  kTimelineSummed,        // split K: this piece's sum is done (in a cluster, its columns stored)
  kTimelineStoresIssued,  // consumer thread 0, its stores issued (TMA ones not yet waited for)
  kTimelineConsumerDone,  // consumer thread 0, partial sum handed on or output stored
  kTimelineEvents
};

struct TimelineRecord {
  uint64_t global_ns[kTimelineEvents];  // %globaltimer: comparable across SMs
  int64_t clock[kTimelineEvents];       // clock64: finer, within one SM
  uint32_t sm;
  uint32_t pad;
};

#ifdef JAX_HOPPER_TIMELINE
// One record per CTA (blockIdx.x); set by the probe. Defined in this header, so the macro
// is for single-translation-unit probes only.
__device__ TimelineRecord* g_timeline;
__device__ uint32_t g_timeline_capacity;  // records there; CTAs past them mark nothing

__device__ inline void timeline_mark(int event) {
  TimelineRecord* records = g_timeline;
  if (records == nullptr || blockIdx.x >= g_timeline_capacity) return;
  uint64_t ns;
  uint32_t sm;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  TimelineRecord& r = records[blockIdx.x];
  r.global_ns[event] = ns;
  r.clock[event] = clock64();
  r.sm = sm;
}
#define JH_TIMELINE_MARK(cond, event) \
  do {                                 \
    if (cond) ::jax_hopper::timeline_mark(event); \
  } while (0)
#else
#define JH_TIMELINE_MARK(cond, event) \
  do {                                 \
  } while (0)
#endif

}  // namespace jax_hopper
