#!/usr/bin/env bash
# Nsight Compute over the FP8 GEMMs of bench/fp8/wgmma_profile.py (our CUDA configurations, bench/kernels/fp8_wgmma_variants.cu; cuBLAS
# block-wise, bf16 cuBLAS) on the lent H200 (Firecracker machines only: ncu reads no counters on
# gVisor). Clocks left as they are (--clock-control none). Writes $OUT/wgmma_ncu.csv and .txt.
#   NCU_VARIANTS=0,2,4 bash bench/fp8/run.sh ncu   (run.sh installs the carried wheels first)
# Another program's kernels (run.sh's deepgemm-ncu: DeepGEMM's, at the same shape): NCU_PROGRAM
# (the command), NCU_KERNELS (ncu's --kernel-name) and NCU_TAG (the output files' prefix).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NCU=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}
KERNELS=${NCU_KERNELS:-regex:fp8_gemm_kernel|gemm|xmma|nvjet|sm90}
TAG=${NCU_TAG:-wgmma_ncu}
read -r -a PROGRAM <<< "${NCU_PROGRAM:-python3 bench/fp8/wgmma_profile.py --variants ${1:-0}}"
"$NCU" --clock-control none --kernel-name "$KERNELS" \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy \
  --csv --page details "${PROGRAM[@]}" > "$OUT/$TAG.csv" 2> "$OUT/$TAG.err"
echo "ncu rc=$?"
python3 - "$OUT/$TAG.csv" <<'PY' | tee "$OUT/$TAG.txt"
import csv, sys
rows = list(csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"')))
keep = ("Duration", "Compute (SM) Throughput", "Memory Throughput", "L2 Cache Throughput", "DRAM Throughput",
        "L1/TEX Cache Throughput", "Issue Slots Busy", "Executed Ipc Active", "No Eligible", "Warp Cycles Per Issued Instruction",
        "Registers Per Thread", "Shared Memory Configuration Size", "Achieved Occupancy", "Grid Size", "Cluster Size",
        "Block Size", "Max Bandwidth", "Mem Pipes Busy", "Dynamic Shared Memory Per Block")
seen = {}
for r in rows:
    k = (r["ID"], r["Kernel Name"][:60])
    if any(r["Metric Name"].startswith(x) for x in keep):
        seen.setdefault(k, []).append(f'{r["Metric Name"]}={r["Metric Value"]}{r["Metric Unit"]}')
for k, v in seen.items():
    print(k)
    for x in v:
        print("   ", x)
PY
# Tensor-pipe and shared-memory use, named metrics (a separate run: an unknown name fails only it).
"$NCU" --clock-control none --kernel-name "$KERNELS" --csv --page raw \
  --metrics smsp__inst_executed.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,l1tex__data_bank_reads.avg.pct_of_peak_sustained_elapsed,l1tex__data_bank_writes.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum.per_second,gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio \
  "${PROGRAM[@]}" > "$OUT/${TAG}_metrics.csv" 2> "$OUT/${TAG}_metrics.err"
echo "ncu metrics rc=$?"
cut -c1-300 "$OUT/${TAG}_metrics.csv" | tail -8
grep -i -E "pipe|stall|bound|tensor" "$OUT/$TAG.csv" | grep -i -E "OPT|WRN|est" | cut -c1-400 | head -40
