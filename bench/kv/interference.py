"""Benchmark 2: decode inter-token latency (ITL) of `--streams` running streams while long prompts
(`--long-tokens`, default 16k) arrive, colocated vs disaggregated.

  colocated      the long prompts are prefilled by the decode engine itself, in chunks of
                 max_num_batched_tokens inside the same steps as the streams' decodes
  disaggregated  a real prefill service (its own process and device) prefills them and publishes
                 the pages to a real KV store gateway; the decode engine pulls the pages in a
                 background thread, imports them between steps and continues from the prefill's
                 first token (the same path as services/kvstore/router.py: pull_prefilled, every
                 full page and, from a same-host handoff, the partial last one, so a long prompt's
                 first decode step feeds only its first token)

  baseline       the same streams and no long prompts: the ITL the other two are compared with

ITL is measured per stream between consecutive tokens, from the engine's own step loop, over the
window in which the long prompts arrive and are served (until the last one has finished; baseline:
the window the arrivals span plus 2 s). A stream that finishes is replaced by a new one, so
`--streams` streams decode throughout the window whatever its length. Each mode's slowest steps
carry their phase times, GC ms and overlapping background events (bench/kv/README.md, "Decode
stalls"); `--no-host-tune` runs without services/engine/host_tuning.py (the "before"). CPU:
    .venv/bin/python -m bench.kv.interference --out bench/kv/results/interference_cpu.json
GPU (the lead; 2 GPUs: decode on GPU 0, prefill service on GPU 1):
    python -m bench.kv.interference --device cuda --model qwen3-0.6b-shape --dtype bfloat16 \\
        --prefill-gpu 1 --long-count 8 --long-every-s 0.5 --stream-tokens 512 \\
        --modes baseline,colocated,disaggregated --out $OUT/interference_h200.json
"""

from __future__ import annotations

import argparse
import queue
import random
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.kv.common import (
    GcTrace,
    ResultWriter,
    StallSampler,
    Timeline,
    add_common_args,
    engine_config,
    prepare,
    services,
    synchronize_stream,
)
from services.common.auth import auth_headers
from services.common.config import RunConfig
from services.common.prefill_schemas import PrefillRequest, PrefillResponse
from services.common.schemas import GenerateRequest, SamplingParams
from services.engine import LLMEngine, kv_transfer
from services.engine.host_tuning import tune_after_startup
from services.engine.sequence import Status
from services.kvstore.client import KVStoreClient
from services.kvstore.router import pull_prefilled, reserve_pinned


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q)) if xs else float("nan")


