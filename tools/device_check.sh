#!/usr/bin/env bash
# Build, GPU tests and benchmark in one go on a Hopper machine; logs go to $1
# (default: $OUT, else ./device-out). Extra benchmark arguments come from BENCH_ARGS,
# extra pytest arguments from PYTEST_ARGS (split on spaces), a -k expression from
# PYTEST_K, test paths from TESTS (default: tests/gpu, then tests/cpu, which on a Hopper
# runs our kernel), pytest-xdist workers per file from TEST_WORKERS (default 2: the reliability tests each hold several GB);
# SANITIZE=1 adds the compute-sanitizer pass,
# SKIP_TESTS=1 / SKIP_BENCH=1 leave those out; TEST_TIMEOUT (s, default 900) bounds the
# tests, each file of which runs in its own process and leaves $LOG/<file>.log (with its
# 10 slowest tests); TEST_XLA_FLAGS become XLA_FLAGS for the tests only (e.g.
# --xla_gpu_autotune_level=0: the jnp references then skip XLA's GEMM autotuning, which
# is compile time, not correctness; never for the benchmark). Exits non-zero if a build,
# smoke test, sanitizer tool or test fails. FUZZ_SECONDS=N adds N seconds of the
# differential fuzz (tests/fuzz.py, seed FUZZ_SEED, default 0) after the tests.
# BUILD_ARGS go to pip (e.g. "-C cmake.define.JAX_HOPPER_BOUNDED_WAITS=ON
# -C cmake.define.JAX_HOPPER_EXPERIMENTAL_KERNELS=ON": the debug build the fuzz runs on
# once per session, with every kind). BENCH_COMMAND_BUFFERS=1 runs the benchmark twice,
# with XLA's command buffers as it sets them and with them off (bench.json and
# bench_no_command_buffers.json). RAGGED_CASES="mixtral_up olmoe ..." runs
# tools/bench_ragged.py one process per case (ragged_<case>.json; all: "all"), each bounded
# by RAGGED_CASE_TIMEOUT (s, default 100), and RAGGED_MOE=TOKENSxDxHxExTOPK the MoE
# training step (ragged_moe.json), after the tests and before the benchmark.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
LOG=${1:-${OUT:-$REPO/device-out}}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1
# The device tool returns at most 8 files from $OUT, the first by name: on exit, every
# log is also packed into one archive whose name sorts first.
ARCHIVE=00-logs.tar.gz
trap '(cd "$LOG" && tar czf "$ARCHIVE" --exclude "$ARCHIVE" -- *) 2>/dev/null' EXIT

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu \
  --format=csv | tee "$LOG/gpu.txt"
echo "commit: ${COMMIT:-unknown (set COMMIT)}" | tee "$LOG/commit.txt"

start=$(date +%s)
# A build with BUILD_ARGS gets a build directory of its own: CMake's cache would carry
# its options into the next plain build.
if ! (cd "$REPO" && python3 -m pip install --no-build-isolation --no-deps -v \
      ${BUILD_ARGS:+-C build-dir=build/custom $BUILD_ARGS} .) >"$LOG/build.log" 2>&1; then
  tail -60 "$LOG/build.log"
  exit 1
fi
echo "build: $(($(date +%s) - start)) s"
grep -E "ptxas info *: Used|spill|C7517|C7520" "$LOG/build.log" | sort | uniq -c

cd /tmp || exit 1  # import the installed package, not the source tree
if ! timeout 120 python3 "$REPO/tools/smoke_gpu.py" 2>&1 | tee "$LOG/smoke.log"; then
  echo "smoke test failed or hung: stopping"
  exit 1
fi
rc=0
if [ "${SANITIZE:-0}" = 1 ]; then
  bash "$REPO/tools/sanitize.sh" "$LOG" || rc=1
