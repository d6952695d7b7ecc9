#!/usr/bin/env bash
# Stall profile of a layer's kernels (profile_fused.py: by default our plain product, the
# fused kernel and the derivative kind): writes $1/warp_state.txt (clock, duration and
# warp state statistics per kernel) and $1/source.csv.gz (per-SASS-line stall samples by
# reason, every kernel; tools/ncu_source_summary.py reads it). Usage: ncu_fused.sh OUTDIR
# [activation] [TOKENSxDMODELxDFF] [forms].
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUTDIR=${1:?output directory}
cd /tmp || exit 1
timeout 300 ncu --profile-from-start off --clock-control none --section SpeedOfLight --section WarpStateStats \
  --section SourceCounters --import-source no -o /tmp/fused -f \
  python3 "$REPO/tools/profile_fused.py" "${2:-gelu_exact}" "${3:-8192x4096x16384}" "${4:-plain,act,both}" >"$OUTDIR/ncu_run.log" 2>&1
echo "ncu rc $?"
ncu -i /tmp/fused.ncu-rep --page details >"$OUTDIR/warp_state.txt" 2>&1
ncu -i /tmp/fused.ncu-rep --page source --csv --print-source sass >"$OUTDIR/source.csv" 2>&1
gzip -f "$OUTDIR/source.csv"
grep -E "gemm_kernel|SM Frequency|Stall|Warp Cycles|Issued|Duration" "$OUTDIR/warp_state.txt" | cut -c1-160 | head -80