def build_engine(args: argparse.Namespace, model_dir: Path) -> LLMEngine:
    bs = args.block_size
    stream_pages = args.streams * -(-(args.stream_prompt + args.stream_tokens) // bs)
    long_pages = (args.long_count + 1) * -(-(args.long_tokens + args.long_out) // bs)
    cfg = engine_config(
        args.device,
        args.dtype,
        args.long_tokens + args.long_out + 64,
        block_size=bs,
        num_kv_blocks=stream_pages + long_pages,
        max_batch_size=args.streams + args.long_count + 1,
        max_num_batched_tokens=args.chunk,
    )
    return LLMEngine(model_dir, cfg, version=0)


def run_mode(mode: str, args: argparse.Namespace, model_dir: Path, svc: Any) -> dict[str, Any]:
    eng = build_engine(args, model_dir)
    rng = random.Random(args.seed)
    vocab = eng.model_config.vocab_size - 1
    born = 0

    def new_stream() -> Any:
        nonlocal born
        born += 1
        return eng.add_request(
            GenerateRequest(
                input_ids=[rng.randrange(vocab) for _ in range(args.stream_prompt)],
                sampling=SamplingParams(
                    temperature=1.0, seed=born, max_tokens=args.stream_tokens, ignore_eos=True
                ),
            )
        )

    streams = [new_stream() for _ in range(args.streams)]
    # Warm up: every stream prefilled and decoding before the window opens.
    while any(not s.seqs[0].output for s in streams):
        eng.step()
    # As the decode service does once its engine is built (services/engine/host_tuning.py).
    knobs: dict[str, float] = {}
    if args.switch_interval_ms is not None:
        knobs["switch_interval_s"] = args.switch_interval_ms / 1000
    if args.gen0_threshold is not None:
        knobs["gen0"] = args.gen0_threshold
    tuned = tune_after_startup(**knobs) if args.host_tune else {}  # type: ignore[arg-type]
    timeline = Timeline()  # the background threads' events, for slowest_steps
    long_count = 0 if mode == "baseline" else args.long_count
    window_s = args.long_count * args.long_every_s + 2.0  # baseline only
    longs = [[rng.randrange(vocab) for _ in range(args.long_tokens)] for _ in range(long_count)]
    ready: queue.Queue[tuple[int, GenerateRequest]] = queue.Queue()
    pull_ms: list[float] = []
    store = (
        KVStoreClient(svc.url("kvstore", "kvstore"), timeout_s=600, max_call_bytes=512 << 20)
        if mode == "disaggregated"
        else None
    )
    if store is not None:
        # As the decode service's router does at attach; 3 buffers: pulls overlap here.
        reserve_pinned(eng, store, buffers=3)
    prefill_url = svc.url("prefill", "prefill") if mode == "disaggregated" else None

    def prefill_and_pull(req: GenerateRequest, rid: str) -> PrefillResponse:
        """Prefill service, then pull the pages and stage them: a decode router's work."""
        assert store is not None and prefill_url is not None
        # Same host (the prefill service runs here): ask for a handoff of its shared near tier.
        body = PrefillRequest(input_ids=req.input_ids, sampling=req.sampling, request_id=rid, handoff=True)
        with timeline.span("prefill_http", id=rid):
            r = httpx.post(
                f"{prefill_url}/v1/prefill",
                content=body.model_dump_json(),
                headers={"content-type": "application/json", **auth_headers()},
                timeout=600,
            )
        r.raise_for_status()
        with timeline.span("parse", id=rid):
            resp = PrefillResponse.model_validate_json(r.content)
        # After a remote prefill decode pulls whatever the store has (no cost model: router.py),
        # the handoff's pages first (copied from the prefill's shared memory, then acked), and
        # stages the first tokens: pull_prefilled, as KVRouter.generate does.
        first = [(c.token, c.logprob, c.version) for c in resp.choices]
        with timeline.span("pull_prefilled", id=rid):
            pull_prefilled(eng, store, req.input_ids, rid, first, resp.handoff)
        return resp

    def remote(i: int, req: GenerateRequest) -> None:
        """prefill_and_pull off the loop, then the request is handed to the loop."""
        t0 = time.perf_counter()
        prefill_and_pull(req, f"long-{i}")
        # The pull: from the prefill's reply to prefill_and_pull's return (handoff copy + TCP pull
        # + staging the first token).
        http_end = max(e[2] for e in timeline.events if e[0] == "prefill_http" and e[3]["id"] == f"long-{i}")
        timeline.add("pull", http_end, time.perf_counter(), id=f"long-{i}")
        pull_ms.append((time.perf_counter() - t0) * 1000)
        ready.put((i, req.model_copy(update={"request_id": f"long-{i}"})))

    if mode == "disaggregated":
        # Warm-up outside the window, as a decode meets a same-host prefill once: the first
        # handoff maps and pins (cudaHostRegister) the prefill's shared segments, seconds of
        # driver work for a 16 GiB tier that would otherwise stall the loop mid-window.
        warm_rng = random.Random(args.seed + 1)  # the streams' and long prompts' draws stay as they were
        warm = GenerateRequest(
            input_ids=[warm_rng.randrange(vocab) for _ in range(4 * args.block_size)],
            sampling=SamplingParams(temperature=1.0, max_tokens=1),
        )
        t0 = time.perf_counter()
        prefill_and_pull(warm, "warm-up")
        eng.pages.forget("warm-up")  # never submitted: only its pages were wanted
        while eng.pages.pending:
            eng.step()
        print(
            f"disaggregated: handoff warm-up (segments mapped) in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )

    last = {id(s): time.perf_counter() for s in streams}
    count = {id(s): len(s.seqs[0].output) for s in streams}
    fresh: list[Any] = []  # replacements whose first token (their prefill) has not come yet
    itl: list[float] = []
    step_ms: list[float] = []
    arrivals: dict[int, float] = {}
    firsts: dict[int, float] = {}
    long_states: dict[int, Any] = {}
    t_start = time.perf_counter()
    sent = 0
    threads = []
    prev_end = 0.0
    # (step ms, ms between steps, tokens fed, pages imported, start, end, phases) of every step:
    # what made a step slow
    slow: list[tuple[float, float, int, int, float, float, dict[str, float]]] = []
    # Long prompt -> prefix-cache hit tokens at its admission: pulled pages (or local fallback).
    long_hit: dict[int, int] = {}
    gct = GcTrace().__enter__()
    stalls = StallSampler(after_ms=args.stall_ms) if args.stall_ms > 0 else None
    while True:
        now = time.perf_counter()
        while sent < long_count and now - t_start >= sent * args.long_every_s:
            req = GenerateRequest(
                input_ids=longs[sent],
                sampling=SamplingParams(
                    temperature=1.0, seed=1000 + sent, max_tokens=args.long_out, ignore_eos=True
                ),
            )
            arrivals[sent] = now
            if mode == "colocated":
                long_states[sent] = eng.add_request(req)
            else:
                th = threading.Thread(target=remote, args=(sent, req), daemon=True)
                th.start()
                threads.append(th)
            sent += 1
        while not ready.empty():
            i, req = ready.get()
            long_states[i] = eng.add_request(req)
        t0 = time.perf_counter()
        fed = eng.stats.computed_tokens_total
        imported = eng.pages.imported_pages_total
        hits = eng.stats.prefix_cache_hit_tokens
        waiting = [i for i, st in long_states.items() if i not in long_hit]
        if stalls is not None:
            stalls.step_begin(t0)
        eng.step()
        synchronize_stream(args.device)  # the loop's stream, not the side streams (common.py)
        if stalls is not None:
            stalls.step_end()
        now = time.perf_counter()
        for i in waiting:  # admitted in this step: the hits were its (streams' prompts are random)
            if long_states[i].seqs[0].status is not Status.WAITING:
                long_hit[i] = eng.stats.prefix_cache_hit_tokens - hits
        step_ms.append((now - t0) * 1000)
        gap_ms = (t0 - prev_end) * 1000 if prev_end else 0.0  # time outside step(): the loop itself
        prev_end = now
        slow.append(
            (
                step_ms[-1],
                gap_ms,
                eng.stats.computed_tokens_total - fed,
                eng.pages.imported_pages_total - imported,
                t0,
                now,
                eng.stats.last_step_phases,
            )
        )
        for s in streams:
            n = len(s.seqs[0].output)
            if n > count[id(s)]:
                itl.append((now - last[id(s)]) * 1000 / (n - count[id(s)]))
                count[id(s)], last[id(s)] = n, now
        for s in fresh:
            if s.seqs[0].output:  # from its first token on, a stream like the others
                streams.append(s)
                count[id(s)], last[id(s)] = len(s.seqs[0].output), now
        fresh = [s for s in fresh if not s.seqs[0].output]
        for s in [s for s in streams if s.finished]:
            streams.remove(s)
            fresh.append(new_stream())
        for i, st in long_states.items():
            if i not in firsts and st.seqs[0].output:
                firsts[i] = now
        if mode == "baseline":
            if now - t_start >= window_s:
                break
            continue
        done_longs = sent == long_count and len(long_states) == long_count
        if done_longs and all(st.finished for st in long_states.values()):
            break
    gct.__exit__()
    if stalls is not None:
        stalls.close()
    ttft = [(firsts[i] - arrivals[i]) * 1000 for i in sorted(firsts)]

    def step_row(x: tuple[float, float, int, int, float, float, dict[str, float]]) -> dict[str, Any]:
        a, b, c, d, t0, t1, ph = x
        return {
            "step_ms": round(a, 2),
            "gap_before_ms": round(b, 2),
            "tokens_fed": c,
            "pages_imported": d,
            "at_ms": round((t0 - t_start) * 1000, 1),
            "phases_ms": {k: round(v * 1000, 2) for k, v in ph.items()},
            "gc_ms": round(gct.ms_within(t0 - b / 1000, t1), 2),  # in the step or the gap before it
            "background": timeline.overlapping(t0 - b / 1000, t1),
            **({"stall": stalls.steps[t0]} if stalls is not None and t0 in stalls.steps else {}),
        }

    pages = {i: h // args.block_size for i, h in long_hit.items()}
    prompt_pages = args.long_tokens // args.block_size
    out = {
        "itl_ms_p50": percentile(itl, 50),
        "itl_ms_p99": percentile(itl, 99),
        "itl_ms_max": max(itl) if itl else float("nan"),
        "itl_samples": len(itl),
        "step_ms_p50": percentile(step_ms, 50),
        "slowest_steps": [step_row(x) for x in sorted(slow, key=lambda x: -x[0])[:8]],
        "largest_gaps": [step_row(x) for x in sorted(slow, key=lambda x: -x[1])[:4]],
        "gc": gct.summary(),
        "host_tuning": tuned,
        "background_events": timeline.compact(t_start),
        # Pages each long prompt found cached at admission (pulled; fewer than half its pages:
        # it was prefilled locally, the fallback).
        "long_pages_hit": [pages[i] for i in sorted(pages)],
        "long_via_pull": sum(1 for n in pages.values() if 2 * n >= prompt_pages),
        "long_local_fallback": sum(1 for n in pages.values() if 2 * n < prompt_pages),
        "long_ttft_ms": ttft,
        "long_ttft_ms_p50": percentile(ttft, 50),
        "long_ttft_ms_max": max(ttft) if ttft else float("nan"),
        "long_served": len(firsts),
        # Long prompts admitted with their partial last page from a handoff (whole prompt cached).
        "long_tail_pages_used": eng.scheduler.tail_pages_used,
        "window_s": time.perf_counter() - t_start,
        "streams_started": born,
        # The pool imports' own copy time (CUDA events on the copy stream): their bandwidth.
        "import_pieces_bytes": eng.pages.import_bytes_total,
        "import_gpu_ms": round(eng.pages.import_seconds_total * 1000, 2),
        "import_bytes_per_step": kv_transfer.IMPORT_BYTES_PER_STEP,
    }
    if pull_ms:
        out["prefill_and_pull_ms"] = pull_ms
    print(mode, {k: v for k, v in out.items() if not isinstance(v, list)}, flush=True)
    for th in threads:
        th.join()
    if store is not None:
        store.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, out="bench/kv/results/interference_cpu.json")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--stream-prompt", type=int, default=128)
    p.add_argument("--stream-tokens", type=int, default=256)
    p.add_argument("--long-tokens", type=int, default=16384)
    p.add_argument("--long-out", type=int, default=4)
    p.add_argument("--long-count", type=int, default=2)
    p.add_argument("--long-every-s", type=float, default=2.0)
    p.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens (prefill chunk budget)")
    p.add_argument("--prefill-gpu", default="", help="CUDA_VISIBLE_DEVICES of the prefill service")
    p.add_argument("--modes", default="baseline,colocated,disaggregated")
    p.add_argument(
        "--host-tune",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="gc.freeze, gen-0 threshold, GIL switch interval after warm-up, as the services do "
        "(services/engine/host_tuning.py; --no-host-tune: without)",
    )
    p.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        help="the GIL switch interval host tuning sets (default: host_tuning.SWITCH_INTERVAL_S)",
    )
    p.add_argument("--gen0-threshold", type=int, default=None, help="the gen-0 GC threshold host tuning sets")
    p.add_argument(
        "--import-mib",
        type=int,
        default=None,
        help="bytes a decode step imports into its pool (kv_transfer.IMPORT_BYTES_PER_STEP), MiB",
    )
    p.add_argument(
        "--stall-ms",
        type=float,
        default=3.0,
        help="steps longer than this get every thread's stack sampled (common.StallSampler); 0: off",
    )
    args = p.parse_args()
    if args.import_mib is not None:
        kv_transfer.IMPORT_BYTES_PER_STEP = args.import_mib << 20
    work, model_dir = prepare(args)
    writer = ResultWriter(Path(args.out), "interference", args)
    modes = args.modes.split(",")
    cfg = RunConfig()
    cfg.kvstore.ram_bytes = 64 << 30
    if args.device == "cuda":
        # The prefill's near tier (in /dev/shm: the same-host handoff) holds a few 16k prompts:
        # at the 4 GiB default, half of it kept for the publisher, one 1.8 GB prompt at a time.
        cfg.kvstore.near.bytes = 16 << 30
    cfg.prefill.engine = engine_config(
        args.device,
        args.dtype,
        args.long_tokens + args.long_out + 64,
        block_size=args.block_size,
        num_kv_blocks=2 * -(-(args.long_tokens + 64) // args.block_size),
        max_batch_size=2,
        max_num_batched_tokens=max(args.chunk, 8192),
    )
    results: dict[str, Any] = {}
    with services(work / "services", cfg, weights=model_dir) as svc:
        if "disaggregated" in modes:
            env = {"CUDA_VISIBLE_DEVICES": args.prefill_gpu} if args.prefill_gpu else {}
            svc.start("prefill", "services.prefill", env)
            svc.url("prefill", "prefill")
        for mode in modes:
            results[mode] = run_mode(mode, args, model_dir, svc)
            writer.write({"summary": summary(results), "modes": results})  # partial: kept if killed
    print(summary(results))
    writer.write({"summary": summary(results), "modes": results}, done=True)


def summary(results: dict[str, Any]) -> dict[str, Any]:
    keys = ("itl_ms_p50", "itl_ms_p99", "itl_ms_max")
    out = {f"{m}_{k}": r[k] for m, r in results.items() for k in keys}
    for m, r in results.items():
        if m != "baseline":
            for k in ("long_via_pull", "long_local_fallback", "long_ttft_ms_p50", "long_ttft_ms_max"):
                out[f"{m}_{k}"] = r[k]
    base = results.get("baseline")
    if base:  # the goal: disaggregated p99 within 1.5x of the no-interference p99
        for m in ("colocated", "disaggregated"):
            if m in results:
                out[f"{m}_p99_over_baseline"] = results[m]["itl_ms_p99"] / base["itl_ms_p99"]
    return out


if __name__ == "__main__":
    main()
