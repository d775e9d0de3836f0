"""The workload RL sends the engine: a GRPO batch, against a roofline of prefill FLOPs and decode bytes.

    python3 bench/engine/grpo.py --out $OUT/grpo.json          # one GPU, about 2-4 minutes
    python bench/engine/grpo.py --smoke --out /tmp/grpo.json   # CPU, tiny model: checks the script

Workload (random.seed(0)): 64 prompts of 200-1000 tokens (uniform), 16 samples of each (`n = 16` in
one request, so the samples share the prompt's KV pages), temperature 1. Sample lengths are
heavy-tailed as agentic rollouts are: log-normal around 150 tokens (sigma 1.0), capped at 1024.
With random weights EOS comes at random, so each request's length is its `max_tokens` with EOS
ignored: the engine sees the same lengths it would see if the samples had stopped there.

The roofline (the best any engine could do on this card and workload):
  - prefill: the FLOPs of the 64 prompts' tokens (each prompt once: the samples share its pages) at
    the dense bf16 peak;
  - decode: every step reads the weights once (at least max(longest sample, samples / batch limit)
    steps) plus, for every generated token, its sample's own KV and, once per prompt and step,
    the prompt's shared KV (the bytes a cascade-attention engine moves), at the device copy
    bandwidth measured in the same process. The per-sample bound (every sample reads its prompt
    pages itself, as a paged-attention kernel does) is reported beside it.
Also measured alone in the same process: the prefill of the 64 prompts (max_tokens = 1), which
gives the prefill's fraction of the bf16 peak, and W1 (the engine README's workload), for the
comparison the GRPO number is read against. Both fractions feed the capacity plan
(configs/plan/rates.toml).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.engine.w1 import (  # noqa: E402
    QWEN3_0_6B,
    SMOKE_MODEL,
    build_model_dir,
    environment,
    free_gpu,
    measure_bandwidth,
    requests,
    sync,
    w1_prompts,
)
from bench.engine.w1 import roofline as w1_roofline  # noqa: E402
from bench.results import write_result  # noqa: E402

PEAK_BF16 = {"H100": 989e12, "H200": 989e12}  # dense, datasheet


def workload(args: argparse.Namespace, vocab_hi: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, per-sample lengths) for every prompt."""
    rng = random.Random(0)
    out = []
    for _ in range(args.prompts):
        plen = rng.randint(args.min_prompt, args.max_prompt)
        prompt = [rng.randint(2, vocab_hi) for _ in range(plen)]
        lens = [
            max(args.min_new, min(args.max_new, int(rng.lognormvariate(math.log(args.median_new), 1.0))))
            for _ in range(args.samples)
        ]
        out.append((prompt, lens))
    return out


def model_numbers(kw: dict[str, Any], dtype_bytes: int) -> dict[str, float]:
    d, layers = kw["hidden_size"], kw["num_hidden_layers"]
    h, kv, hd, ff, v = (
        kw["num_attention_heads"],
        kw["num_key_value_heads"],
        kw["head_dim"],
        kw["intermediate_size"],
        kw["vocab_size"],
    )
    per_layer = d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * ff
    matmul_params = layers * per_layer + v * d  # the LM head is a matmul; the embedding a gather
    return {
        "matmul_params": matmul_params,
        "weight_bytes": matmul_params * dtype_bytes,
        "kv_bytes_per_token": 2 * kv * hd * dtype_bytes * layers,
        "attn_flops_per_key": 2 * 2 * h * hd * layers,  # QK^T and PV, multiply-add = 2
    }


