#!/usr/bin/env bash
# compute-sanitizer's four tools over scripts/sanitize_products.py, checking only our
# kernels (kns=gemm_kernel); one log per tool in $1 (default $OUT). Run after
# installing the package (scripts/device_check.sh does).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
LOG=${1:-${OUT:-$REPO/device-out}}
mkdir -p "$LOG"
cd /tmp || exit 1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
status=0
for tool in memcheck racecheck synccheck initcheck; do
  timeout "${SANITIZE_TIMEOUT:-120}" compute-sanitizer --tool "$tool" --kernel-name kns=gemm_kernel \
    --error-exitcode 9 python3 "$REPO/scripts/sanitize_products.py" >"$LOG/sanitize_$tool.log" 2>&1
  rc=$?
  echo "compute-sanitizer $tool: exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOG/sanitize_$tool.log" | tail -1)"
  [ $rc -eq 0 ] || status=1
done
exit $status
