"""Benchmark 1: a multi-turn agent workload, prefill tokens computed and TTFT per turn.

Each of `--agents` rollouts runs `--turns` turns; a turn's prompt is the whole history (previous
prompt + sampled output) plus a fresh `--obs-tokens` observation, and `--out-tokens` are sampled.
Agents take turns round-robin on one engine whose KV pool holds about one context (as on a busy
replica, where other rollouts' pages evict yours while your tool runs). Modes:

  nocache  prefix caching off: every turn prefills its whole context
  local    the engine's own prefix cache only (evicted between an agent's turns)
  tiered   prefix cache + the KV store gateway (a real process; RAM then disk tiers): pages of every
           finished turn are published; the next turn pulls its missing prefix when decode's cost
           model (services/kvstore/pull_policy.py) expects the pull to beat recomputing it
  tiered-always  the same, pulling whatever the store has (kvstore.pull.mode = "always"): measures
           the pull path itself
  tiered-remote  tiered without the near tier (kvstore.near.bytes = 0): every pull crosses the
           gateway's TCP data plane

The tiered modes keep a near tier (services/kvstore/near_cache.py: pinned host RAM in this
process, `--near-bytes`, default kvstore.near's for the device) in front of the gateway: published
pages are written through to it and a pull takes its pages with one host -> device copy.

Reported per turn (mean over agents): prefill tokens computed, tokens pulled and TTFT (submit ->
first token, including the page pull). The result file is rewritten after every turn (`partial`
until the end); `--mode-budget-s` stops a mode after the turn that spends it. CPU:
    .venv/bin/python -m bench.kv.multiturn --turns 50 --obs-tokens 100 --out bench/kv/results/multiturn_cpu.json
GPU (the lead): `bash bench/kv/run_gpu.sh multiturn` (bench/kv/README.md).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.kv.common import ResultWriter, add_common_args, engine_config, prepare, services, synchronize
from services.common.config import KVNearSection, KVPullSection, RunConfig
from services.common.schemas import GenerateRequest, SamplingParams
from services.engine import LLMEngine
from services.engine.kv_transfer import page_nbytes
from services.kvstore.client import KVStoreClient, PagePublisher
from services.kvstore.router import attach_near, engine_policy, prompt_keys, pull_prefix

MODES = ("nocache", "local", "tiered", "tiered-always", "tiered-remote")


def run_mode(
    mode: str,
    args: argparse.Namespace,
    model_dir: Path,
    store_url: str | None,
    report: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
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
    # Modes share one gateway: a version of their own roots their page keys apart, so a later mode
    # never finds an earlier one's pages in the store.
    eng = LLMEngine(model_dir, cfg, version=MODES.index(mode))
    store = publisher = policy = None
    if mode.startswith("tiered"):
        assert store_url is not None
        store = KVStoreClient(store_url, timeout_s=60, max_call_bytes=512 << 20)
        run_cfg = RunConfig()
        run_cfg.kvstore.near = KVNearSection(bytes=0 if mode == "tiered-remote" else args.near_bytes)
        attach_near(eng, store, run_cfg)  # as decode and prefill services do
        if store.near is not None:
            # Pin the tier's memory before the timed turns (a service pays it as the tier fills).
            t0 = time.perf_counter()
            store.near.reserve()
            print(
                f"{mode}: near tier of {store.near.budget_bytes >> 20} MiB "
                f"({'pinned' if store.near.pin else 'pageable'}) allocated in {time.perf_counter() - t0:.1f} s"
            )
        publisher = PagePublisher(store, page_nbytes(eng.kv))
        eng.pages.sink = publisher
        # The decode service's own decision (services/kvstore/router.py), fed by this engine.
        policy = engine_policy(eng, KVPullSection(mode="always" if mode == "tiered-always" else "auto"))
    started = time.perf_counter()
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
                n_pulled = pull_prefix(eng, store, prompt_keys(eng, prompt), policy)
            state = eng.add_request(req)
            seq = state.seqs[0]
            while not seq.output:
                eng.step()
            synchronize(args.device)
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
        if policy is not None:
            per_turn[-1]["policy"] = policy.stats()
        if store is not None and store.near is not None:
            per_turn[-1]["near"] = store.near_stats()
        print(
            f"{mode:13s} turn {turn:3d} ctx {len(history[0]):6d} prefill {per_turn[-1]['prefill_tokens']:8.0f} "
            f"pulled {per_turn[-1]['pulled_tokens']:7.0f} ttft {per_turn[-1]['ttft_ms']:8.1f} ms",
            flush=True,
        )
        report(summarize(per_turn, args, complete=False))
        if args.mode_budget_s and time.perf_counter() - started > args.mode_budget_s:
            print(f"{mode}: --mode-budget-s {args.mode_budget_s} spent after turn {turn}", flush=True)
            break
    if publisher is not None:
        publisher.close()
    out = summarize(per_turn, args, complete=True)
    if store is not None:
        out["store_stats"] = store.stats().model_dump()
        out["near_stats"] = store.near_stats()
        store.close()
    if policy is not None:
        out["policy"] = policy.stats()
    return out


def summarize(per_turn: list[dict[str, Any]], args: argparse.Namespace, complete: bool) -> dict[str, Any]:
    fifth = max(1, len(per_turn) // 5)
    first = [t["ttft_ms"] for t in per_turn[:fifth]]
    last = [t["ttft_ms"] for t in per_turn[-fifth:]]
    return {
        "complete": complete,
        "turns_done": len(per_turn),
        "prefill_tokens_total": sum(t["prefill_tokens"] for t in per_turn) * args.agents,
        # What recomputing every prompt in full costs (the nocache mode's count, by construction).
        "prompt_tokens_total": sum(t["context_tokens"] - args.out_tokens for t in per_turn) * args.agents,
        "ttft_ms_mean": statistics.mean(t["ttft_ms"] for t in per_turn),
        "ttft_ms_first_fifth": statistics.mean(first),
        "ttft_ms_last_fifth": statistics.mean(last),
        "ttft_growth_last_over_first": statistics.mean(last) / statistics.mean(first),
        "per_turn": per_turn,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, out="bench/kv/results/multiturn_cpu.json")
    p.add_argument("--turns", type=int, default=50)
    p.add_argument("--obs-tokens", type=int, default=500)
    p.add_argument("--out-tokens", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=200)
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    p.add_argument("--pool-factor", type=float, default=1.25, help="KV pool size / longest context")
    p.add_argument("--ram-bytes", type=int, default=256 << 20)
    p.add_argument("--disk-bytes", type=int, default=8 << 30)
    p.add_argument("--modes", default="nocache,local,tiered", help=",".join(MODES))
    p.add_argument(
        "--near-bytes",
        type=int,
        default=None,
        help="near tier budget of the tiered modes (default: kvstore.near's for the device; 0: off)",
    )
    p.add_argument(
        "--mode-budget-s", type=float, default=0.0, help="> 0: end a mode after the turn that spends it"
    )
    args = p.parse_args()
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        p.error(f"--modes: unknown {unknown}; choose from {MODES}")
    work, model_dir = prepare(args)
    results: dict[str, Any] = {}
    writer = ResultWriter(Path(args.out), "multiturn", args)
    cfg = RunConfig()
    cfg.kvstore.ram_bytes, cfg.kvstore.disk_bytes = args.ram_bytes, args.disk_bytes
    with services(work / "services", cfg) as svc:
        url = svc.url("kvstore", "kvstore")
        for mode in modes:

            def report(partial: dict[str, Any], mode: str = mode) -> None:
                writer.write({"summary": summary(results), "modes": {**results, mode: partial}})

            results[mode] = run_mode(mode, args, model_dir, url, report)
            writer.write({"summary": summary(results), "modes": results})
    print(summary(results))
    writer.write({"summary": summary(results), "modes": results}, done=True)


def summary(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tiered in ("tiered", "tiered-always", "tiered-remote"):
        if tiered not in results:
            continue
        t = results[tiered]["prefill_tokens_total"]
        for other in ("nocache", "local"):
            if other in results:
                out[f"{tiered}_prefill_reduction_vs_{other}"] = results[other]["prefill_tokens_total"] / max(
                    1, t
                )
        out[f"{tiered}_ttft_growth"] = results[tiered]["ttft_growth_last_over_first"]
    for m, r in results.items():
        out[f"{m}_ttft_ms_mean"] = r["ttft_ms_mean"]
        out[f"{m}_turns_done"] = r["turns_done"]
    return out


if __name__ == "__main__":
    main()