def roofline(
    work: list[tuple[list[int], list[int]]], nums: dict[str, float], bw: float, peak: float, batch: int
) -> dict[str, Any]:
    prompt_tokens = sum(len(p) for p, _ in work)
    # Causal prefill: token i attends to i + 1 keys.
    attn = sum(nums["attn_flops_per_key"] * len(p) * (len(p) + 1) / 2 for p, _ in work)
    prefill_flops = 2 * nums["matmul_params"] * prompt_tokens + attn
    lens = [n for _, ls in work for n in ls]
    gen = sum(lens)
    steps = max(max(lens), math.ceil(gen / batch))
    kv_reads = sum(nums["kv_bytes_per_token"] * (n * len(p) + n * (n + 1) / 2) for p, ls in work for n in ls)
    decode_bytes = steps * nums["weight_bytes"] + kv_reads
    # An engine that reads a shared prompt's pages once a step for all its samples (cascade
    # attention) moves fewer bytes: that bound is the one the goal is read against.
    shared_reads = sum(
        nums["kv_bytes_per_token"] * (max(ls) * len(p) + sum(n * (n + 1) / 2 for n in ls)) for p, ls in work
    )
    decode_bytes_shared = steps * nums["weight_bytes"] + shared_reads
    t_pre, t_dec = prefill_flops / peak, decode_bytes / bw
    t_dec_shared = decode_bytes_shared / bw
    return {
        "prompt_tokens": prompt_tokens,
        "generated_tokens": gen,
        "samples": len(lens),
        "longest_sample": max(lens),
        "mean_sample": round(gen / len(lens), 1),
        "min_decode_steps": steps,
        "prefill_flops": prefill_flops,
        "decode_bytes": decode_bytes,
        "prefill_time_s": t_pre,
        "decode_time_s": t_dec,
        "time_s": t_pre + t_dec,
        "tok_s": gen / (t_pre + t_dec),
        "decode_bytes_shared_prefix": decode_bytes_shared,
        "decode_time_shared_prefix_s": t_dec_shared,
        "time_shared_prefix_s": t_pre + t_dec_shared,
        "tok_s_shared_prefix": gen / (t_pre + t_dec_shared),
        "bandwidth_bytes_s": bw,
        "peak_flops": peak,
    }


def engine_for(args: argparse.Namespace, model_dir: Path, max_seq: int) -> Any:
    from services.common.config import EngineConfig
    from services.engine import LLMEngine

    cfg = EngineConfig(
        device=args.device,
        dtype=args.dtype,
        max_batch_size=args.batch,
        max_seq_len=max_seq,
        enable_prefix_caching=True,
        max_num_batched_tokens=args.max_num_batched_tokens,
        fused_kernels=args.device == "cuda",
        overlap_schedule="auto",
        kv_cache_bytes=args.kv_cache_gib << 30 if args.kv_cache_gib else None,
    )
    return LLMEngine(model_dir, cfg)


def run_requests(engine: Any, reqs: list[Any]) -> tuple[float, int]:
    sync()
    t0 = time.perf_counter()
    resps = engine.generate(reqs)
    sync()
    wall = time.perf_counter() - t0
    tokens = sum(len(c.output_ids) for r in resps for c in r.choices)
    return wall, tokens


