#!/usr/bin/env bash
# The next H200 run of the CUDA FP8 GEMM (wgmma.py): the TMA-store epilogue variants 8-11 against
# the best committed variant (1: 128x256 plain) and the unscaled probe (5), bf16 and cuBLAS
# block-wise in the same process, at M = 128, 4096, 8192. From the repo root, PYTHONPATH set.
# Writes $OUT/wgmma_h200_12.json + wgmma_h200_12.txt, in under 4 minutes: one run (self-check +
# timings, ~1.5 min expected); only if it fails or hangs (the new epilogue has never run on a GPU)
# is each new variant run alone (self-check + M = 128 timings, 25 s cap), and the ones that pass
# are timed with 1 and 5 at M >= 4096 in the time left.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LOG="$OUT/wgmma_h200_12.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv 2>&1 | tee "$LOG"
# ok FILE: the run's self-check passed and it has timing rows.
ok() { python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); sys.exit(0 if d.get("check_ok") and d.get("rows") else 1)' "$1" 2>/dev/null; }
timeout 110 python3 bench/fp8/wgmma.py --variants 1,5,8,9,10,11 --ms 128,4096,8192 \
  --out "$OUT/wgmma_h200_12.json" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
if [ "$rc" = 0 ] && ok "$OUT/wgmma_h200_12.json"; then
  echo "next_gpu: done in ${SECONDS}s" | tee -a "$LOG"; exit 0
fi
echo "next_gpu: the combined run failed (rc $rc); variants 8-11 one at a time" | tee -a "$LOG"
[ -f "$OUT/wgmma_h200_12.json" ] && mv "$OUT/wgmma_h200_12.json" "$OUT/wgmma_h200_12_failed.json"
passing="1,5"
for v in 8 9 10 11; do
  f="$OUT/wgmma_h200_12_alone_v$v"
  timeout 25 python3 bench/fp8/wgmma.py --variants "$v" --ms 128 --out "$f.json" > "$f.txt" 2>&1
  r=$?
  if [ "$r" = 0 ] && ok "$f.json"; then passing="$passing,$v"; fi
  echo "next_gpu: variant $v alone rc $r -> passing $passing" | tee -a "$LOG"
  tail -2 "$f.txt" | cut -c1-300 | tee -a "$LOG"
done
left=$((232 - SECONDS))
if [ "$left" -gt 20 ]; then
  timeout "$left" python3 bench/fp8/wgmma.py --variants "$passing" --ms 4096,8192 --out "$OUT/wgmma_h200_12.json" \
    2>&1 | tee -a "$LOG"
  echo "next_gpu: fallback run rc ${PIPESTATUS[0]} (variants $passing) after ${SECONDS}s" | tee -a "$LOG"
fi
