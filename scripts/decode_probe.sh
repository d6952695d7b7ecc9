#!/usr/bin/env bash
# One device call for decode investigations, no library build: the per-CTA timeline probe
# (scripts/probe_timeline.cu) built once per ring depth in STAGES and per patch in PATCHES
# ("none" = the tree as it is; a patch applies to a copy of cuda/), each run cold on SHAPES
# once per setting in SETTINGS ("default" or VAR=VALUE, e.g. JAX_HOPPER_SPLIT_K_CLUSTER=0),
# then, unless SKIP_XLA=1, what XLA runs for the same shapes (scripts/probe_xla_decode.py).
#   STAGES="3 4" PATCHES="none /tmp/x.patch" SHAPES="16x8192x8192" bash scripts/decode_probe.sh
# (a patch as `git diff main BRANCH -- cuda` makes it; its file name, less .patch, names the build)
set -u
OUT=${OUT:-/tmp/decode_probe}
STAGES=${STAGES:-4}
PATCHES=${PATCHES:-none}
SETTINGS=${SETTINGS:-default}
SHAPES=${SHAPES:-"16x8192x8192 16x4096x4096 16x4096x14336"}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv > "$OUT/gpu.txt" 2>&1
# gemm.h includes the kinds generated from jax_hopper/_kernels.py (CMake does this for the library).
GEN=$(mktemp -d) && mkdir -p "$GEN/gemm" && python3 jax_hopper/_kernels.py header "$GEN/gemm/kernel_kinds.h" || exit 1
builds=()
for p in $PATCHES; do
  name=$(basename "$p" .patch)
  src=cuda
  if [ "$p" != none ]; then
    src=/tmp/decode_probe_src_$name/cuda
    rm -rf "/tmp/decode_probe_src_$name" && mkdir -p "/tmp/decode_probe_src_$name" && cp -r cuda "$src"
    patch_file=$(realpath "$p")
    (cd "/tmp/decode_probe_src_$name" && patch -p1 < "$patch_file") > "$OUT/patch_$name.log" 2>&1 || {
      echo "patch $p does not apply"; cat "$OUT/patch_$name.log"; exit 1; }
  fi
  for s in $STAGES; do
    bin="/tmp/probe_timeline_${name}_$s"
    builds+=("$name stages=$s:$bin")
    nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I"$src" -I"$GEN" --expt-relaxed-constexpr -DPROBE_STAGES="$s" \
      scripts/probe_timeline.cu "$src/hopper/tensor_map.cc" -o "$bin" > "$OUT/build_${name}_$s.log" 2>&1 &
  done
done
wait
{
  for b in "${builds[@]}"; do
    for setting in $SETTINGS; do
      echo "### ${b%%:*} $setting"
      tag=$(echo "${b%%:*}_$setting" | tr " =" "__")
      envs=(RAW="$OUT/raw_$tag")
      [ "$setting" = default ] || envs+=("$setting")
      env "${envs[@]}" "${b#*:}" $SHAPES || echo "probe failed: $?"
    done
  done
} > "$OUT/timeline.txt" 2>&1
cat "$OUT/timeline.txt"
# Few files come back from a device call: the per-CTA CSVs travel as one archive.
if ls "$OUT"/raw_*.csv > /dev/null 2>&1; then
  tar -C "$OUT" -czf "$OUT/raw.tar.gz" $(cd "$OUT" && ls raw_*.csv) && rm -f "$OUT"/raw_*.csv
fi
if [ "${SKIP_XLA:-0}" != 1 ]; then
  HLO_DIR="$OUT" python3 scripts/probe_xla_decode.py $SHAPES > "$OUT/xla.txt" 2>&1 ||
    echo "xla probe failed: $?" >> "$OUT/xla.txt"
  cat "$OUT/xla.txt"
fi
