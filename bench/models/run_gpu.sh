#!/usr/bin/env bash
# GLM-5 and Nemotron-3 acceptance on one GPU (bench/models/README.md), one JSON under $OUT:
#   run(command="bash bench/models/run_gpu.sh", carry=[".whl"], timeout_s=600)
# Extra arguments go to bench/models/run.py (e.g. --only mfu, --mfu-experts 32 --mfu-mb-rows 1).
# torchtitan, pydantic & co. come from the carried wheels in .whl/, installed into /tmp/site once.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/machine.txt"
df -h /tmp | tail -n 1 | tee -a "$OUT/machine.txt"
# The hard stop a little inside the device call's 600 s, so the JSON (rewritten after every phase)
# and the log come back; phases are not started after --budget-s.
timeout -s INT 570 python3 bench/models/run.py --out "$OUT/models.json" --budget-s 450 "$@" 2>&1 \
  | tee "$OUT/models.log" | grep -v '^\s*$' | tail -n 60
exit "${PIPESTATUS[0]}"
