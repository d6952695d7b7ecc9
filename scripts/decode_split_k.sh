#!/usr/bin/env bash
# The small-M (decode) kind on the GPU: build, its numerics tests, the cluster capacity
# probe, then the benchmark on decode shapes once per setting in $SETTINGS (each
# "default" or an environment assignment such as JAX_HOPPER_SPLIT_K_CLUSTER=0,
# JAX_HOPPER_SPLIT_K_WAVES=2, JAX_HOPPER_SPLIT_K_PIECES=4 or JAX_HOPPER_SMALL_M_WHOLE_A=1:
# cuda/gemm/launch.cuh), against jnp.dot in the same
# process each time; L2 is "warm", "cold" (the operands evicted from L2 before each timed
# call: bench --l2) or both ("warm cold"). Logs under $OUT (or ./device-out).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
LOG=${OUT:-$REPO/device-out}
mkdir -p "$LOG"
SHAPES=${SHAPES:-1x8192x8192,16x8192x8192,64x8192x8192,128x8192x8192,16x4096x4096,16x14336x4096,16x4096x14336,64x4096x14336}
SKIP_BENCH=1 TESTS=${TESTS:-tests/test_numerics_gpu.py} PYTEST_K=${PYTEST_K:-small_m} \
  TEST_XLA_FLAGS=--xla_gpu_autotune_level=0 bash "$REPO/scripts/device_check.sh" "$LOG"
rc=$?
[ "$rc" = 0 ] || exit "$rc"  # no benchmark of a kernel that failed its tests
GEN=$(mktemp -d) && mkdir -p "$GEN/gemm" && python3 "$REPO/jax_hopper/_kernels.py" header "$GEN/gemm/kernel_kinds.h" || exit 1
cd /tmp || exit 1
nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I"$REPO/cuda" -I"$GEN" --expt-relaxed-constexpr \
  "$REPO/scripts/probe_clusters.cu" -o /tmp/probe_clusters && /tmp/probe_clusters | tee "$LOG/clusters.txt"
for l2 in ${L2:-warm}; do
  for setting in ${SETTINGS:-default}; do
    echo "== $setting, L2 $l2"
    tag=${setting//[^A-Za-z0-9]/_}_$l2
    envs=()
    [ "$setting" = default ] || envs=("$setting")
    env "${envs[@]}" timeout 300 python3 -m jax_hopper.bench --shapes "$SHAPES" --dtype "${DTYPES:-f16}" \
      --kernels small_m --stages "" --samples "${SAMPLES:-9}" --rounds 1 --no-torch --l2 "$l2" \
      --json "$LOG/decode_$tag.json" \
      2>"$LOG/decode_$tag.err" | grep -E "small_m|jnp.dot|case" | tee "$LOG/decode_$tag.log"
  done
done
# device_check.sh packed its logs at its exit; pack again with the benchmark's.
(cd "$LOG" && tar czf 00-logs.tar.gz --exclude 00-logs.tar.gz -- *) 2>/dev/null
exit $rc
