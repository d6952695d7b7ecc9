#!/usr/bin/env bash
# One device call that verifies a branch and collects Nsight Compute counters: build and
# smoke (device_check.sh), the tests in $FIRST_TESTS (with $FIRST_K as -k), then
# `ncu_gemm.sh custom` over $NCU_SHAPES for $NCU_KERNEL with $NCU_METRICS (default: time,
# DRAM and L2 traffic), then the tests in $LATER_TESTS while time is left. Logs under $OUT.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
LOG=${OUT:-$REPO/device-out}
mkdir -p "$LOG"
run_tests() {  # $1: test paths, $2: -k expression, $3: timeout (s)
  [ -n "$1" ] || return 0
  SKIP_BENCH=1 TESTS="$1" PYTEST_K="$2" TEST_TIMEOUT="$3" TEST_XLA_FLAGS=--xla_gpu_autotune_level=0 \
    bash "$REPO/scripts/device_check.sh" "$LOG"
}
run_tests "${FIRST_TESTS:-}" "${FIRST_K:-}" "${FIRST_TIMEOUT:-240}"
rc=$?
if [ -n "${NCU_SHAPES:-}" ]; then
  metrics=${NCU_METRICS:-gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_hit_rate.pct,l1tex__m_xbar2l1tex_read_bytes.sum,launch__grid_size,launch__cluster_dim_x}
  # shellcheck disable=SC2086
  NCU_LOG="$LOG/ncu.log" NCU_METRICS=$metrics NCU_TIMEOUT=${NCU_TIMEOUT:-180} \
    bash "$REPO/scripts/ncu_gemm.sh" custom --kernel "${NCU_KERNEL:-small_m}" $NCU_SHAPES | tee "$LOG/ncu_summary.txt"
fi
run_tests "${LATER_TESTS:-}" "${LATER_K:-}" "${LATER_TIMEOUT:-200}" || rc=1
(cd "$LOG" && tar czf 00-logs.tar.gz --exclude 00-logs.tar.gz -- *) 2>/dev/null
exit $rc
