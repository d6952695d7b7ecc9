#!/usr/bin/env bash
# The small-M (decode) kind on the GPU: build, its numerics tests, then the benchmark on
# decode shapes for each JAX_HOPPER_SPLIT_K_WAVES in $WAVES (pieces per resident CTA;
# cuda/gemm/launch.cuh: split_k_pieces), against jnp.dot in the same process each time.
# Logs under $OUT (or ./device-out).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
LOG=${OUT:-$REPO/device-out}
mkdir -p "$LOG"
SHAPES=${SHAPES:-1x8192x8192,16x8192x8192,64x8192x8192,128x8192x8192,16x4096x4096,16x14336x4096,16x4096x14336,64x4096x14336}
SKIP_BENCH=1 TESTS=${TESTS:-tests/test_numerics_gpu.py} PYTEST_K=${PYTEST_K:-small_m} \
  TEST_XLA_FLAGS=--xla_gpu_autotune_level=0 bash "$REPO/scripts/device_check.sh" "$LOG"
rc=$?
[ "$rc" = 0 ] || exit "$rc"  # no benchmark of a kernel that failed its tests
cd /tmp || exit 1
for w in ${WAVES:-4}; do
  echo "== JAX_HOPPER_SPLIT_K_WAVES=$w"
  JAX_HOPPER_SPLIT_K_WAVES=$w timeout 300 python3 -m jax_hopper.bench --shapes "$SHAPES" --dtype "${DTYPES:-f16}" \
    --kernels small_m --stages "" --samples "${SAMPLES:-9}" --rounds 1 --no-torch --json "$LOG/decode_w$w.json" \
    2>"$LOG/decode_w$w.err" | grep -E "small_m|jnp.dot|case" | tee "$LOG/decode_w$w.log"
done
exit $rc
