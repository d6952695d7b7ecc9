#!/usr/bin/env bash
# A/B of device-code experiments in one device call: the working tree as it is (A) and a
# copy per PATCH (B, C, ...: `git diff` output against the tree, applied with patch -p1),
# each built and installed in turn, each running the same benchmark (and optionally the
# same tests) in its own process. Ratios are against jnp in the same process, so the
# variants compare through them even if the machine drifts between runs; REPEAT=2 runs
# A, B, ..., A, B, ... to show the drift.
#   bash tools/ab_bench.sh OUTDIR PATCH [PATCH ...] -- BENCH_ARGS...
#   e.g. bash tools/ab_bench.sh $OUT /tmp/inline.patch -- --shapes= --no-torch \
#          --mlp 8192x4096x16384 --mlp-activations gelu_exact --mlp-steps "dense1 act and act'"
# AB_TESTS (paths relative to the repository, e.g. tests/test_mlp_gpu.py) and AB_K (a -k
# expression) run on every patched variant before its benchmark, with AB_TEST_XLA_FLAGS
# as their XLA_FLAGS (e.g. --xla_gpu_autotune_level=0): a variant that computes wrong
# answers is not timed. Each build takes ~30 s on a 16-core device machine; logs and
# JSON per run in OUTDIR. The last variant stays installed (AB_RESTORE=1 reinstalls A).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
USAGE="usage: ab_bench.sh OUTDIR PATCH [PATCH ...] -- BENCH_ARGS..."
LOG=${1:?$USAGE}
shift
mkdir -p "$LOG"
names=(A)
trees=("$REPO")
letters=(B C D E F G H)
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  i=$((${#names[@]} - 1))
  [ "$i" -lt ${#letters[@]} ] || { echo "at most ${#letters[@]} patches"; exit 1; }
  name=${letters[$i]}
  patch_file=$(realpath "$1")
  tree=$(mktemp -d)/tree
  cp -r "$REPO" "$tree"
  rm -rf "$tree/build"  # a stale CMake cache would point at the original tree
  if ! (cd "$tree" && patch -p1 --forward <"$patch_file") >"$LOG/patch_$name.log" 2>&1; then
    cat "$LOG/patch_$name.log"
    exit 1
  fi
  echo "$name = A + $(basename "$patch_file")"
  names+=("$name")
  trees+=("$tree")
  shift
done
[ "${#names[@]}" -gt 1 ] || { echo "$USAGE"; exit 1; }
[ "${1:-}" = "--" ] && shift

run() {  # run NAME TREE: install TREE, then (patched variants) its tests, then the benchmark
  local name=$1 tree=$2
  shift 2
  if ! (cd "$tree" && python3 -m pip install --no-build-isolation --no-deps -v .) >"$LOG/build_$name.log" 2>&1; then
    echo "$name: build failed"; tail -30 "$LOG/build_$name.log"; return 1
  fi
  echo "$name: built; $(grep -cE 'spill stores' "$LOG/build_$name.log") ptxas reports (0: nothing recompiled)," \
    "$(grep -E '[1-9][0-9]* bytes spill' "$LOG/build_$name.log" | wc -l) with spills," \
    "$(grep -cE 'C7517|C7520' "$LOG/build_$name.log") serialization warnings"
  if [[ $name != A* ]] && [ -n "${AB_TESTS:-}" ]; then
    local files=()
    for t in $AB_TESTS; do files+=("$tree/$t"); done
    (cd /tmp && XLA_FLAGS="${AB_TEST_XLA_FLAGS:-${XLA_FLAGS:-}}" JAX_HOPPER_REQUIRE_GPU=1 timeout "${AB_TEST_TIMEOUT:-200}" python3 -m pytest -q --capture=sys \
      "${files[@]}" ${AB_K:+-k "$AB_K"}) >"$LOG/tests_$name.log" 2>&1
    local rc=$?
    echo "$name tests: exit $rc, $(grep -E '[0-9]+ (passed|failed)' "$LOG/tests_$name.log" | tail -1)"
    [ $rc -eq 0 ] || { grep -E "^(FAILED|ERROR)" "$LOG/tests_$name.log" | head; return 1; }
  fi
  (cd /tmp && timeout "${AB_BENCH_TIMEOUT:-240}" python3 "$REPO/tools/bench.py" "$@" --json "$LOG/bench_$name.json") \
    >"$LOG/bench_$name.log" 2>"$LOG/bench_$name.err"
  echo "== $name"
  sed -n '/^summary/,$p' "$LOG/bench_$name.log" | grep -v '^-' | tail -n +2
}

rc=0
for i in $(seq "${REPEAT:-1}"); do
  for v in "${!names[@]}"; do
    run "${names[$v]}$i" "${trees[$v]}" "$@" || rc=1
  done
done
# The last variant stays installed unless AB_RESTORE=1 (another ~30 s) reinstalls A.
if [ "${AB_RESTORE:-0}" = 1 ]; then
  (cd "$REPO" && python3 -m pip install --no-build-isolation --no-deps .) >"$LOG/build_restore.log" 2>&1 ||
    { echo "reinstalling A failed"; rc=1; }
fi
exit $rc
