// Host launch of one kernel configuration: tensor maps, shared-memory opt-in, grid.
// Included only by the generated per-instance translation units.
#pragma once
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "gemm/config.cuh"
#include "gemm/gemm.h"
#include "gemm/grouped_kernel.cuh"
#include "gemm/kernel.cuh"
#include "gemm/scheduler/split_k.cuh"
#include "gemm/scheduler/stream_k.cuh"
#include "gemm/scheduler/tile_scheduler.cuh"
#include "hopper/tensor_map.h"

namespace jax_hopper {

template <ElementType kType>
struct ElementOf;
template <>
struct ElementOf<ElementType::kF16> {
  using type = __half;
};
template <>
struct ElementOf<ElementType::kBF16> {
  using type = __nv_bfloat16;
};

inline Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  return Status::Internal(std::string(what) + ": " + cudaGetErrorString(err));
}

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
constexpr int64_t kMaxGridX = (int64_t{1} << 31) - 1;

// Tensor map of one operand: `mn` is its M (or N) extent, `ld` its stored row length;
// `box_outer` overrides the layout's box (K-major A's rows in the small-M kind).
template <class Layout>
Status encode_operand(CUtensorMap* map, const void* ptr, int64_t mn, int64_t k, int64_t ld, int64_t batch,
                      int64_t batch_stride, int box_outer = Layout::kBoxOuter) {
  hopper::TensorMap3d d;
  d.base = ptr;
  d.row_stride = static_cast<uint64_t>(ld);
  d.batch = static_cast<uint64_t>(batch);
  d.batch_stride = static_cast<uint64_t>(batch_stride);
  d.box_inner = Layout::kBoxInner;
  d.box_outer = static_cast<uint32_t>(box_outer);
  d.inner = static_cast<uint64_t>(Layout::kKMajor ? k : mn);
  d.outer = static_cast<uint64_t>(Layout::kKMajor ? mn : k);
  return hopper::encode_tensor_map_3d(map, d);
}

// Tensor map of an output-shaped matrix (M x N, row length `ld`, `bytes` per element)
// in the TMA-store epilogue's boxes: one 128-byte swizzle row wide by one wgmma row
// block (64 rows). False (and no map) when its layout is not one TMA can address
// (16-byte aligned base and row/batch strides).
template <class Cfg>
Status encode_subtile_map(CUtensorMap* map, const GemmArgs& args, const void* base, int64_t ld,
                          int64_t batch_stride, uint32_t bytes, bool* usable) {
  constexpr int64_t kAlign = 16;
  // Rows of N x bytes a multiple of 16 too: with a padded ld (a 16-byte multiple) and
  // f32 N = 131 or f16 N = 255, a review helper saw the TMA store write one element per
  // row past N into the padding on an H200.
  // jax_hopper's own calls have ld = N, for which this adds nothing.
  *usable = Cfg::kTmaStoreEpilogue && reinterpret_cast<uintptr_t>(base) % kAlign == 0 && ld * bytes % kAlign == 0 &&
            args.n * bytes % kAlign == 0 && (args.batch == 1 || batch_stride * bytes % kAlign == 0);
  if (!*usable) return Status::Ok();
  hopper::TensorMap3d d;
  d.base = base;
  d.inner = static_cast<uint64_t>(args.n);
  d.outer = static_cast<uint64_t>(args.m);
  d.batch = static_cast<uint64_t>(args.batch);
  d.row_stride = static_cast<uint64_t>(ld);
  d.batch_stride = static_cast<uint64_t>(batch_stride);
  d.box_inner = Cfg::kStoreRowBytes / bytes;
  d.box_outer = Cfg::kStoreRows;
  d.element_bytes = bytes;
  return hopper::encode_tensor_map_3d(map, d);
}

// C's map (or the derivative kind's D: C's shape and layout); without one the kernel
// stores from registers.
template <class Cfg>
Status encode_output(CUtensorMap* map, const GemmArgs& args, void* c, bool* usable) {
  const uint32_t c_bytes = args.c_f32 ? sizeof(float) : sizeof(typename Cfg::Element);
  return encode_subtile_map<Cfg>(map, args, c, args.ldc, args.batch_stride_c, c_bytes, usable);
}

