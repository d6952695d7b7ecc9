#!/usr/bin/env bash
# The ping-pong kind (128x128 tile per consumer warpgroup, the two warpgroups taking the
# CTA's tiles in turn; merged in f7df98f, measured slower than the default: BENCHMARKS.md in git history)
# -- correctness first (the selectable-kernel tests: 8192^3, partial tiles, a tile past
# M), then kernel time against the default and jnp.dot. About 40 s of build, <= 120 s of
# tests, <= 200 s of benchmark: one 600 s device call.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
LOG=${1:-${OUT:-$REPO/device-out}}
mkdir -p "$LOG"
(cd "$REPO" && python3 -m pip install --no-build-isolation --no-deps .) >"$LOG/build.log" 2>&1 || { tail -30 "$LOG/build.log"; exit 1; }
cd /tmp || exit 1
JAX_HOPPER_REQUIRE_GPU=1 timeout 150 python3 -m pytest -q --capture=sys "$REPO/tests/test_numerics_gpu.py" \
  -k "pingpong" >"$LOG/tests.log" 2>&1
rc=$?
echo "pingpong tests: exit $rc $(grep -E '[0-9]+ (passed|failed)' "$LOG/tests.log" | tail -1)"
[ $rc -eq 0 ] || { grep -E "^(FAILED|ERROR)|Error" "$LOG/tests.log" | head; exit 1; }
timeout 240 python3 -m jax_hopper.bench --shapes "${SHAPES:-4096,8192,2048,6144,4096x14336x4096,8192x8192x1024}" \
  --kernels persistent_pingpong --samples 9 --rounds 1 --no-torch --json "$LOG/bench.json" 2>"$LOG/bench.err" |
  tee "$LOG/bench.log" | grep -E "persistent_pingpong|kernel persistent|jnp.dot|shape"
