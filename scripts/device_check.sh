#!/usr/bin/env bash
# Build, GPU tests and benchmark in one go on a Hopper machine; logs go to $1
# (default: $OUT, else ./device-out). Extra benchmark arguments come from BENCH_ARGS,
# extra pytest arguments from PYTEST_ARGS, test paths from TESTS; SANITIZE=1 adds the compute-sanitizer pass,
# SKIP_TESTS=1 / SKIP_BENCH=1 leave those out. Exits non-zero if a build, smoke test,
# sanitizer tool or test fails.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
LOG=${1:-${OUT:-$REPO/device-out}}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu \
  --format=csv | tee "$LOG/gpu.txt"
echo "commit: ${COMMIT:-unknown (set COMMIT)}" | tee "$LOG/commit.txt"

start=$(date +%s)
if ! (cd "$REPO" && python3 -m pip install --no-build-isolation --no-deps -v .) >"$LOG/build.log" 2>&1; then
  tail -60 "$LOG/build.log"
  exit 1
fi
echo "build: $(($(date +%s) - start)) s"
grep -E "ptxas info *: Used|spill|C7517" "$LOG/build.log" | sort | uniq -c

cd /tmp || exit 1  # import the installed package, not the source tree
if ! timeout 120 python3 "$REPO/scripts/smoke_gpu.py" 2>&1 | tee "$LOG/smoke.log"; then
  echo "smoke test failed or hung: stopping"
  exit 1
fi
rc=0
if [ "${SANITIZE:-0}" = 1 ]; then
  bash "$REPO/scripts/sanitize.sh" "$LOG" || rc=1
fi
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  tests=()  # TESTS paths are relative to the repository (this script runs from /tmp)
  for t in ${TESTS:-tests}; do tests+=("$REPO/$t"); done
  JAX_HOPPER_REQUIRE_GPU=1 timeout "${TEST_TIMEOUT:-900}" python3 -m pytest "${tests[@]}" -q -ra ${PYTEST_ARGS:-} 2>&1 |
    tee "$LOG/tests.log" | grep -v -E "^\.|PASSED" | tail -40
  test_rc=${PIPESTATUS[0]}
  # A run cut off by the timeout prints no summary: say so, or it reads like a pass.
  [ "$test_rc" -eq 124 ] && echo "TESTS TIMED OUT after ${TEST_TIMEOUT:-900} s: tests.log ends where they were killed"
  [ "$test_rc" -eq 0 ] || rc=1
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout 900 python3 -m jax_hopper.bench ${BENCH_ARGS:-} --json "$LOG/bench.json" 2>"$LOG/bench.err" |
    tee "$LOG/bench.log"
fi
exit $rc