// Per-device facts of one kernel, computed on its first launch on that device:
// occupancy queries and function attributes are not free, and XLA calls us per step.
constexpr int kMaxCachedDevices = 64;

// A launch of `ctas` CTAs of this kernel in clusters of `cluster_size` along x, for the
// cluster occupancy query and the launch alike (the launch sets numAttrs to 0 for
// clusters of one); `attr` must outlive the returned config.
template <class Cfg>
cudaLaunchConfig_t launch_config(int64_t ctas, int cluster_size, size_t smem, cudaStream_t stream,
                                 cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t config = {};
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = static_cast<unsigned>(cluster_size);
  attr->val.clusterDim.y = attr->val.clusterDim.z = 1;
  config.gridDim = dim3(static_cast<unsigned>(ctas));
  config.blockDim = dim3(Cfg::kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  return config;
}

// Clusters of `size` CTAs of this kernel that fit on the current device at once (a
// cluster must fit in one GPC, so this can be fewer than the CTAs that fit alone).
template <class Cfg>
Status query_active_clusters(const void* kernel, size_t smem, int size, int* clusters) {
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t config = launch_config<Cfg>(size, size, smem, nullptr, &attr);
  return cuda_status(cudaOccupancyMaxActiveClusters(clusters, kernel, &config), "cudaOccupancyMaxActiveClusters");
}

// CTAs of this kernel that fit on the device at once (for clusters, what the GPC layout
// allows). Split K is built for kCtasPerSm per SM (config.cuh checks that its shared
// memory allows it); with fewer it is slower, not wrong: the pieces of a tile in a
// cluster are co-scheduled by the hardware, and outside one no CTA waits on another.
template <class Cfg>
Status query_resident_ctas(const void* kernel, size_t smem, int device, int* ctas) {
  if constexpr (Cfg::kClusterM == 1) {
    int sms = 0, per_sm = 0;
    Status st = cuda_status(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count");
    if (st.ok())
      st = cuda_status(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, Cfg::kThreads, smem),
                       "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    *ctas = sms * per_sm;
    return st;
  } else {
    int clusters = 0;
    const Status st = query_active_clusters<Cfg>(kernel, smem, Cfg::kClusterM, &clusters);
    *ctas = clusters * Cfg::kClusterM;
    return st;
  }
}

// Opts the kernel into its shared memory and returns how many CTAs are resident, once
// per device (a racing first call just repeats the same idempotent work).
template <class Cfg>
Status prepare_device(const void* kernel, size_t smem, int* resident) {
  static std::atomic<int> cache[kMaxCachedDevices];
  int device = 0;
  Status st = cuda_status(cudaGetDevice(&device), "cudaGetDevice");
  if (!st.ok()) return st;
  const bool cacheable = device < kMaxCachedDevices;
  if (cacheable && (*resident = cache[device].load(std::memory_order_acquire)) > 0) return Status::Ok();
  st = cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
                   "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  if (st.ok()) st = query_resident_ctas<Cfg>(kernel, smem, device, resident);
  if (!st.ok()) return st;
  if (*resident <= 0) return Status::Internal("the kernel does not fit on this device");
  if (cacheable) cache[device].store(*resident, std::memory_order_release);
  return Status::Ok();
}

// The call's workspace (GemmArgs::workspace), a buffer of XLA's plan: the dynamic
// order's ticket counter in its first kCounterBytes, then the partial sums of a split
// (stream-K's or split K's) and their flags or counters.
constexpr size_t kCounterBytes = 16;  // keeps the partial sums' float4s aligned

template <class Cfg>
constexpr size_t partial_sums_offset() {
  return Cfg::kDynamicTiles ? kCounterBytes : 0;
}

// The partial sums in the workspace: `data_bytes` of slots, then `counters` uint32 flags
// or counters zeroed (stream ordered before the launch). False where they do not fit.
template <class Cfg>
Status prepare_partial_sums(const GemmArgs& args, cudaStream_t stream, size_t data_bytes, size_t counters,
                            const char* what, StreamKParams* params) {
  const size_t offset = partial_sums_offset<Cfg>(), counter_bytes = counters * sizeof(uint32_t);
  if (args.workspace_bytes < offset + data_bytes + counter_bytes)
    return Status::Invalid(std::string(what) + ": the workspace holds " + std::to_string(args.workspace_bytes) +
                           " bytes, the partial sums need " + std::to_string(offset + data_bytes + counter_bytes));
  char* memory = static_cast<char*>(args.workspace) + offset;
  params->workspace = reinterpret_cast<float4*>(memory);
  params->flags = reinterpret_cast<uint32_t*>(memory + data_bytes);
  return cuda_status(cudaMemsetAsync(params->flags, 0, counter_bytes, stream),
                     (std::string("zeroing ") + what + " counters").c_str());
}

// Stream-K tail: splits it when the last wave is partial, with the workspace's partial
// sums (plus zeroed flags). Too small a workspace is an error, not a quiet fall-back to
// whole tiles: this kind exists to measure the split.
template <class Cfg>
Status prepare_stream_k(const GemmArgs& args, cudaStream_t stream, WorkList* work, StreamKParams* params) {
  using Fixup = StreamKFixup<Cfg>;
  if (work->num_tiles % work->clusters == 0) return Status::Ok();
  const Status st = prepare_partial_sums<Cfg>(args, stream, Fixup::workspace_bytes(work->clusters),
                                              Fixup::flag_count(work->clusters), "stream-K", params);
  if (st.ok()) work->split_tail = true;
  return st;
}

// Split K (the small-M kind): how many pieces each tile's K range is cut into. Measured:
// a wave of pieces costs its longest piece plus kPieceOverheadKTiles K tiles' worth of
// time (each further wave of shorter pieces added 3.7-9 us, about 3-8 K tiles of one
// CTA's streaming). Where the tiles fit one
// wave: the most pieces that still do, floor(CTAs / tiles) (at 16x8192x8192: 4 pieces,
// 38 us, against 42-48 us with 2-4 waves). With more tiles than CTAs (wide N; not
// measured), of the piece counts that fill w = 1 .. kMaxSplitKWaves waves (w = 1: a
// piece per tile), the one with the least waves x (K tiles per piece +
// kPieceOverheadKTiles): at 16x50257x4096, 393 tiles, 2 pieces in 3 full waves rather
// than 1 in 1.5. No piece shorter than kMinSplitKTiles K tiles. The pieces depend on the
// SM count and, in clusters, on the GPC layout (choose_split_k_clusters), so the bits do
// too (they are the same on every call on one device).
constexpr int kPieceOverheadKTiles = 6;
constexpr int kMaxSplitKWaves = 8;
constexpr int kMinSplitKTiles = 2;

// Measurement override (scripts/decode_split_k.sh): JAX_HOPPER_SPLIT_K_WAVES=W takes the
// piece count that fills W waves; read once per process.
inline int split_k_waves_override() {
  static const int waves = [] {
    const char* env = std::getenv("JAX_HOPPER_SPLIT_K_WAVES");
    return env != nullptr ? std::max(0, std::atoi(env)) : 0;
  }();
  return waves;
}

// Test and measurement override (tests/test_split_k_gpu.py): JAX_HOPPER_SPLIT_K_PIECES=P
// cuts every tile into P pieces (at most one per kMinSplitKTiles K tiles), summed in
// clusters of exactly P where they fit (no smaller count is tried), otherwise through
// global memory; read once per process.
inline int split_k_pieces_override() {
  static const int pieces = [] {
    const char* env = std::getenv("JAX_HOPPER_SPLIT_K_PIECES");
    return env != nullptr ? std::max(0, std::atoi(env)) : 0;
  }();
  return pieces;
}

inline int split_k_pieces(int64_t tiles, int k_tiles, int resident) {
  const int64_t most = std::max(1, k_tiles / kMinSplitKTiles);
  const auto filling = [&](int64_t waves) { return std::clamp<int64_t>(waves * resident / tiles, 1, most); };
  if (const int pieces = split_k_pieces_override(); pieces > 0) {
    return static_cast<int>(std::min<int64_t>(pieces, most));
  }
  if (const int waves = split_k_waves_override(); waves > 0) return static_cast<int>(filling(waves));
  if (tiles <= resident) return static_cast<int>(filling(1));
  int64_t best = 1, best_cost = INT64_MAX;
  for (int64_t w = 1; w <= kMaxSplitKWaves; ++w) {
    const int64_t pieces = filling(w);
    const int64_t cost = ceil_div(tiles * pieces, resident) * (ceil_div(k_tiles, pieces) + kPieceOverheadKTiles);
    if (cost < best_cost) best = pieces, best_cost = cost;
  }
  return static_cast<int>(best);
}

// Split K in clusters (SplitKReduce): a tile's pieces, one cluster, are summed through
// distributed shared memory, with no workspace, counters or L2 round trips. Clusters of
// up to 8 CTAs are portable. A cluster must fit in one GPC, so fewer CTAs may be
// resident in clusters than alone: of the piece counts from the one-wave rule's down to
// 2, the first whose clusters all fit at once is taken. Measured on an H200, clusters
// against the global workspace: long pieces stream B at full bandwidth, so fewer of them
// cost nothing and the cheaper sum wins (N = K = 8192, 64 tiles, 3 pieces of 43 K
// tiles in clusters against 4 of 32: M = 16 38.3 vs 39.1 us, M = 64 40.3 vs 45.5). Short pieces lost in clusters while piece 0 summed the tile
// alone; since every piece sums its own columns they win too (CUDA events per launch:
// 16x4096x4096 7 of 10 K tiles 17.2 us against 8 of 8
// through global memory 20.1; 16x5120x4096 5 against 6, 19.3 vs 22.2). Drops of more
// than one piece (80-88 tiles: 3 pieces -> 2, as an H200 holds 79 clusters of 3) are
// unmeasured. Otherwise (more pieces than a cluster holds, more tiles than clusters) the
// pieces meet in a global workspace.
// Test and measurement override (scripts/decode_split_k.sh, tests/test_split_k_gpu.py):
// JAX_HOPPER_SPLIT_K_CLUSTER=0 sums every split through the global workspace; =1 requires
// the clusters (a launch whose pieces cannot be summed in clusters fails, so a test of
// the cluster sum cannot quietly test the other path); unset, clusters where they fit.
// Read once per process.
enum class SplitKClusters { kNever, kWhereTheyFit, kRequired };
inline SplitKClusters split_k_clusters_setting() {
  static const SplitKClusters setting = [] {
    const char* env = std::getenv("JAX_HOPPER_SPLIT_K_CLUSTER");
    if (env == nullptr) return SplitKClusters::kWhereTheyFit;
    return std::atoi(env) == 0 ? SplitKClusters::kNever : SplitKClusters::kRequired;
  }();
  return setting;
}

// How many clusters of 2 .. kMaxClusterPieces CTAs fit on the device at once, queried
// once per device and size (cached as count + 1, so that 0 is remembered too). A failed
// query counts as none: the split then goes through global memory, which needs no
// cluster.
template <class Cfg>
int active_clusters(const void* kernel, size_t smem, int size) {
  static std::atomic<int> cache[kMaxCachedDevices][kMaxClusterPieces + 1];
  // A failed query is no error of the launch, so its error is cleared; but an error left
  // pending by earlier work (cudaPeekAtLastError) is not ours to clear, so then nothing
  // is. Either way the query runs: skipping it would change the split, and the bits,
  // for as long as someone else's error stayed pending.
  const bool pending = cudaPeekAtLastError() != cudaSuccess;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    if (!pending) (void)cudaGetLastError();
    return 0;
  }
  const bool cacheable = device < kMaxCachedDevices;
  if (cacheable) {
    if (const int cached = cache[device][size].load(std::memory_order_acquire); cached > 0) return cached - 1;
  }
  int clusters = 0;
  if (!query_active_clusters<Cfg>(kernel, smem, size, &clusters).ok()) {
    if (!pending) (void)cudaGetLastError();
    clusters = 0;
  }
  if (cacheable) cache[device][size].store(clusters + 1, std::memory_order_release);
  return clusters;
}

template <class Cfg>
Status choose_split_k_clusters(const void* kernel, size_t smem, int resident, WorkList* work) {
  const SplitKClusters setting = split_k_clusters_setting();
  if (setting == SplitKClusters::kNever) return Status::Ok();
  const int forced = split_k_pieces_override();
  // Why the pieces cannot be summed in clusters (null while they may be).
  const char* why = nullptr;
  if (setting == SplitKClusters::kRequired && forced > 0 && work->pieces != forced) {
    why = "JAX_HOPPER_SPLIT_K_PIECES asks for more pieces than K allows (see split_k_pieces)";
  } else if (work->pieces < 2) {
    why = "the product is not split";
  } else if (work->pieces > kMaxClusterPieces) {
    why = "more pieces than a portable cluster holds";
  } else if (work->num_tiles > resident) {
    why = "more tiles than resident clusters";
  } else if (split_k_waves_override() > 0) {
    why = "JAX_HOPPER_SPLIT_K_WAVES measures the global sum";
  } else {
    const int fewest = forced > 0 ? work->pieces : 2;
    for (int pieces = work->pieces; pieces >= fewest; --pieces) {
      if (work->num_tiles > active_clusters<Cfg>(kernel, smem, pieces)) continue;
      work->pieces = pieces;
      work->cluster_pieces = true;
      return Status::Ok();
    }
    why = "the clusters do not fit on this device at once";
  }
  if (setting == SplitKClusters::kRequired)
    return Status::Invalid("JAX_HOPPER_SPLIT_K_CLUSTER=1: " + std::to_string(work->num_tiles) + " tiles in " +
                           std::to_string(work->pieces) + " pieces cannot be summed in clusters: " + why);
  return Status::Ok();
}

// Bytes of a split K through global memory: a partial-sum slot per unit, then an
// arrival counter per tile.
template <class Cfg>
constexpr size_t split_k_bytes(int64_t tiles, int pieces) {
  return SplitKReduce<Cfg>::workspace_bytes(tiles * pieces) + static_cast<size_t>(tiles) * sizeof(uint32_t);
}

// Workspace of a split through global memory (one piece, or pieces in clusters, need
// none). Where the workspace was planned for a device with fewer SMs than this one (an
// exported program), the tiles are cut into as many pieces as it holds.
template <class Cfg>
Status prepare_split_k(const GemmArgs& args, cudaStream_t stream, WorkList* work, StreamKParams* params) {
  if (work->pieces == 1 || work->cluster_pieces) return Status::Ok();
  const size_t room = args.workspace_bytes - std::min(args.workspace_bytes, partial_sums_offset<Cfg>());
  while (work->pieces > 1 && split_k_bytes<Cfg>(work->num_tiles, work->pieces) > room) --work->pieces;
  if (work->pieces == 1) return Status::Ok();
  return prepare_partial_sums<Cfg>(args, stream, SplitKReduce<Cfg>::workspace_bytes(work->num_tiles * work->pieces),
                                   static_cast<size_t>(work->num_tiles), "split K", params);
}

// The dynamic order's ticket counter, zeroed at the workspace's start (stream ordered
// before the launch; the memset costs about a microsecond, so a single wave, which
// takes no tickets, goes without). Tile indices travel as int32 (the mailbox between the
// producers); the stage marks carry decoded coordinates.
inline Status prepare_tile_counter(const GemmArgs& args, cudaStream_t stream, const WorkList& work,
                                   uint32_t** counter) {
  if (work.num_tiles > INT32_MAX) return Status::Invalid("too many output tiles for the dynamic order");
  if (work.num_tiles <= work.clusters) return Status::Ok();
  if (args.workspace_bytes < kCounterBytes)
    return Status::Invalid("dynamic tiles: the workspace holds " + std::to_string(args.workspace_bytes) +
                           " bytes, the ticket counter needs " + std::to_string(kCounterBytes));
  *counter = static_cast<uint32_t*>(args.workspace);
  return cuda_status(cudaMemsetAsync(args.workspace, 0, sizeof(uint32_t), stream), "zeroing the ticket counter");
}

// Measurement override (scripts/decode_split_k.sh): JAX_HOPPER_SMALL_M_WHOLE_A=1 loads
// A's whole 64-row tile per stage in the small-M kind, as before the trim; read once.
inline bool small_m_whole_a() {
  static const bool whole = [] {
    const char* env = std::getenv("JAX_HOPPER_SMALL_M_WHOLE_A");
    return env != nullptr && std::atoi(env) != 0;
  }();
  return whole;
}

// The output tiles in their order, and the K tiles of each: what the launch and the
// workspace's size are planned from.
template <class Cfg>
TileOrderOf<Cfg> tile_order_of(const GemmArgs& args) {
  return {static_cast<int>(ceil_div(args.m, Cfg::kBlockM)), static_cast<int>(ceil_div(args.n, Cfg::kBlockN)),
          static_cast<int>(args.batch)};
}
template <class Cfg>
int k_tiles_of(const GemmArgs& args) {
  return static_cast<int>(ceil_div(args.k, Cfg::kBlockK));
}

template <class Cfg>
Status launch_gemm(const GemmArgs& args, cudaStream_t stream) {
  CUtensorMap tmap_a, tmap_b, tmap_c = {};
  const int a_box_rows = small_m_whole_a() ? Cfg::LayoutA::kBoxOuter : Cfg::a_box_rows(args.m);
  Status st = encode_operand<typename Cfg::LayoutA>(&tmap_a, args.a, args.m, args.k_of_a(), args.lda, args.batch,
                                                    args.batch_stride_a, a_box_rows);
  if (!st.ok()) return st;
  st = encode_operand<typename Cfg::LayoutB>(&tmap_b, args.b, args.n, args.k_of_b(), args.ldb, args.batch,
                                             args.batch_stride_b);
  if (!st.ok()) return st;
  bool tma_store = false;
  st = encode_output<Cfg>(&tmap_c, args, args.c, &tma_store);
  if (!st.ok()) return st;
  CUtensorMap tmap_d = {};
  if constexpr (Cfg::kSavesDerivative) {  // D has only the TMA store (gemm.cc checked both can use it)
    bool d_tma_store = false;
    st = encode_output<Cfg>(&tmap_d, args, args.derivative, &d_tma_store);
    if (st.ok() && !(tma_store && d_tma_store)) st = Status::Invalid("the derivative kind needs TMA-storable C and D");
    if (!st.ok()) return st;
  }
  // The backward form's operand, staged in the store buffers by TMA; the result leaves
  // by TMA store through the same buffers (gemm.cc checked that both can).
  if constexpr (Cfg::kStagedOperand) {
    bool staged = false;
    st = encode_subtile_map<Cfg>(&tmap_d, args, args.residual, args.ld_residual, 0, sizeof(typename Cfg::Element),
                                 &staged);
    if (st.ok() && !(tma_store && staged)) st = Status::Invalid("the backward form needs TMA-addressable C and z");
    if (!st.ok()) return st;
  }

  constexpr size_t kSmem = smem_bytes<Cfg>();
  static_assert(kSmem <= kMaxSmemPerBlock, "pipeline stages and epilogue buffers do not fit in shared memory");
  static_assert((kSmem + kSmemPerCtaReserved) * Cfg::kCtasPerSm <= kSmemPerSm, "kCtasPerSm CTAs do not fit an SM");
  const auto kernel = gemm_kernel<Cfg>;
  int resident = 0;
  st = prepare_device<Cfg>(reinterpret_cast<const void*>(kernel), kSmem, &resident);
  if (!st.ok()) return st;

  const size_t c_bytes = args.c_f32 ? sizeof(float) : sizeof(typename Cfg::Element);
  const bool paired = args.ldc % 2 == 0 && args.batch_stride_c % 2 == 0 &&
                      reinterpret_cast<uintptr_t>(args.c) % (2 * c_bytes) == 0;
  constexpr size_t kPairBytes = 2 * sizeof(typename Cfg::Element);
  const bool paired_inputs = reinterpret_cast<uintptr_t>(args.bias) % kPairBytes == 0 &&
                             reinterpret_cast<uintptr_t>(args.residual) % kPairBytes == 0 && args.ld_residual % 2 == 0 &&
                             args.n % 2 == 0;
  const OutputParams out{args.c,        args.ldc,      args.batch_stride_c,   static_cast<int>(args.m),
                         static_cast<int>(args.n), args.c_f32, paired, tma_store, args.bias, args.residual,
                         args.residual != nullptr ? args.ld_residual : 0, paired_inputs, args.activation,
                         args.column_sums};
  const TileOrderOf<Cfg> order = tile_order_of<Cfg>(args);
  const int k_tiles = k_tiles_of<Cfg>(args);

  int64_t ctas = order.num_tiles() * Cfg::kClusterM;  // V5: one CTA per tile
  if constexpr (Cfg::kStreamK) {
    ctas = resident;  // every cluster takes a share of the tail
  } else if constexpr (Cfg::kPersistent) {
    ctas = std::min<int64_t>(ctas, resident);
  }
  int pieces = 1;
  if constexpr (Cfg::kSplitK) {
    pieces = split_k_pieces(order.num_tiles(), k_tiles, resident);
    ctas = order.num_tiles() * pieces;
  }
  if (ctas > kMaxGridX) return Status::Invalid("too many output tiles for one launch");
  WorkList work{order.num_tiles(), ctas / Cfg::kClusterM, k_tiles, false, Cfg::kMaxSplitsPerTile, pieces};
  work.a_box_rows = a_box_rows;
  StreamKParams stream_k{nullptr, nullptr};
  int cluster_size = Cfg::kClusterM;
  if constexpr (Cfg::kSplitK) {
    st = choose_split_k_clusters<Cfg>(reinterpret_cast<const void*>(kernel), kSmem, resident, &work);
    if (st.ok()) st = prepare_split_k<Cfg>(args, stream, &work, &stream_k);
    if (!st.ok()) return st;
    ctas = work.num_tiles * work.pieces;
    work.clusters = ctas;  // one unit per CTA
    if (work.cluster_pieces) cluster_size = work.pieces;
  }
  if constexpr (Cfg::kStreamK) {
    st = prepare_stream_k<Cfg>(args, stream, &work, &stream_k);
    if (!st.ok()) return st;
  }
  uint32_t* tile_counter = nullptr;
  if constexpr (Cfg::kDynamicTiles) {
    st = prepare_tile_counter(args, stream, work, &tile_counter);
    if (!st.ok()) return st;
  }

  cudaLaunchAttribute attr;
  cudaLaunchConfig_t config = launch_config<Cfg>(ctas, cluster_size, kSmem, stream, &attr);
  config.numAttrs = cluster_size > 1 ? 1 : 0;  // no cluster attribute for clusters of one
  return cuda_status(cudaLaunchKernelEx(&config, kernel, tmap_a, tmap_b, tmap_c, out, work, order, stream_k,
                                        tmap_d, tile_counter),
                     "gemm kernel launch");
}

// The workspace a call of this shape needs on a device of `sms` SMs: the ticket
// counter, and the partial sums of the split that launch_gemm plans there (for split K,
// as though its pieces met in global memory; in clusters they need none).
template <class Cfg>
size_t workspace_bytes(const GemmArgs& args, int sms) {
  size_t bytes = partial_sums_offset<Cfg>();
  if (args.batch <= 0 || args.m <= 0 || args.n <= 0 || args.k <= 0 || sms <= 0) return bytes;
  const TileOrderOf<Cfg> order = tile_order_of<Cfg>(args);
  const int64_t resident = int64_t{sms} * Cfg::kCtasPerSm;
  if constexpr (Cfg::kSplitK) {
    const int pieces = split_k_pieces(order.num_tiles(), k_tiles_of<Cfg>(args), static_cast<int>(resident));
    if (pieces > 1) bytes += split_k_bytes<Cfg>(order.num_tiles(), pieces);
  }
  if constexpr (Cfg::kStreamK) {
    using Fixup = StreamKFixup<Cfg>;
    const int64_t clusters = resident / Cfg::kClusterM;
    bytes += Fixup::workspace_bytes(clusters) + Fixup::flag_count(clusters) * sizeof(uint32_t);
  }
  return bytes;
}

// A grouped product (ragged_dot; gemm.h: GemmArgs::group_sizes). Ragged rows: A [m, k]
// K-major, B `groups` entries batch_stride_b apart, C [m, n]. The ragged contraction:
// A [k, m] and B [k, n], both MN-major (k: the rows the groups split), C `groups`
// entries [m, n] batch_stride_c apart. One CTA per SM in 2-CTA clusters, or fewer where
// the product has fewer tiles at most (the group sizes are unknown here).
template <class Cfg>
Status launch_grouped(const GemmArgs& args, cudaStream_t stream) {
  using LayoutA = typename Cfg::LayoutA;
  using LayoutB = typename Cfg::LayoutB;
  if (args.groups < 1 || args.groups > kMaxGroups)
    return Status::Invalid("grouped products take 1 to " + std::to_string(kMaxGroups) + " groups, got " +
                           std::to_string(args.groups));
  CUtensorMap tmap_a, tmap_b;
  Status st = encode_operand<LayoutA>(&tmap_a, args.a, args.m, args.k, args.lda, 1, 0);
  if (!st.ok()) return st;
  // Ragged rows: B has an entry per group, or per group of a period but its gap.
  const int64_t b_entries = Cfg::kRaggedK ? 1 : (args.group_period > 0 ? args.group_period - 1 : args.groups);
  st = encode_operand<LayoutB>(&tmap_b, args.b, args.n, args.k, args.ldb, b_entries,
                               Cfg::kRaggedK ? 0 : args.batch_stride_b);
  if (!st.ok()) return st;

  constexpr size_t kSmem = smem_bytes<Cfg>();
  static_assert(kSmem <= kMaxSmemPerBlock, "pipeline stages and the group table do not fit in shared memory");
  const auto kernel = grouped_kernel<Cfg>;
  int resident = 0;
  st = prepare_device<Cfg>(reinterpret_cast<const void*>(kernel), kSmem, &resident);
  if (!st.ok()) return st;

  const int64_t m_blocks = ceil_div(args.m, Cfg::kBlockM), n_blocks = ceil_div(args.n, Cfg::kBlockN);
  // Cluster tiles at most. Ragged rows: group g has ceil(ceil(s_g / BM) / 2) row pairs,
  // which sum to at most (m_blocks + 2 G) / 2 however the rows fall.
  const int64_t row_pairs = Cfg::kRaggedK ? args.groups * ceil_div(m_blocks, Cfg::kClusterM)
                                          : (m_blocks + 2 * args.groups) / Cfg::kClusterM;
  const int64_t most_tiles = row_pairs * n_blocks;
  if (most_tiles > INT32_MAX) return Status::Invalid("too many output tiles for one grouped launch");
  const int64_t clusters = std::max<int64_t>(1, std::min<int64_t>(resident / Cfg::kClusterM, most_tiles));
  const GroupedWork work{static_cast<const int32_t*>(args.group_sizes),
                         static_cast<int>(args.groups),
                         static_cast<int>(Cfg::kRaggedK ? args.k : args.m),
                         static_cast<int>(args.m),
                         static_cast<int>(ceil_div(args.k, Cfg::kBlockK)),
                         static_cast<int>(m_blocks),
                         static_cast<int>(n_blocks),
                         static_cast<int>(clusters),
                         static_cast<int>(args.group_period)};
  const size_t c_bytes = args.c_f32 ? sizeof(float) : sizeof(typename Cfg::Element);
  const bool paired = args.ldc % 2 == 0 && args.batch_stride_c % 2 == 0 &&
                      reinterpret_cast<uintptr_t>(args.c) % (2 * c_bytes) == 0;
  const OutputParams out{args.c,  args.ldc, Cfg::kRaggedK ? args.batch_stride_c : 0, static_cast<int>(args.m),
                         static_cast<int>(args.n), args.c_f32, paired, false, nullptr, nullptr, 0, false,
                         Activation::kNone, nullptr};
  cudaLaunchAttribute attr;
  cudaLaunchConfig_t config = launch_config<Cfg>(clusters * Cfg::kClusterM, Cfg::kClusterM, kSmem, stream, &attr);
  return cuda_status(cudaLaunchKernelEx(&config, kernel, tmap_a, tmap_b, out, work), "grouped kernel launch");
}

// The symbol each generated translation unit instantiates (instance.cu.in).
template <KernelKind kKind, ElementType kType, Major kMajorA, Major kMajorB, int kStages>
Status launch_gemm_instance(const GemmArgs& args, cudaStream_t stream) {
  using Cfg = GemmConfig<kKind, typename ElementOf<kType>::type, kMajorA, kMajorB, kStages>;
  if constexpr (Cfg::kGrouped) {
    return launch_grouped<Cfg>(args, stream);
  } else {
    return launch_gemm<Cfg>(args, stream);
  }
}

template <KernelKind kKind, ElementType kType, Major kMajorA, Major kMajorB, int kStages>
size_t workspace_bytes_instance(const GemmArgs& args, int sms) {
  return workspace_bytes<GemmConfig<kKind, typename ElementOf<kType>::type, kMajorA, kMajorB, kStages>>(args, sms);
}

}  // namespace jax_hopper
