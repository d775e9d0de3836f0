#!/usr/bin/env bash
# Learning-speed sweep of the in-process loop (same model, engine, envs and loss as a run),
# 8 configurations in parallel, one CPU core each. Run on the lent GPU machine for its cores:
#   bash bench/calibration/sweep.sh          (writes $OUT/<name>.json)
set -uo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-200}
run() { name=$1; shift; python3 bench/calibration/inprocess.py --steps "$STEPS" --out "$OUT/$name.json" "$@" > "/tmp/$name.log" 2>&1 & }
P=--plugin=bench.calibration.echo_variants
run echo_digits --env echo-digits $P
run echo_bare --env echo-bare $P
run echo_say --env echo-say $P
run echo_digits_turns --env echo-digits-turns $P
run echo_bare_turns --env echo-bare-turns $P
run echo_turns --env echo-turns
run reverse_seed1 --env reverse --set=--run.seed=1
run mix_reverse_echoturns --env reverse --env echo-turns
wait
for f in /tmp/*.log; do echo "== $f"; tail -n 2 "$f"; done
