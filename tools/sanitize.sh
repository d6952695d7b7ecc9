#!/usr/bin/env bash
# compute-sanitizer's four tools (SANITIZE_TOOLS) over tools/sanitize_products.py, checking
# only our kernels (kns=jax_hopper: the dense and grouped kernels; initcheck: all); one log per tool in $1 (default $OUT). Run after
# installing the package (tools/device_check.sh does).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
LOG=${1:-${OUT:-$REPO/device-out}}
mkdir -p "$LOG"
cd /tmp || exit 1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
status=0
for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}; do
  # initcheck instruments every kernel: a write it does not see (XLA's kernels filling
  # our bias and residual operands, had only gemm_kernel been instrumented) leaves the
  # memory "uninitialized" to it, and every later read a false report.
  filter=(--kernel-name kns=jax_hopper)
  [ "$tool" = initcheck ] && filter=()
  timeout "${SANITIZE_TIMEOUT:-120}" compute-sanitizer --tool "$tool" "${filter[@]}" \
    --error-exitcode 9 python3 "$REPO/tools/sanitize_products.py" >"$LOG/sanitize_$tool.log" 2>&1
  rc=$?
  echo "compute-sanitizer $tool: exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOG/sanitize_$tool.log" | tail -1);" \
    "printed reports in our kernels: $(grep -c 'at void jax_hopper::' "$LOG/sanitize_$tool.log")"
  [ $rc -eq 0 ] || status=1
done
exit $status
