#!/usr/bin/env bash
# Nsight Compute over tools/profile_gemm.py's steady-state window, with a metric preset:
#   bash tools/ncu_gemm.sh clock --kernel persistent 8192x8192x8192 4096x4096x4096
#   bash tools/ncu_gemm.sh l2 --kernel persistent,persistent_basic,v5 8192x8192x8192
#   bash tools/ncu_gemm.sh query 'lrc__|lts__t_requests'   # metric names on this GPU
#   NCU_METRICS=a.sum,b.sum bash tools/ncu_gemm.sh custom --kernel persistent 8192x8192x8192
# clock: duration, SM clock, active cycles (min/avg/max), tensor-pipe use, L2 and DRAM
# bytes, launch shape (what the session log's cuBLASLt comparison used: BENCHMARKS.md in git history); l2: where the L2
# traffic comes from (SM reads / writes, the other L2 partition via the fabric, hits); memory:
# duration, tensor-pipe use, DRAM bytes each way and DRAM throughput against its peak.
# Prints the per-kernel metric lines; the whole report goes to $NCU_LOG (default
# /tmp/ncu_gemm.log). NCU_TIMEOUT (s, default 240) bounds the run. NCU_SCRIPT (default
# tools/profile_gemm.py) names the launching script: tools/profile_ragged.py for the grouped
# kernel, with its own arguments.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
preset=${1:?usage: ncu_gemm.sh clock|l2|memory|custom [profile_gemm.py arguments] | query REGEX}
shift
if [ "$preset" = query ]; then  # ncu lists base names; a counter is read as NAME.sum etc.
  ncu --query-metrics | grep -E "${1:?a regular expression}"
  exit
fi
case $preset in
  clock) metrics=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,smsp__cycles_active.avg,sm__cycles_active.min,sm__cycles_active.max,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,dram__bytes_read.sum,launch__grid_size,launch__cluster_dim_x,launch__registers_per_thread ;;
  l2) metrics=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,lts__t_bytes.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_write.sum,lts__t_sectors_srcunit_ltcfabric.sum,lts__t_sectors_srcunit_tex_lookup_hit.sum,lts__t_sectors_srcunit_tex_lookup_miss.sum,l1tex__m_xbar2l1tex_read_bytes.sum,dram__bytes_read.sum ;;
  memory) metrics=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,launch__grid_size,launch__registers_per_thread ;;
  custom) metrics=${NCU_METRICS:?comma-separated metric names} ;;
  *) echo "unknown preset $preset (clock, l2, memory, custom, query)" >&2; exit 2 ;;
esac
log=${NCU_LOG:-/tmp/ncu_gemm.log}
cd /tmp || exit 1  # the installed package, not the source tree
timeout "${NCU_TIMEOUT:-240}" ncu --profile-from-start off --clock-control none --metrics "$metrics" \
  python3 "$REPO/${NCU_SCRIPT:-tools/profile_gemm.py}" "$@" >"$log" 2>&1
rc=$?
grep -E "^  [a-zA-Z_]|^    [a-z]" "$log" | grep -v -e Warning -e "Section:" -e "Metric Name" | sed 's/  \+/ /g' | cut -c1-150
grep -E "\|.*\|_F" "$log"
exit $rc