fi
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # One pytest process per test file: a crash in XLA (an abort) then loses one file, not
  # the whole run's summary. --capture=sys leaves C++ stderr (XLA's fatal messages)
  # uncaptured, so it reaches the log. TEST_TIMEOUT bounds all files together.
  files=()  # TESTS paths are relative to the repository (this script runs from /tmp)
  for t in ${TESTS:-tests/gpu tests/cpu}; do
    if [ -d "$REPO/$t" ]; then files+=("$REPO/$t"/test_*.py); else files+=("$REPO/$t"); fi
  done
  deadline=$(($(date +%s) + ${TEST_TIMEOUT:-900}))
  for f in "${files[@]}"; do
    name=$(basename "$f" .py)
    left=$((deadline - $(date +%s)))
    if [ "$left" -le 0 ]; then echo "$name: NOT RUN (TEST_TIMEOUT reached)"; rc=1; continue; fi
    XLA_FLAGS="${TEST_XLA_FLAGS:-${XLA_FLAGS:-}}" JAX_HOPPER_REQUIRE_GPU=1 timeout "$left" \
      python3 -m pytest "$f" -q -ra --durations=10 --capture=sys -n "${TEST_WORKERS:-2}" ${PYTEST_ARGS:-} ${PYTEST_K:+-k "$PYTEST_K"} \
      >"$LOG/$name.log" 2>&1
    test_rc=$?
    summary=$(grep -E "^(=+ )?[0-9]+ (passed|failed|skipped|deselected|error)" "$LOG/$name.log" | tail -1)
    case $test_rc in
      0 | 5) echo "$name: $summary" ;;  # 5: every test deselected by PYTEST_ARGS
      124) echo "$name: TIMED OUT (the log ends where it was killed)"; rc=1 ;;
      1) echo "$name: $summary"; grep -E "^(FAILED|ERROR)" "$LOG/$name.log"; rc=1 ;;
      *) echo "$name: CRASHED (exit $test_rc)"; grep -E "Check failed|Fatal|Segmentation|Aborted" "$LOG/$name.log" | head -5; rc=1 ;;
    esac
  done
fi
if [ -n "${FUZZ_SECONDS:-}" ]; then
  # Its own budget plus a margin for the case running when it ends (a hang: the case
  # after the log's last, reproducible with --only).
  XLA_FLAGS="${TEST_XLA_FLAGS:-${XLA_FLAGS:-}}" timeout $((FUZZ_SECONDS + 120)) python3 "$REPO/tests/fuzz.py" --seconds "$FUZZ_SECONDS" \
    --seed "${FUZZ_SEED:-0}" --json "$LOG/fuzz.json" >"$LOG/fuzz.log" 2>&1
  fuzz_rc=$?
  grep -E "FAIL|cases \(" "$LOG/fuzz.log" | tail -40
  [ "$fuzz_rc" = 0 ] || { echo "fuzz: exit $fuzz_rc (log: fuzz.log)"; tail -5 "$LOG/fuzz.log"; rc=1; }
fi
if [ -n "${RAGGED_CASES:-}" ] || [ -n "${RAGGED_MOE:-}" ]; then
  cases=${RAGGED_CASES:-}
  [ "$cases" = all ] && cases=$(python3 -c "import sys; sys.path.insert(0, '$REPO/tools'); import bench_ragged; print(' '.join(c.name for c in bench_ragged.CASES))")
  for c in $cases; do
    timeout "${RAGGED_CASE_TIMEOUT:-100}" python3 "$REPO/tools/bench_ragged.py" --cases "$c" --samples 5 \
      ${COMMIT:+--commit "$COMMIT"} --json "$LOG/ragged_$c.json" 2>"$LOG/ragged_$c.err" | tee -a "$LOG/ragged.log"
    case_rc=${PIPESTATUS[0]}
    [ "$case_rc" = 0 ] || { echo "bench_ragged $c: exit $case_rc (ragged_$c.err)"; rc=1; }
  done
  if [ -n "${RAGGED_MOE:-}" ]; then
    timeout "${RAGGED_CASE_TIMEOUT:-100}" python3 "$REPO/tools/bench_ragged.py" --moe "$RAGGED_MOE" --samples 5 \
      ${COMMIT:+--commit "$COMMIT"} --json "$LOG/ragged_moe.json" 2>"$LOG/ragged_moe.err" | tee -a "$LOG/ragged.log"
    [ "${PIPESTATUS[0]}" = 0 ] || { echo "bench_ragged --moe: failed (ragged_moe.err)"; rc=1; }
  fi
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout 900 python3 "$REPO/tools/bench.py" ${BENCH_ARGS:-} ${COMMIT:+--commit "$COMMIT"} --json "$LOG/bench.json" \
    2>"$LOG/bench.err" |
    tee "$LOG/bench.log"
  if [ "${BENCH_COMMAND_BUFFERS:-0}" = 1 ]; then
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" timeout 900 python3 "$REPO/tools/bench.py" \
      ${BENCH_ARGS:-} ${COMMIT:+--commit "$COMMIT"} --json "$LOG/bench_no_command_buffers.json" \
      2>"$LOG/bench_no_command_buffers.err" | tee "$LOG/bench_no_command_buffers.log"
  fi
fi
exit $rc
