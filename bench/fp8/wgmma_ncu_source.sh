#!/usr/bin/env bash
# Nsight Compute warp-stall sampling per SASS instruction for one fp8_gemm_kernel variant
# (bench/fp8/wgmma_profile.py), to see where the math warpgroups wait. Firecracker machines only.
# Writes $OUT/wgmma_source_<variant>.csv (the source page: SASS with stall samples per instruction).
#   NCU_VARIANT=0 bash bench/fp8/run.sh ncu-source   (run.sh installs the carried wheels first)
# A second argument profiles another kernel of the same program by name instead, e.g. cuBLAS's
# block-wise one: `bash bench/fp8/wgmma_ncu_source.sh cublas regex:nvjet_sm90_qqtst` (the output
# then is named after the first argument; nothing is written into the repository). NCU_PROGRAM
# replaces the profiled command (run.sh deepgemm-ncu-source: DeepGEMM's kernel, by deepgemm.py).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
V=${1:-0}
KERNEL=${2:-regex:fp8_gemm_kernel}
VARIANTS=$V; [[ -n "${2:-}" ]] && VARIANTS=0
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
"$NCU" --clock-control none --kernel-name "$KERNEL" --launch-count 1 \
  --section WarpStateStats --section SourceCounters -o "$OUT/wgmma_src_$V" -f \
  ${NCU_PROGRAM:-python3 bench/fp8/wgmma_profile.py --variants "$VARIANTS"} > "$OUT/wgmma_src_$V.log" 2>&1
echo "ncu rc=$?"
"$NCU" --import "$OUT/wgmma_src_$V.ncu-rep" --page source --csv --print-source sass > "$OUT/wgmma_source_$V.csv" 2> "$OUT/wgmma_source_$V.err"
echo "export rc=$? $(wc -l < "$OUT/wgmma_source_$V.csv") lines"
rm -f "$OUT/wgmma_src_$V.ncu-rep"
