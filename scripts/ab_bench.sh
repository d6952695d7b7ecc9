#!/usr/bin/env bash
# A/B of a device-code experiment in one device call: the working tree as it is (A) and a
# copy with PATCH applied (B; `git diff` output, applied with patch -p1), each built and
# installed in turn, each running the same benchmark (and optionally the same tests) in
# its own process. Ratios are against jnp in the same process, so A and B compare through
# them even if the machine drifts between runs; REPEAT=2 runs A, B, A, B to show the drift.
#   bash scripts/ab_bench.sh OUTDIR PATCH -- BENCH_ARGS...
#   e.g. bash scripts/ab_bench.sh $OUT /tmp/inline.patch -- --shapes= --no-torch \
#          --mlp 8192x4096x16384 --mlp-activations gelu_exact --mlp-steps "dense1 act and act'"
# AB_TESTS (paths relative to the repository, e.g. tests/test_mlp_gpu.py) and AB_K (a -k
# expression) run on B before its benchmark: a B that computes wrong answers is not timed.
# Each build takes ~30 s on a 16-core device machine; logs and JSON per run in OUTDIR.
# B stays installed afterwards (AB_RESTORE=1 reinstalls A).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
LOG=${1:?usage: ab_bench.sh OUTDIR PATCH -- BENCH_ARGS...}
PATCH=$(realpath "${2:?usage: ab_bench.sh OUTDIR PATCH -- BENCH_ARGS...}")
shift 2
[ "${1:-}" = "--" ] && shift
mkdir -p "$LOG"
B_TREE=$(mktemp -d)/tree
cp -r "$REPO" "$B_TREE"
rm -rf "$B_TREE/build"  # a stale CMake cache would point at the original tree
if ! (cd "$B_TREE" && patch -p1 --forward <"$PATCH") >"$LOG/patch.log" 2>&1; then
  cat "$LOG/patch.log"
  exit 1
fi

run() {  # run NAME TREE: install TREE, then (for B) its tests, then the benchmark
  local name=$1 tree=$2
  shift 2
  if ! (cd "$tree" && python3 -m pip install --no-build-isolation --no-deps -v .) >"$LOG/build_$name.log" 2>&1; then
    echo "$name: build failed"; tail -30 "$LOG/build_$name.log"; return 1
  fi
  echo "$name: built; $(grep -cE 'spill stores' "$LOG/build_$name.log") ptxas reports (0: nothing recompiled)," \
    "$(grep -E '[1-9][0-9]* bytes spill' "$LOG/build_$name.log" | wc -l) with spills," \
    "$(grep -cE 'C7517|C7520' "$LOG/build_$name.log") serialization warnings"
  if [[ $name == B* ]] && [ -n "${AB_TESTS:-}" ]; then
    local files=()
    for t in $AB_TESTS; do files+=("$tree/$t"); done
    (cd /tmp && JAX_HOPPER_REQUIRE_GPU=1 timeout "${AB_TEST_TIMEOUT:-200}" python3 -m pytest -q --capture=sys \
      "${files[@]}" ${AB_K:+-k "$AB_K"}) >"$LOG/tests_$name.log" 2>&1
    local rc=$?
    echo "$name tests: exit $rc, $(grep -E '[0-9]+ (passed|failed)' "$LOG/tests_$name.log" | tail -1)"
    [ $rc -eq 0 ] || { grep -E "^(FAILED|ERROR)" "$LOG/tests_$name.log" | head; return 1; }
  fi
  (cd /tmp && timeout "${AB_BENCH_TIMEOUT:-240}" python3 -m jax_hopper.bench "$@" --json "$LOG/bench_$name.json") \
    >"$LOG/bench_$name.log" 2>"$LOG/bench_$name.err"
  echo "== $name"
  sed -n '/^summary/,$p' "$LOG/bench_$name.log" | grep -v '^-' | tail -n +2
}

rc=0
for i in $(seq "${REPEAT:-1}"); do
  run "A$i" "$REPO" "$@" || rc=1
  run "B$i" "$B_TREE" "$@" || rc=1
done
# B stays installed unless AB_RESTORE=1 (another ~30 s) reinstalls A for later commands.
if [ "${AB_RESTORE:-0}" = 1 ]; then
  (cd "$REPO" && python3 -m pip install --no-build-isolation --no-deps .) >"$LOG/build_restore.log" 2>&1 ||
    { echo "reinstalling A failed"; rc=1; }
fi
exit $rc
