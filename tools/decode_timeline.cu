// Where a small-M (decode) launch spends its time, CTA by CTA: builds the kind with
// JAX_HOPPER_TIMELINE (cuda/gemm/timeline.cuh), runs each shape given as MxNxK with L2
// scrubbed before every launch (a read-only pass over 2x L2, so no dirty lines are left
// to write back under the kernel), and prints per-event spreads relative to the first
// CTA's start, plus the launch's CUDA-event time. Not part of the library.
//   mkdir -p /tmp/jh/gemm && python3 jax_hopper/_kernels.py header /tmp/jh/gemm/kernel_kinds.h
//   nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icuda -I/tmp/jh --expt-relaxed-constexpr \
//     tools/decode_timeline.cu cuda/hopper/tensor_map.cc -o /tmp/decode_timeline
//   /tmp/decode_timeline 16x4096x4096 16x8192x8192
// (-DPROBE_STAGES=N builds the kind with an N-stage ring instead of the library's 4.)
#define JAX_HOPPER_TIMELINE
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gemm/launch.cuh"

using namespace jax_hopper;

// Exits with launch.cuh's message on a failed CUDA call or launch.
static void check(const Status& st) {
  if (!st.ok()) {
    std::fprintf(stderr, "%s\n", st.message.c_str());
    std::exit(1);
  }
}
#define CHECK(x) check(cuda_status((x), #x))

constexpr size_t kScrubBytes = size_t{120} << 20;  // 2x the H200's 60 MB L2
constexpr int kReps = 7;                            // launches per shape; the median one is printed
constexpr int kThreadsPerBlock = 256;
constexpr int kFillBlocks = 1024;                                  // grid-stride fill of the operands
constexpr int kScrubBlocks = 264, kScrubThreads = 1024;            // two CTAs per SM of an H200
#ifndef PROBE_STAGES
#define PROBE_STAGES 4  // the small-M kind's instance (jax_hopper/_kernels.py)
#endif
constexpr int kStages = PROBE_STAGES;  // -DPROBE_STAGES=N: the ring's depth, to measure

__global__ void fill(__half* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = __float2half((static_cast<float>(h & 0xffff) / 65536.0f - 0.5f) * 0.1f);
  }
}

// Reads every line of `p` (evicting L2's clean copies of everything else); writes only
// if the impossible happens, so the compiler keeps the loads.
__global__ void scrub(const uint4* p, size_t n, uint32_t* sink) {
  uint32_t x = 0;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    const uint4 v = __ldcg(p + i);
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x9e3779b9u) *sink = x;
}

struct Run {
  float event_ms;
  std::vector<TimelineRecord> records;
};

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

