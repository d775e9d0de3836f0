#!/usr/bin/env bash
# Two-GPU trainer benchmarks (needs a two-GPU machine). One part per
# device command (each fits the 10-minute limit; writes $OUT/trainer_multi_<part>.json):
#   bash bench/trainer/multi.sh fsdp    |    bash bench/trainer/multi.sh cp    |    ... ep
# 1. FSDP2 over 2 GPUs, Qwen3-4B shape, 16k tokens per GPU (dp = 2), bf16 mixed precision.
# 2. ONE 131,072-token sequence, Qwen3-4B shape, context parallel over the 2 GPUs (cp = 2,
#    torchtitan's ring SDPA, head-tail load balancing), full / selective activation checkpointing.
# 3. Qwen3-30B-A3B-shaped MoE (12 of 48 layers, 128 experts, top-8), expert parallel ep = 2,
#    16k tokens per GPU: the trainer's per-expert loop, and torch._grouped_mm experts.
# 4. Tensor parallel tp = 2, Qwen3-4B shape, one 16k-token batch shared by both GPUs.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# The carried wheels (torchtitan 0.2.2, pydantic, ...) once, as step.py would do by itself.
python3 -c "import torchtitan, pydantic" 2>/dev/null || {
  [ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
}
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
RUN="python3 -m torch.distributed.run --standalone --nproc_per_node=2 bench/trainer/step.py --no-baseline --no-check"
case "${1:-}" in
fsdp) $RUN --shapes 4b --tokens 16384 --variants "bf16+sac,bf16+sac+compile,packed+varlen+sac" \
        --budget-s 480 --out "$OUT/trainer_multi_fsdp.json" ;;
cp)   $RUN --shapes 4b --tokens 131072 --cp 2 --steps 4 --no-publish --variants "bf16+full_ac,bf16+sac" \
        --budget-s 480 --out "$OUT/trainer_multi_cp.json" ;;
ep)   $RUN --shapes 30b-a3b --tokens 16384 --ep 2 --no-publish --variants "bf16+sac+loop,bf16+sac+grouped_mm,bf16+sac+grouped_mm+compile" \
        --budget-s 480 --out "$OUT/trainer_multi_ep.json" ;;
tp)   $RUN --shapes 4b --tokens 16384 --tp 2 --no-publish --variants "bf16+sac,bf16+sac+compile" \
        --budget-s 480 --out "$OUT/trainer_multi_tp.json" ;;
*)    echo "usage: $0 fsdp|cp|ep|tp" >&2; exit 2 ;;
esac
