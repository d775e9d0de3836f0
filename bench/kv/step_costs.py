"""What a decode step costs while a long prompt joins the batch, on ONE GPU and without services:
the conditions the interference benchmark's slowest steps mix, taken apart.

  alone    `--streams` short streams decoding, nothing else
  long     the same plus one `--long-tokens`-context request decoding (as after a handoff: its
           first tokens attend to the whole prompt)
  import   the streams alone while `--import-mib` of pages land per step on the side stream
           (PageExchange.stage -> drain, as a pull's pieces do; random bytes under fresh keys)

Per condition: step ms p50 / p99 / max, host-timed with the loop's stream synced after each step (as
interference.py), and from torch.profiler the GPU time per step by kernel (top kernels), so a slow
step says which kernels made it slow. GPU (one H200, ~1 min):
    python -m bench.kv.step_costs --device cuda --model qwen3-0.6b-shape --dtype bfloat16 \\
        --out $OUT/step_costs_h200.json
CPU smoke: python -m bench.kv.step_costs --streams 4 --long-tokens 256 --steps 6 --import-mib 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import torch

from bench.kv.common import ResultWriter, add_common_args, machine, prepare, synchronize, synchronize_stream
from bench.kv.interference import build_engine, percentile
from services.common.schemas import GenerateRequest, SamplingParams
from services.engine import LLMEngine
from services.engine.kernels import paged_attention
from services.engine.kv_transfer import page_nbytes


def _request(rng: random.Random, vocab: int, n: int, seed: int) -> GenerateRequest:
    return GenerateRequest(
        input_ids=[rng.randrange(vocab) for _ in range(n)],
        sampling=SamplingParams(temperature=1.0, seed=seed, max_tokens=1 << 20, ignore_eos=True),
    )


def _steps(eng: LLMEngine, args: argparse.Namespace, before: Any = None) -> list[float]:
    out = []
    for _ in range(args.steps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        eng.step()
        synchronize_stream(args.device)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def _kernels(eng: LLMEngine, args: argparse.Namespace, before: Any = None) -> dict[str, Any]:
    """GPU kernel time per step by kernel name over --profile-steps steps (CUDA only)."""
    if not args.device.startswith("cuda") or args.profile_steps <= 0:
        return {}
    from torch.profiler import ProfilerActivity, profile

    synchronize(args.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.profile_steps):
            if before is not None:
                before()
            eng.step()
        synchronize(args.device)
    rows = [
        (e.key, e.device_time_total / args.profile_steps / 1000, e.count / args.profile_steps)
        for e in prof.key_averages()
        if e.device_time_total > 0
    ]
    rows.sort(key=lambda r: -r[1])
    return {
        "gpu_ms_per_step": round(sum(r[1] for r in rows), 3),
        "top": [
            {"kernel": k[:120], "ms_per_step": round(ms, 3), "calls_per_step": c} for k, ms, c in rows[:10]
        ],
    }


def _summary(ms: list[float]) -> dict[str, float]:
    return {
        "p50": round(percentile(ms, 50), 3),
        "p99": round(percentile(ms, 99), 3),
        "max": round(max(ms), 3),
        "n": len(ms),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, out="bench/kv/results/step_costs_cpu.json")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--stream-prompt", type=int, default=128)
    p.add_argument("--long-tokens", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens (the long prefill's chunk)")
    p.add_argument("--steps", type=int, default=200, help="timed steps per condition")
    p.add_argument("--profile-steps", type=int, default=20)
    p.add_argument("--import-mib", type=int, default=256)
    p.add_argument("--conditions", default="alone,import,long")
    p.add_argument(
        "--decode-tuning",
        default="",
        help='overrides of kernels/paged_attention.DECODE_TUNING, JSON (e.g. {"num_stages": 2})',
    )
    args = p.parse_args()
    if args.decode_tuning:
        paged_attention.DECODE_TUNING.update(json.loads(args.decode_tuning))
    conditions = args.conditions.split(",")
    # build_engine's sizing fields (interference.py): room for the streams and one long request.
    args.stream_tokens, args.long_count, args.long_out = 4096, 1, 4096
    _, model_dir = prepare(args)
    eng = build_engine(args, model_dir)
    rng = random.Random(args.seed)
    vocab = eng.model_config.vocab_size - 1
    streams = [eng.add_request(_request(rng, vocab, args.stream_prompt, i)) for i in range(args.streams)]
    while any(not s.seqs[0].output for s in streams):
        eng.step()
    res: dict[str, Any] = {"machine": machine(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if "alone" in conditions:
        res["alone"] = {"step_ms": _summary(_steps(eng, args)), "kernels": _kernels(eng, args)}

    # Pages of random bytes under fresh keys, staged before each step: drain() imports them.
    per = page_nbytes(eng.kv)
    n_pages = max(1, (args.import_mib << 20) // per)
    blob = torch.randint(0, 255, (n_pages, per), dtype=torch.uint8, device=eng.kv.k.device)

    def stage() -> None:
        eng.pages.stage([os.urandom(16) for _ in range(n_pages)], blob)

    if "import" in conditions:
        res["import"] = {
            "pages_per_step": n_pages,
            "bytes_per_step": n_pages * per,
            "step_ms": _summary(_steps(eng, args, stage)),
            "kernels": _kernels(eng, args, stage),
        }
        while eng.pages.pending:
            eng.pages.finish()
            eng.step()

    if "long" in conditions:
        long = eng.add_request(_request(rng, vocab, args.long_tokens, 10_000))
        while not long.seqs[0].output:
            eng.step()
        res["long"] = {
            "graph": None if eng.graphs is None else list(eng.graphs.last_key or ()),
            "decode_tuning": dict(paged_attention.DECODE_TUNING),
            "step_ms": _summary(_steps(eng, args)),
            "kernels": _kernels(eng, args),
        }
    res["baseline"] = "condition 'alone' (the same streams, nothing else) in the same process"
    ResultWriter(Path(args.out), "step_costs", args).write(res, done=True)
    print({k: v["step_ms"] for k, v in res.items() if isinstance(v, dict) and "step_ms" in v})


if __name__ == "__main__":
    main()
