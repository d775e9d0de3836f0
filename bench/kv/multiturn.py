"""Benchmark 1: a multi-turn agent workload, prefill tokens computed and TTFT per turn.

Each of `--agents` rollouts runs `--turns` turns; a turn's prompt is the whole history (previous
prompt + sampled output) plus a fresh `--obs-tokens` observation, and `--out-tokens` are sampled.
Agents take turns round-robin on one engine whose KV pool holds about one context (as on a busy
replica, where other rollouts' pages evict yours while your tool runs). Modes:

  nocache  prefix caching off: every turn prefills its whole context
  local    the engine's own prefix cache only (evicted between an agent's turns)
  tiered   prefix cache + the KV store gateway (a real process; RAM then disk tiers): pages of every
           finished turn are published, the next turn pulls the missing prefix before prefilling

Reported per turn (mean over agents): prefill tokens computed and TTFT (submit -> first token,
including the page pull). CPU:
    .venv/bin/python -m bench.kv.multiturn --turns 50 --obs-tokens 100 --out bench/kv/results/multiturn_cpu.json
GPU (the lead):
    python -m bench.kv.multiturn --device cuda --model qwen3-0.6b-shape --dtype bfloat16 \\
        --turns 50 --obs-tokens 500 --out $OUT/multiturn_h200.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.kv.common import engine_config, make_model_dir, services, write_result
from services.common.config import RunConfig
from services.common.schemas import GenerateRequest, SamplingParams
from services.engine import LLMEngine
from services.engine.kv_transfer import chain_hashes, page_nbytes, reusable_pages
from services.kvstore.client import KVStoreClient, PagePublisher
from services.prefill.router import local_prefix_pages


def run_mode(mode: str, args: argparse.Namespace, model_dir: Path, store_url: str | None) -> dict[str, Any]:
    max_ctx = args.turns * (args.obs_tokens + args.out_tokens) + args.system_tokens + 8
    pool_tokens = int(max_ctx * args.pool_factor)
    cfg = engine_config(
        args.device,
        args.dtype,
        max_ctx + 64,
        block_size=args.block_size,
        num_kv_blocks=-(-pool_tokens // args.block_size),
        max_batch_size=8,
        max_num_batched_tokens=args.chunk,
        enable_prefix_caching=mode != "nocache",
    )
    eng = LLMEngine(model_dir, cfg, version=0)
    store = publisher = None
    if mode == "tiered":
        assert store_url is not None
        store = KVStoreClient(store_url, timeout_s=60)
        publisher = PagePublisher(store, page_nbytes(eng.kv))
        eng.pages.sink = publisher
    rng = random.Random(args.seed)
    vocab = eng.model_config.vocab_size - 1  # the last id is EOS
    system = [rng.randrange(vocab) for _ in range(args.system_tokens)]
    history = [list(system) for _ in range(args.agents)]
    per_turn: list[dict[str, float]] = []
    for turn in range(args.turns):
        ttfts, prefills, pulled = [], [], []
        for a in range(args.agents):
            prompt = history[a] + [rng.randrange(vocab) for _ in range(args.obs_tokens)]
            req = GenerateRequest(
                input_ids=prompt,
                sampling=SamplingParams(
                    temperature=1.0, seed=turn * 1000 + a, max_tokens=args.out_tokens, ignore_eos=True
                ),
            )
            before = eng.stats.computed_tokens_total
            t0 = time.perf_counter()
            n_pulled = 0
            if store is not None:
                bs = eng.kv.block_size
                keys = chain_hashes(prompt, eng.version, eng.layout, bs, reusable_pages(len(prompt), bs))
                have = local_prefix_pages(eng, keys)
                got, data = store.get_prefix(keys[have:])
                eng.pages.stage(got, data, pin=keys[:have])
                n_pulled = len(got)
            state = eng.add_request(req)
            seq = state.seqs[0]
            while not seq.output:
                eng.step()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            ttfts.append((time.perf_counter() - t0) * 1000)
            prefills.append(eng.stats.computed_tokens_total - before)
            pulled.append(n_pulled * eng.kv.block_size)
            while not state.finished:
                eng.step()
            history[a] = prompt + seq.output
            if publisher is not None:
                publisher.flush()  # the next turn may pull these pages (a tool call takes longer)
        per_turn.append(
            {
                "turn": turn,
                "context_tokens": len(history[0]),
                "prefill_tokens": statistics.mean(prefills),
                "pulled_tokens": statistics.mean(pulled),
                "ttft_ms": statistics.mean(ttfts),
            }
        )
        print(
            f"{mode:8s} turn {turn:3d} ctx {len(history[0]):6d} prefill {per_turn[-1]['prefill_tokens']:8.0f} "
            f"pulled {per_turn[-1]['pulled_tokens']:7.0f} ttft {per_turn[-1]['ttft_ms']:8.1f} ms",
            flush=True,
        )
    if publisher is not None:
        publisher.close()
    first = [t["ttft_ms"] for t in per_turn[: max(1, args.turns // 5)]]
    last = [t["ttft_ms"] for t in per_turn[-max(1, args.turns // 5) :]]
    prompt_total = sum(t["context_tokens"] - args.out_tokens for t in per_turn) * args.agents
    out: dict[str, Any] = {
        "prefill_tokens_total": sum(t["prefill_tokens"] for t in per_turn) * args.agents,
        # What recomputing every prompt in full costs (the nocache mode's count, by construction).
        "prompt_tokens_total": prompt_total,
        "ttft_ms_mean": statistics.mean(t["ttft_ms"] for t in per_turn),
        "ttft_ms_first_fifth": statistics.mean(first),
        "ttft_ms_last_fifth": statistics.mean(last),
        "ttft_growth_last_over_first": statistics.mean(last) / statistics.mean(first),
        "per_turn": per_turn,
    }
    if store is not None:
        out["store_stats"] = store.stats().model_dump()
        store.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="tiny", help="tiny | qwen3-0.6b-shape")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--turns", type=int, default=50)
    p.add_argument("--obs-tokens", type=int, default=500)
    p.add_argument("--out-tokens", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=200)
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    p.add_argument("--pool-factor", type=float, default=1.25, help="KV pool size / longest context")
    p.add_argument("--ram-bytes", type=int, default=256 << 20)
    p.add_argument("--disk-bytes", type=int, default=8 << 30)
    p.add_argument("--modes", default="nocache,local,tiered")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default="")
    p.add_argument("--out", default="bench/kv/results/multiturn_cpu.json")
    args = p.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-kv-"))
    model_dir = make_model_dir(args.model, work / f"model-{args.model}")
    modes = args.modes.split(",")
    results: dict[str, Any] = {}
    cfg = RunConfig()
    cfg.kvstore.ram_bytes, cfg.kvstore.disk_bytes = args.ram_bytes, args.disk_bytes
    with services(work / "services", cfg) as svc:
        url = svc.url("kvstore", "kvstore")
        for mode in modes:
            results[mode] = run_mode(mode, args, model_dir, url)
    summary: dict[str, Any] = {}
    if "tiered" in results:
        t = results["tiered"]["prefill_tokens_total"]
        for other in ("nocache", "local"):
            if other in results:
                summary[f"prefill_reduction_vs_{other}"] = results[other]["prefill_tokens_total"] / max(1, t)
        summary["tiered_ttft_growth"] = results["tiered"]["ttft_growth_last_over_first"]
    for m in modes:
        summary[f"{m}_ttft_ms_mean"] = results[m]["ttft_ms_mean"]
    print(summary)
    write_result(
        Path(args.out),
        {"benchmark": "multiturn", "params": vars(args), "summary": summary, "modes": results},
    )


if __name__ == "__main__":
    main()