int main(int argc, char** argv) {
  constexpr int64_t kMaxCtas = 4096;
  TimelineRecord* d_records;
  CHECK(cudaMalloc(&d_records, kMaxCtas * sizeof(TimelineRecord)));
  CHECK(cudaMemcpyToSymbol(g_timeline, &d_records, sizeof(d_records)));
  const uint32_t capacity = kMaxCtas;
  CHECK(cudaMemcpyToSymbol(g_timeline_capacity, &capacity, sizeof(capacity)));
  uint4* scrub_buf;
  uint32_t* sink;
  CHECK(cudaMalloc(&scrub_buf, kScrubBytes));
  CHECK(cudaMemset(scrub_buf, 1, kScrubBytes));
  CHECK(cudaMalloc(&sink, sizeof(uint32_t)));
  void* workspace;
  constexpr size_t kWorkspaceBytes = size_t{64} << 20;
  CHECK(cudaMalloc(&workspace, kWorkspaceBytes));
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  const bool warm = std::getenv("WARM") != nullptr;

  for (int arg = 1; arg < argc; ++arg) {
    int64_t m, n, k;
    if (std::sscanf(argv[arg], "%ldx%ldx%ld", &m, &n, &k) != 3) {
      std::fprintf(stderr, "shape %s: want MxNxK\n", argv[arg]);
      return 1;
    }
    __half *a, *b, *c;
    CHECK(cudaMalloc(&a, m * k * sizeof(__half)));
    CHECK(cudaMalloc(&b, k * n * sizeof(__half)));
    CHECK(cudaMalloc(&c, m * n * sizeof(__half)));
    fill<<<kFillBlocks, kThreadsPerBlock, 0, stream>>>(a, m * k, 1);
    fill<<<kFillBlocks, kThreadsPerBlock, 0, stream>>>(b, k * n, 2);
    CHECK(cudaGetLastError());
    GemmArgs args;
    args.a = a;
    args.b = b;
    args.c = c;
    args.m = m;
    args.n = n;
    args.k = k;
    args.lda = k;
    args.ldb = n;
    args.ldc = n;
    args.workspace = workspace;
    args.workspace_bytes = kWorkspaceBytes;
    std::vector<Run> runs;
    for (int rep = 0; rep < kReps; ++rep) {
      CHECK(cudaMemsetAsync(d_records, 0, kMaxCtas * sizeof(TimelineRecord), stream));
      CHECK(cudaMemsetAsync(c, 0xff, m * n * sizeof(__half), stream));  // NaN: what the launch does not write
      if (!warm) scrub<<<kScrubBlocks, kScrubThreads, 0, stream>>>(scrub_buf, kScrubBytes / sizeof(uint4), sink);
      CHECK(cudaGetLastError());
      CHECK(cudaEventRecord(start, stream));
      const Status st =
          launch_gemm_instance<KernelKind::kSmallM, ElementType::kF16, Major::kK, Major::kMN, kStages>(args, stream);
      check(st);
      CHECK(cudaEventRecord(stop, stream));
      CHECK(cudaStreamSynchronize(stream));
      Run r;
      CHECK(cudaEventElapsedTime(&r.event_ms, start, stop));
      r.records.resize(kMaxCtas);
      CHECK(cudaMemcpy(r.records.data(), d_records, kMaxCtas * sizeof(TimelineRecord), cudaMemcpyDeviceToHost));
      int ctas = 0;
      while (ctas < kMaxCtas && r.records[ctas].global_ns[kTimelineEntry] != 0) ++ctas;
      if (ctas == kMaxCtas) std::fprintf(stderr, "%s: more CTAs than the %ld records; only those timed\n", argv[arg],
                                         static_cast<long>(kMaxCtas));
      r.records.resize(ctas);
      runs.push_back(std::move(r));
    }
    // A hash of C's bits (FNV-1a), to compare builds that must give identical results.
    std::vector<__half> host_c(m * n);
    CHECK(cudaMemcpy(host_c.data(), c, m * n * sizeof(__half), cudaMemcpyDeviceToHost));
    uint64_t hash = 1469598103934665603ull;
    int64_t nan = 0;
    for (const __half& h : host_c) {
      uint16_t bits;
      std::memcpy(&bits, &h, sizeof(bits));
      hash = (hash ^ bits) * 1099511628211ull;
      nan += (bits & 0x7c00) == 0x7c00 && (bits & 0x3ff) != 0;
    }
    if (nan) std::printf("%s: %lld NaN in C (elements not written)\n", argv[arg], static_cast<long long>(nan));
    std::sort(runs.begin(), runs.end(), [](const Run& x, const Run& y) { return x.event_ms < y.event_ms; });
    const Run& r = runs[runs.size() / 2];
    uint64_t t0 = ~uint64_t{0};
    for (const auto& rec : r.records) t0 = std::min(t0, rec.global_ns[kTimelineEntry]);
    static const char* kNames[kTimelineEvents] = {"entry",         "producer",       "first data",
                                                  "mainloop done", "partials ready", "summed",
                                                  "stores issued", "consumer done"};
    std::printf("%s (%s L2): %zu CTAs, CUDA events %.2f us (min %.2f), C hash %016llx\n", argv[arg],
                warm ? "warm" : "cold", r.records.size(), r.event_ms * 1e3, runs.front().event_ms * 1e3,
                static_cast<unsigned long long>(hash));
    std::printf("  %-14s %8s %8s %8s %8s   (us after the first CTA's entry; CTAs that reach the event)\n", "event",
                "min", "median", "p90", "max");
    for (int e = 0; e < kTimelineEvents; ++e) {
      std::vector<double> t;
      for (const auto& rec : r.records)
        if (rec.global_ns[e] != 0) t.push_back((rec.global_ns[e] - t0) * 1e-3);
      std::sort(t.begin(), t.end());
      if (t.empty()) continue;
      std::printf("  %-14s %8.2f %8.2f %8.2f %8.2f   %zu\n", kNames[e], t.front(), t[t.size() / 2],
                  t[t.size() * 9 / 10], t.back(), t.size());
    }
    // Within a CTA, by its own SM clock (cycles -> us at the clock the events imply).
    std::vector<double> ramp, stream_t, tail;
    for (const auto& rec : r.records) {
      if (rec.clock[kTimelineFirstData] == 0 || rec.clock[kTimelineMainloopDone] == 0) continue;
      ramp.push_back(rec.clock[kTimelineFirstData] - rec.clock[kTimelineEntry]);
      stream_t.push_back(rec.clock[kTimelineMainloopDone] - rec.clock[kTimelineFirstData]);
      tail.push_back(rec.clock[kTimelineConsumerDone] - rec.clock[kTimelineMainloopDone]);
    }
    std::printf("  per CTA, cycles (median): entry->first data %.0f, first data->mainloop done %.0f, "
                "mainloop done->consumer done %.0f\n",
                median(ramp), median(stream_t), median(tail));
    // RAW=prefix: every CTA's events (ns after the first entry) to prefix_MxNxK.csv.
    if (const char* raw = std::getenv("RAW")) {
      const std::string path = std::string(raw) + "_" + argv[arg] + ".csv";
      if (FILE* f = std::fopen(path.c_str(), "w")) {
        std::fprintf(f, "cta,sm");
        for (int e = 0; e < kTimelineEvents; ++e) std::fprintf(f, ",%s", kNames[e]);
        std::fprintf(f, "\n");
        for (size_t i = 0; i < r.records.size(); ++i) {
          std::fprintf(f, "%zu,%u", i, r.records[i].sm);
          for (int e = 0; e < kTimelineEvents; ++e)
            std::fprintf(f, ",%lld", r.records[i].global_ns[e] ? static_cast<long long>(r.records[i].global_ns[e] - t0)
                                                               : -1LL);
          std::fprintf(f, "\n");
        }
        std::fclose(f);
      }
    }
    // The pieces that sum their tile: how long each step after their own mainloop took (us).
    std::vector<double> wait_peers, sum_t, stage_t, store_wait;
    const auto us = [](uint64_t from, uint64_t to) { return (to - from) * 1e-3; };
    for (const auto& rec : r.records) {
      const uint64_t* g = rec.global_ns;
      if (g[kTimelineSummed] == 0 || g[kTimelinePartialsReady] == 0) continue;
      wait_peers.push_back(us(g[kTimelineMainloopDone], g[kTimelinePartialsReady]));
      sum_t.push_back(us(g[kTimelinePartialsReady], g[kTimelineSummed]));
      stage_t.push_back(us(g[kTimelineSummed], g[kTimelineStoresIssued]));
      store_wait.push_back(us(g[kTimelineStoresIssued], g[kTimelineConsumerDone]));
    }
    if (!sum_t.empty())
      std::printf("  summing pieces (%zu), us (median / max): own mainloop done->partials ready %.2f / %.2f, "
                  "sum %.2f / %.2f, stage + issue stores %.2f / %.2f, wait for stores %.2f / %.2f\n",
                  sum_t.size(), median(wait_peers), *std::max_element(wait_peers.begin(), wait_peers.end()),
                  median(sum_t), *std::max_element(sum_t.begin(), sum_t.end()), median(stage_t),
                  *std::max_element(stage_t.begin(), stage_t.end()), median(store_wait),
                  *std::max_element(store_wait.begin(), store_wait.end()));
    constexpr int kMaxSms = 1024;
    std::vector<int> per_sm(kMaxSms, 0);
    for (const auto& rec : r.records) per_sm[rec.sm % kMaxSms]++;
    int sms = 0, two = 0;
    for (int c : per_sm) sms += c > 0, two += c > 1;
    // Does sharing an SM slow a CTA's stream (its SM's L2 bandwidth, TMA unit)?
    std::vector<double> alone, shared, alone_done, shared_done;
    for (const auto& rec : r.records) {
      if (rec.clock[kTimelineMainloopDone] == 0) continue;
      const double cycles = rec.clock[kTimelineMainloopDone] - rec.clock[kTimelineFirstData];
      const double done_us = (rec.global_ns[kTimelineMainloopDone] - t0) * 1e-3;
      (per_sm[rec.sm % kMaxSms] > 1 ? shared : alone).push_back(cycles);
      (per_sm[rec.sm % kMaxSms] > 1 ? shared_done : alone_done).push_back(done_us);
    }
    std::printf("  SMs used %d, of which %d hold two or more CTAs; stream cycles (median) alone %.0f, sharing %.0f; "
                "mainloop done (median us) alone %.2f, sharing %.2f\n",
                sms, two, median(alone), median(shared), median(alone_done), median(shared_done));
    CHECK(cudaFree(a));
    CHECK(cudaFree(b));
    CHECK(cudaFree(c));
  }
  return 0;
}