def grpo_requests(work: list[tuple[list[int], list[int]]], lengths_exact: bool) -> list[Any]:
    """One request per (prompt, length) run of samples: samples of a prompt with the same length
    share a request (`n`), and every request of a prompt hits its cached pages."""
    from services.common.schemas import GenerateRequest, SamplingParams

    reqs = []
    for i, (prompt, lens) in enumerate(work):
        counts: dict[int, int] = {}
        for n in lens:
            counts[n] = counts.get(n, 0) + 1
        for j, (n, k) in enumerate(sorted(counts.items())):
            reqs.append(
                GenerateRequest(
                    input_ids=prompt,
                    sampling=SamplingParams(
                        temperature=1.0, max_tokens=n, ignore_eos=lengths_exact, n=k, seed=1000 * i + j
                    ),
                )
            )
    return reqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny model and workload on CPU")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--min-prompt", type=int, default=200)
    ap.add_argument("--max-prompt", type=int, default=1000)
    ap.add_argument("--median-new", type=float, default=150.0)
    ap.add_argument("--min-new", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=1024)
    ap.add_argument(
        "--batch", type=int, default=512, help="the engine's max_batch_size (also the roofline's)"
    )
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--kv-cache-gib", type=int, default=0, help="0: the engine's default sizing")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-w1", action="store_true", help="skip W1 on the same engine")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    args.device = "cuda" if cuda else "cpu"
    if args.smoke:
        args.prompts, args.samples, args.min_prompt, args.max_prompt = 4, 4, 20, 40
        args.median_new, args.min_new, args.max_new, args.batch = 8.0, 2, 24, 16
        args.dtype = "float32"
    kw = SMOKE_MODEL if args.smoke else QWEN3_0_6B
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    report: dict[str, Any] = {"environment": environment(dev), "workload": vars(args) | {"model": kw}}
    out = Path(args.out)

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_result(out, report, default=str)

    work = workload(args, kw["vocab_size"] - 1)
    nums = model_numbers(kw, torch.tensor([], dtype=dtype).element_size())
    bw = measure_bandwidth(dev)
    name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in name), 1e12)
    roof = roofline(work, nums, bw, peak, args.batch)
    report["roofline"] = roof
    report["model_numbers"] = nums
    save()
    with tempfile.TemporaryDirectory() as tmp:
        build_model_dir(kw, dev, dtype, Path(tmp))
        free_gpu()
        max_seq = max(args.max_prompt + args.max_new, 1024 + 512) + 16  # W1 runs on this engine too
        engine = engine_for(args, Path(tmp), max_seq)
        from services.common.schemas import GenerateRequest, SamplingParams

        # Warm-up: compile the kernels and capture graphs on a slice of the workload.
        run_requests(engine, grpo_requests([(p[:128], [8] * 4) for p, _ in work[:8]], True))
        # Prefill alone: the prompts once, one token each (its own prompts, so the cache is cold).
        rng = random.Random(1)
        cold = [[rng.randint(2, kw["vocab_size"] - 1) for _ in p] for p, _ in work]
        pre_wall, _ = run_requests(
            engine,
            [
                GenerateRequest(input_ids=p, sampling=SamplingParams(max_tokens=1, ignore_eos=True))
                for p in cold
            ],
        )
        pre_flops = roof["prefill_flops"] * sum(len(p) for p in cold) / roof["prompt_tokens"]
        report["prefill"] = {
            "wall_s": pre_wall,
            "prompt_tokens": sum(len(p) for p in cold),
            "tok_s": sum(len(p) for p in cold) / pre_wall,
            "fraction_of_peak": pre_flops / pre_wall / peak,
        }
        save()
        wall, tokens = run_requests(engine, grpo_requests(work, True))
        decode_s = max(1e-9, wall - pre_wall)
        report["grpo"] = {
            "wall_s": wall,
            "output_tokens": tokens,
            "output_tok_s": tokens / wall,
            # Against the shared-prefix bound (the stricter one; the goal's) and against the
            # bound of an engine that reads every sample's prompt pages itself.
            "fraction_of_roofline": roof["time_shared_prefix_s"] / wall,
            "fraction_of_per_sample_roofline": roof["time_s"] / wall,
            # The decode part's bytes against the time left after a prefill as long as the one
            # measured alone: the decode's fraction of the copy bandwidth.
            "decode_fraction_of_bandwidth": roof["decode_time_shared_prefix_s"] / decode_s,
            "goal": ">= 0.6 of the roofline",
        }
        if tokens != roof["generated_tokens"]:
            report["grpo"]["error"] = (
                f"generated {tokens} tokens, the workload asks {roof['generated_tokens']}"
            )
        save()
        if not args.no_w1:
            # W1 on the same engine: 256 prompts of 100-1024 tokens, 512 new tokens each.
            n, lo, hi, new = (8, 20, 40, 8) if args.smoke else (256, 100, 1024, 512)
            prompts = w1_prompts(n, lo, hi, min(10000, kw["vocab_size"] - 1))
            w1_roof = w1_roofline(
                prompts, new, int(nums["weight_bytes"]), int(nums["kv_bytes_per_token"]), bw
            )
            w1_wall, w1_tokens = run_requests(engine, requests(prompts, new, 1.0))
            report["w1"] = {
                "wall_s": w1_wall,
                "output_tokens": w1_tokens,
                "output_tok_s": w1_tokens / w1_wall,
                "roofline_tok_s": w1_roof["tok_s"],
                "fraction_of_roofline": w1_tokens / w1_wall / w1_roof["tok_s"],
            }
            save()
        del engine
        free_gpu()
    report["machine"] = report["environment"].get("device_name", "cpu")
    save()
    print(
        json.dumps(
            {k: report[k] for k in ("roofline", "prefill", "grpo", "w1") if k in report},
            indent=1,
            default=str,
        )
    )


if __name__ == "__main__":
    main()
