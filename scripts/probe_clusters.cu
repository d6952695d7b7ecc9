// How many clusters of 1-8 CTAs of the small-M kind fit on this GPU at once (the split-K
// cluster rule's capacity, launch.cuh: choose_split_k_clusters). Build and run on the GPU:
//   nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icuda --expt-relaxed-constexpr scripts/probe_clusters.cu -o /tmp/probe && /tmp/probe
#include <cstdio>

#include "gemm/launch.cuh"

int main() {
  using namespace jax_hopper;
  using Cfg = GemmConfig<KernelKind::kSmallM, __half, Major::kK, Major::kMN, 4>;
  const auto kernel = reinterpret_cast<const void*>(gemm_kernel<Cfg>);
  constexpr size_t kSmem = smem_bytes<Cfg>();
  int resident = 0;
  Status st = prepare_device<Cfg>(kernel, kSmem, &resident);
  if (!st.ok()) {
    std::printf("error: %s\n", st.message.c_str());
    return 1;
  }
  std::printf("small_m: %zu bytes of shared memory, %d CTAs resident alone\n", kSmem, resident);
  for (int size = 1; size <= kMaxClusterPieces; ++size) {
    int clusters = 0;
    st = query_active_clusters<Cfg>(kernel, kSmem, size, &clusters);
    if (!st.ok()) {
      std::printf("error: %s\n", st.message.c_str());
      return 1;
    }
    std::printf("clusters of %d: %d at once (%d CTAs)\n", size, clusters, clusters * size);
  }
  return 0;
}
