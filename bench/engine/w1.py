"""Benchmark W1: relay's engine against HF transformers on one GPU, one JSON out.

    python3 bench/engine/w1.py --out $OUT/w1.json            # on the H200 (about 5-8 minutes)
    python bench/engine/w1.py --smoke --out /tmp/w1.json     # CPU, tiny model: checks the script runs
    # the multi-rank engine with 1 rank against the single-rank engine, same process (one GPU):
    python3 bench/engine/w1.py --variants triton+graphs+fused,triton+graphs+fused+ranks1 \
        --skip-hf --skip-kernels --out $OUT/w1_ranks1.json

W1: a Qwen3-0.6B-shaped model with random weights
(bf16), 256 prompts of 100-1024 tokens (random.seed(0): the 256 lengths, then each prompt's token
ids, uniform in [0, 10000]), exactly 512 new tokens each (EOS ignored), temperature 1.

What it measures (each phase in its own try/except; the JSON is rewritten after every phase, and
a watchdog writes it and exits if the whole run overstays --budget-s + 45 s):
  - per engine variant (attention backend x CUDA graphs [x fused kernels] [x overlap scheduling]): correctness (greedy tokens and their
    log-probs re-scored by HF transformers, teacher-forced, on the same weights) and W1 output
    tokens/s, with TTFT / inter-token latency percentiles of the 256 concurrent requests;
  - main variant: batch-1 decode step time against the time to read the weights once; TTFT / ITL
    at 1 and 32 concurrent requests;
  - HF transformers baselines: one padded `generate` batch of 256, padded batches of 64 (as many
    as the time cap allows), both with max_time caps;
  - kernels: one layer's attention at W1 shapes under a grid of launch settings, and the torch
    gather + SDPA path on the same batches.
Order: main variant, HF batch 256, kernels, the other variants, HF batches of 64 (what matters
most first, so a short budget drops the least useful parts).
The memory roofline is computed from the W1 prompt lengths: every decode step reads the weights
once plus every running sequence's KV, at the device copy bandwidth measured here.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from bench.results import write_result  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels run on CPU (slowly)

QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
SMOKE_MODEL = {
    **QWEN3_0_6B,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
NOMINAL_BW = 4.27e12  # bytes/s, device copy measured on the H200


# ----------------------------------------------------------------------------- bookkeeping


class Report:
    def __init__(self, path: Path):
        self.path = path
        self.data: dict[str, Any] = {}
        self.lock = threading.Lock()

    def save(self) -> None:
        with self.lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            write_result(tmp, self.data, default=str)
            tmp.replace(self.path)

    def phase(self, key: str, fn: Callable[[], Any]) -> Any:
        """Run one phase; its result (or the error) lands under `key`, and the file is rewritten."""
        t0 = time.perf_counter()
        print(f"[w1] {key} ...", flush=True)
        try:
            result = fn()
            entry = result if isinstance(result, dict) else {"result": result}
        except Exception as e:  # noqa: BLE001 - one failing variant must not lose the others
            traceback.print_exc()
            entry, result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}, None
        entry["phase_s"] = round(time.perf_counter() - t0, 2)
        with self.lock:
            self.data.setdefault("phases", {})[key] = entry
        self.save()
        print(f"[w1] {key}: {json.dumps(entry, default=str)[:600]}", flush=True)
        return result


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def pct(xs: list[float], ps: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    if not xs:
        return {}
    s = sorted(xs)
    out = {f"p{p}": round(s[min(len(s) - 1, int(p / 100 * len(s)))] * 1e3, 3) for p in ps}
    out["mean"] = round(sum(s) / len(s) * 1e3, 3)
    return out  # milliseconds


def free_gpu() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- workload


def w1_prompts(n: int, lo: int, hi: int, vocab_hi: int) -> list[list[int]]:
    random.seed(0)
    lengths = [random.randint(lo, hi) for _ in range(n)]
    return [[random.randint(0, vocab_hi) for _ in range(length)] for length in lengths]


def build_model_dir(model_kw: dict[str, Any], device: torch.device, dtype: torch.dtype, root: Path) -> Any:
    """A random-weight HF Qwen3 model (seed 0), saved where the engine reads it. Returns the model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(**model_kw, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    model = model.to(dtype).eval()
    model.generation_config.pad_token_id = 0
    model.save_pretrained(root)  # safetensors, HF names; tied lm_head omitted
    return model


def engine_config(
    args: argparse.Namespace,
    backend: str,
    graphs: bool,
    dtype: str,
    fused: bool = False,
    overlap: bool = False,
    fp8: bool = False,
    mixed: bool = True,
    pdl: bool = True,
    graph_sampling: bool = True,
) -> Any:
    from services.common.config import EngineConfig

    block = args.block_size
    max_seq = args.max_prompt + args.new_tokens
    pages = -(-max_seq // block)
    return EngineConfig(
        device=args.device,
        dtype=dtype,  # type: ignore[arg-type]
        max_batch_size=args.prompts,
        max_seq_len=max_seq,
        block_size=block,
        num_kv_blocks=args.prompts * pages + 64,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,  # random prompts share nothing; keep hashing out of the loop
        attention_backend=backend,  # type: ignore[arg-type]
        cuda_graphs=graphs,
        cuda_graph_mixed=mixed,
        pdl=pdl,
        graph_sampling=graph_sampling,
        fused_kernels=fused,
        overlap_schedule=overlap,
        quantization="fp8" if fp8 else "none",
    )


def requests(prompts: list[list[int]], new_tokens: int, temperature: float) -> list[Any]:
    from services.common.schemas import GenerateRequest, SamplingParams

    return [
        GenerateRequest(
            input_ids=p,
            sampling=SamplingParams(temperature=temperature, max_tokens=new_tokens, ignore_eos=True, seed=i),
        )
        for i, p in enumerate(prompts)
    ]


def drive(engine: Any, reqs: list[Any], time_cap_s: float) -> dict[str, Any]:
    """Run requests to completion with engine.step(), timing every step and every token's arrival."""
    t0 = time.perf_counter()
    states = [engine.add_request(r) for r in reqs]
    seen = [0] * len(states)
    arrivals: list[list[float]] = [[] for _ in states]
    step_times: list[float] = []
    decode_only: list[bool] = []
    truncated = False
    active = list(range(len(states)))
    while active:
        s0 = time.perf_counter()
        was_decode = engine.num_waiting == 0 and all(
            states[i].seqs[0].num_cached >= len(states[i].prompt) for i in active
        )
        engine.step()
        now = time.perf_counter()
        step_times.append(now - s0)
        decode_only.append(was_decode)
        still = []
        for i in active:
            out = states[i].seqs[0].output
            while seen[i] < len(out):
                arrivals[i].append(now)
                seen[i] += 1
            if not states[i].finished:
                still.append(i)
        active = still
        if now - t0 > time_cap_s:
            truncated = True
            engine.abort_all()
            break
    wall = time.perf_counter() - t0
    tokens = sum(seen)
    ttft = [a[0] - t0 for a in arrivals if a]
    itl = [b - a for arr in arrivals for a, b in zip(arr, arr[1:], strict=False)]
    dec = [t for t, d in zip(step_times, decode_only, strict=True) if d]
    return {
        "requests": len(reqs),
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "output_tok_s": round(tokens / wall, 1),
        "truncated_at_time_cap": truncated,
        "steps": len(step_times),
        "decode_only_steps": len(dec),
        "decode_step_ms": pct(dec),
        "first_steps_ms": [round(t * 1e3, 2) for t in step_times[:3]],
        "ttft_ms": pct(ttft),
        "itl_ms": pct(itl),
    }


# ----------------------------------------------------------------------------- phases


def measure_bandwidth(device: torch.device) -> float:
    """Device copy bandwidth (bytes read + written per second), 4.27 TB/s on the H200."""
    if device.type != "cuda":
        return NOMINAL_BW
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        y.copy_(x)
    end.record()
    sync()
    bw = 2 * x.numel() * 20 / (start.elapsed_time(end) / 1e3)
    del x, y
    free_gpu()
    return bw


def roofline(
    prompts: list[list[int]],
    new_tokens: int,
    weight_bytes: int,
    kv_per_token: int,
    bw: float,
    state_bytes_per_seq: int = 0,
) -> dict:
    """Decode steps only: step t reads the weights once and every sequence's KV (prompt + t), and
    moves `state_bytes_per_seq` for every sequence (a recurrent state read and written back)."""
    plens = [len(p) for p in prompts]
    per_step_state = state_bytes_per_seq * len(plens)
    total_s = sum(
        (weight_bytes + per_step_state + kv_per_token * sum(p + t for p in plens)) / bw
        for t in range(new_tokens)
    )
    return {
        "bandwidth_bytes_s": bw,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_per_token,
        "state_bytes_per_seq": state_bytes_per_seq,
        "decode_time_s": round(total_s, 3),
        "tok_s": round(len(prompts) * new_tokens / total_s, 1),
    }


def correctness(engine: Any, hf: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Greedy tokens from the engine, re-scored by HF (teacher-forced, same weights)."""
    resps = engine.generate(requests(prompts, new_tokens, temperature=0.0))
    agree, total, max_diff, diffs = 0, 0, 0.0, []
    clear_agree, clear_total = 0, 0
    tokens = []
    for p, r in zip(prompts, resps, strict=True):
        out = r.choices[0].output_ids
        tokens.append(out)
        ids = torch.tensor([p + out], device=hf.device)
        with torch.no_grad():
            logits = hf(ids).logits[0, len(p) - 1 : -1].float()
        logp = torch.log_softmax(logits, dim=-1)
        ref = logp.gather(1, torch.tensor(out, device=hf.device)[:, None])[:, 0].cpu()
        d = (ref - torch.tensor(r.choices[0].logprobs)).abs()
        diffs += d.tolist()
        max_diff = max(max_diff, float(d.max()))
        same = logits.argmax(-1).cpu() == torch.tensor(out)
        agree += int(same.sum())
        total += len(out)
        # Random weights give nearly flat distributions: where HF's top two are closer than bf16
        # rounding, either token is right. Count agreement where the top-2 gap is clear as well.
        top2 = logp.topk(2, dim=-1).values.cpu()
        clear = (top2[:, 0] - top2[:, 1]) > 0.05
        clear_agree += int(same[clear].sum())
        clear_total += int(clear.sum())
    return {
        "prompts": len(prompts),
        "tokens": total,
        "hf_argmax_agreement": round(agree / total, 4),
        "hf_argmax_agreement_where_gap_gt_0.05": round(clear_agree / clear_total, 4) if clear_total else None,
        "positions_with_clear_gap": clear_total,
        "logprob_abs_diff_max": round(max_diff, 5),
        "logprob_abs_diff_mean": round(sum(diffs) / len(diffs), 6),
        "greedy_tokens": tokens,
    }


def engine_variant(
    args: argparse.Namespace,
    model_dir: Path,
    hf: Any,
    prompts: list[list[int]],
    backend: str,
    graphs: bool,
    budget: Budget,
    extra: Callable[[Any], dict[str, Any]] | None = None,
    fused: bool = False,
    overlap: bool = False,
    fp8: bool = False,
    mixed: bool = True,
    pdl: bool = True,
    graph_sampling: bool = True,
    ranks1: bool = False,
) -> dict[str, Any]:
    from services.common.config import ParallelConfig
    from services.engine import LLMEngine
    from services.engine.parallel.engine import ParallelEngine
    from services.engine.parallel.group import EngineGroups

    res: dict[str, Any] = {
        "attention_backend": backend,
        "cuda_graphs": graphs,
        "cuda_graph_mixed": graphs and mixed,
        "fused_kernels": fused,
        "overlap_schedule": overlap,
        "quantization": "fp8" if fp8 else "none",
        "graph_sampling": graph_sampling,
        "engine": "ParallelEngine, 1 rank" if ranks1 else "LLMEngine",
    }
    t0 = time.perf_counter()
    cfg = engine_config(args, backend, graphs, args.dtype, fused, overlap, fp8, mixed, pdl, graph_sampling)
    if ranks1:  # the multi-rank code path (orders, RankRunner, ShardedSampler) with one rank
        engine = ParallelEngine(model_dir, cfg, ParallelConfig(), EngineGroups.single())
    else:
        engine = LLMEngine(model_dir, cfg)
    sync()
    res["engine_init_s"] = round(time.perf_counter() - t0, 2)
    res["pdl"] = engine.pdl  # EngineConfig.pdl (default on), as resolved on this device
    res["graph_sizes"] = engine.graphs.sizes if engine.graphs is not None else []
    try:
        check = [p[: args.check_prompt_len] for p in prompts[:4]]
        res["correctness"] = correctness(engine, hf, check, args.check_tokens)
        # Warm-up: Triton compiles the kernel variants of mixed and decode steps.
        engine.generate(requests([p[:300] for p in prompts[:40]], 8, 1.0))
        sync()
        cap = max(10.0, min(args.variant_cap_s, budget.left() - 30))
        res["w1"] = drive(engine, requests(prompts, args.new_tokens, 1.0), cap)
        if extra is not None:
            res.update(extra(engine))
    finally:
        del engine
        free_gpu()
    return res


def batch1_and_latency(
    args: argparse.Namespace, engine: Any, prompts: list[list[int]], weight_bytes: int, bw: float
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # Batch 1: a 512-token prompt, then decode steps (each: graph replay + logits + sampler).
    r = drive(engine, requests([prompts[0][:512]], min(256, args.new_tokens), 1.0), 60)
    weight_read_ms = weight_bytes / bw * 1e3
    out["batch1"] = {
        "step_ms": r["decode_step_ms"],
        "weight_read_ms_measured_bw": round(weight_read_ms, 3),
        "weight_read_ms_nominal_bw": round(weight_bytes / NOMINAL_BW * 1e3, 3),
        "step_over_weight_read_p50": round(r["decode_step_ms"].get("p50", 0) / weight_read_ms, 2),
    }
    if engine.graphs is not None:
        # The captured forward alone (no logits, no sampler), on the last step's inputs: it rewrites
        # that token's K/V with the same values into pages that are free by now.
        g = engine.graphs.graphs[engine.graphs.last_key]
        for _ in range(5):
            g.replay()
        sync()
        times = []
        for _ in range(50):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        out["batch1"]["graph_forward_ms"] = pct(times)
        emb = engine.model.model.embed_tokens.weight
        lm = emb.numel() * emb.element_size() if engine.model.lm_head is None else 0
        out["batch1"]["graph_weight_read_ms"] = round((weight_bytes - lm) / bw * 1e3, 3)
    for conc in (1, 32):
        out[f"concurrency_{conc}"] = drive(engine, requests(prompts[:conc], args.new_tokens, 1.0), 60)
    return out


def _time_ms(fn: Callable[[], None], reps: int) -> float:
    """Median milliseconds of fn on the device (CUDA events), after warm-up."""
    for _ in range(3):
        fn()
    sync()
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def sampler_bench(vocab: int) -> dict[str, Any]:
    """The sampler alone on [batch, vocab] bf16 logits at T=1 (and greedy): the torch path (float32
    copy, float64 inverse-CDF) against the fused kernel (kernels/sampling.py), wall time including
    the read of the sampled tokens (what a step pays). Also: the fused log-probs against
    log_softmax, and greedy tokens of both paths."""
    import random as _random

    from services.common.schemas import SamplingParams
    from services.engine.layers.sampler import Sampler

    if not torch.cuda.is_available():
        return {"skipped": "needs CUDA (the interpreter is too slow at this vocabulary)"}
    out: dict[str, Any] = {}
    for batch in (1, 32, 256):
        g = torch.Generator(device="cuda").manual_seed(batch)
        logits = (torch.randn(batch, vocab, device="cuda", generator=g) * 3).to(torch.bfloat16)
        row: dict[str, Any] = {}
        for temp in (1.0, 0.0):
            params = [SamplingParams(temperature=temp)] * batch
            for name, fused in (("torch", False), ("fused", True)):
                sampler = Sampler(fused=fused)
                rngs = [_random.Random(i) for i in range(batch)]
                times = []
                for _ in range(23):
                    sync()
                    t0 = time.perf_counter()
                    res = sampler.sample(logits, params, rngs)
                    times.append((time.perf_counter() - t0) * 1e3)
                row[f"{name}_T{temp:g}_ms"] = round(sorted(times[3:])[10], 3)
                if fused:
                    ref = torch.log_softmax(logits.float() / (temp or 1.0), -1)
                    idx = torch.tensor(res.tokens, device="cuda")[:, None]
                    diff = (ref.gather(1, idx)[:, 0] - torch.tensor(res.logprobs, device="cuda")).abs()
                    row[f"fused_T{temp:g}_logprob_max_abs_diff"] = float(diff.max())
                if temp == 0:
                    row.setdefault("greedy_tokens", {})[name] = res.tokens[:8]
        row["greedy_equal"] = row["greedy_tokens"]["torch"] == row["greedy_tokens"]["fused"]
        out[f"batch={batch}"] = row
    return out


def kernel_bench(args: argparse.Namespace, prompts: list[list[int]], model_kw: dict[str, Any]) -> dict:
    """One layer's attention alone, at W1 shapes: the Triton decode kernel under several launch
    settings (achieved KV bandwidth), the torch path (gather + SDPA) on the same batch, and the
    prefill kernel. Each setting's output is checked against the first one's."""
    from services.engine.batch import ForwardBatch, HostBatch, Span, num_sms
    from services.engine.kernels import paged_attention as pa

    dev = torch.device(args.device)
    dt = getattr(torch, args.dtype)
    n_kv, h, d, page = (
        model_kw["num_key_value_heads"],
        model_kw["num_attention_heads"],
        model_kw["head_dim"],
        16,
    )
    scale = d**-0.5
    reps = 20 if dev.type == "cuda" else 1
    mid = args.new_tokens // 2  # mean decode position past the prompt
    cases = {
        f"decode_b{len(prompts)}": [len(p) + mid for p in prompts],
        "decode_b32": [len(p) + mid for p in prompts[:32]],
        "decode_b1": [max(len(p) for p in prompts) + mid],
    }
    total_pages = sum(-(-c // page) for c in cases[f"decode_b{len(prompts)}"]) + 8
    torch.manual_seed(0)
    kc = torch.randn(total_pages * page, n_kv, d, device=dev).to(dt)
    vc = torch.randn(total_pages * page, n_kv, d, device=dev).to(dt)
    rng = random.Random(0)
    sms = num_sms(dev)
    grid = [
        {"block_n": bn, "num_warps": w, "num_stages": st}
        for bn in (32, 64, 128)
        for w in (4, 8)
        for st in (2, 3, 4)
    ]
    if dev.type != "cuda":
        grid = grid[:2]
    out: dict[str, Any] = {
        "decode_default": dict(pa.DECODE_TUNING),
        "prefill_default": dict(pa.PREFILL_TUNING),
    }
    for name, ctxs in cases.items():
        pages = list(range(total_pages))
        rng.shuffle(pages)
        spans = []
        for c in ctxs:
            n = -(-c // page)
            spans.append(Span([pages.pop() for _ in range(n)], c - 1, [0]))
        hb = HostBatch.build(spans, page)
        fb = hb.to_forward_batch(dev, n_kv, sms)
        assert fb.paged is not None and fb.paged.decode is not None
        meta = fb.paged.decode
        q = torch.randn(len(ctxs), h, d, device=dev).to(dt)
        kv_bytes = sum(ctxs) * n_kv * d * 2 * dt.itemsize
        res: dict[str, Any] = {
            "batch": len(ctxs),
            "kv_mb": round(kv_bytes / 2**20, 1),
            "decode_items": 0 if meta.work is None else int(meta.work.item_row.shape[0]),
        }
        ref = None
        runs = []
        for tuning in grid:
            o = torch.empty_like(q)
            try:
                ms = _time_ms(
                    lambda o=o, t=tuning, q=q, m=meta: pa.decode_attention(q, kc, vc, o, m, scale, page, t),
                    reps,
                )
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for one setting
                runs.append({**tuning, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                continue
            ref = o.float() if ref is None else ref
            err = float((o.float() - ref).abs().max())
            runs.append(
                {**tuning, "us": round(ms * 1e3, 1), "gb_s": round(kv_bytes / ms / 1e6, 1), "max_diff": err}
            )
        res["triton"] = runs
        if ref is not None:  # the first setting against plain torch, on a few sequences
            c = min(4, len(ctxs))
            tables = [sp.block_table for sp in spans[:c]]
            r = pa.reference_attention(q[:c], kc, vc, list(range(c)), [1] * c, ctxs[:c], tables, scale, page)
            res["max_diff_vs_reference"] = float((ref[:c] - r).abs().max())
        ok = [r for r in runs if "us" in r]
        if ok:
            res["best"] = min(ok, key=lambda r: r["us"])
        # The torch path on the same batch: gather the pages (bucketed like layers/attention.py) + SDPA.
        tb = ForwardBatch.build(spans, dev, max(ctxs) + page, page)
        g = tb.groups[0]

        def torch_path(g: Any = g, q: torch.Tensor = q, nb: int = len(ctxs)) -> None:
            b, n = g.block_tables.shape
            rows = (g.block_tables[:, :, None] * page + torch.arange(page, device=dev)).view(b, n * page)
            kk, vv = kc[rows], vc[rows]
            qg = q[g.q_index.clamp(max=nb - 1)]
            torch.nn.functional.scaled_dot_product_attention(
                qg.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), attn_mask=g.mask, scale=scale,
                enable_gqa=h != n_kv,
            )  # fmt: skip

        try:
            ms = _time_ms(torch_path, reps)
            res["torch_gather_sdpa"] = {"us": round(ms * 1e3, 1), "gb_s_of_kv": round(kv_bytes / ms / 1e6, 1)}
        except Exception as e:  # noqa: BLE001
            res["torch_gather_sdpa"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        out[name] = res
    # Prefill: 8 fresh prompts of 1024 tokens (one chunk of 8192), causal.
    lens = [1024] * 8 if dev.type == "cuda" else [40, 24]
    pages = list(range(total_pages))
    rng.shuffle(pages)
    spans = [Span([pages.pop() for _ in range(-(-n // page))], 0, [0] * n) for n in lens]
    fb = HostBatch.build(spans, page).to_forward_batch(dev, n_kv, sms)
    assert fb.paged is not None and fb.paged.prefill is not None
    pmeta = fb.paged.prefill
    q = torch.randn(sum(lens), h, d, device=dev).to(dt)
    flops = sum(4 * h * d * n * (n + 1) / 2 for n in lens)
    runs = []
    ref = None
    pgrid = [
        {"block_m": bm, "block_n": bn, "num_warps": w, "num_stages": 3}
        for bm in (64, 128)
        for bn in (32, 64)
        for w in (4, 8)
    ]
    for tuning in pgrid if dev.type == "cuda" else pgrid[:1]:
        o = torch.empty_like(q)
        try:
            ms = _time_ms(
                lambda o=o, t=tuning: pa.prefill_attention(q, kc, vc, o, pmeta, scale, page, t), reps
            )
        except Exception as e:  # noqa: BLE001
            runs.append({**tuning, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        ref = o.float() if ref is None else ref
        runs.append(
            {**tuning, "us": round(ms * 1e3, 1), "tflop_s": round(flops / ms / 1e9, 1),
             "max_diff": float((o.float() - ref).abs().max())}
        )  # fmt: skip
    if ref is not None:  # the first setting against plain torch, on the first prompt
        r = pa.reference_attention(q, kc, vc, [0], lens[:1], lens[:1], [spans[0].block_table], scale, page)
        out["prefill_max_diff_vs_reference"] = float((ref[: lens[0]] - r[: lens[0]]).abs().max())
    out["prefill_8x1024"] = {
        "runs": runs,
        "best": min((r for r in runs if "us" in r), key=lambda r: r["us"], default=None),
    }
    return out


def hf_generate(hf: Any, prompts: list[list[int]], new_tokens: int, max_time: float) -> dict[str, Any]:
    """One padded (left) `generate` call; max_time caps it (then fewer tokens per row)."""
    dev = hf.device
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids.to(dev),
            attention_mask=mask.to(dev),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_time=max_time,
            pad_token_id=0,
        )
    sync()
    wall = time.perf_counter() - t0
    generated = (out.shape[1] - width) * len(prompts)
    return {
        "batch": len(prompts),
        "new_tokens_per_row": out.shape[1] - width,
        "output_tokens": generated,
        "wall_s": round(wall, 2),
        "output_tok_s": round(generated / wall, 1),
        "truncated_by_max_time": out.shape[1] - width < new_tokens,
    }


def hf_batches(hf: Any, prompts: list[list[int]], new_tokens: int, size: int, cap_s: float) -> dict[str, Any]:
    """Padded batches of `size` in order, while the time cap lasts; tok/s over completed batches."""
    done: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), size):
        left = cap_s - (time.perf_counter() - t0)
        if left < 5:
            break
        done.append(hf_generate(hf, prompts[i : i + size], new_tokens, left))
    tokens = sum(d["output_tokens"] for d in done)
    wall = sum(d["wall_s"] for d in done)
    return {
        "batch": size,
        "batches_run": len(done),
        "batches_in_workload": -(-len(prompts) // size),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / wall, 1) if wall else 0.0,
        "runs": done,
    }


# ----------------------------------------------------------------------------- main


def profile_setup(
    smoke: bool, baseline: str
) -> tuple[bool, torch.device, torch.dtype, dict[str, Any], dict[str, Any]]:
    """The profiling scripts' common start: (cuda, device, dtype, the model shape, the report's
    header: command, date, machine, baseline). --smoke (or no GPU): the CPU smoke model in float32."""
    import platform

    cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda" if cuda else "cpu")
    report: dict[str, Any] = {
        "command": " ".join(["python3", *sys.argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), **environment(device)},
        "baseline": baseline,
    }
    dtype = torch.bfloat16 if cuda else torch.float32
    return cuda, device, dtype, QWEN3_0_6B if cuda else SMOKE_MODEL, report


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "date": datetime.now(UTC).isoformat(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "host": os.uname().nodename,
    }
    for mod in ("triton", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            env[mod] = f"unavailable: {e}"
    try:
        env["nvidia_smi"] = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except Exception as e:  # noqa: BLE001
        env["nvidia_smi"] = f"unavailable: {e}"
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write (rewritten after every phase)")
    ap.add_argument("--smoke", action="store_true", help="tiny model and workload (CPU check of the script)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="soft budget; hard exit at +45 s")
    ap.add_argument("--variant-cap-s", type=float, default=60.0, help="cap on one variant's W1 run")
    ap.add_argument("--hf-cap-s", type=float, default=100.0, help="cap on each HF baseline")
    ap.add_argument("--variants", default="triton+graphs,triton+graphs+fused,triton,torch")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-kernels", action="store_true", help="skip the kernels and sampler phases")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    args.device = "cuda" if cuda else "cpu"
    smoke = args.smoke or not cuda
    args.prompts, args.min_prompt, args.max_prompt, args.new_tokens = (
        (8, 10, 40, 12) if smoke else (256, 100, 1024, 512)
    )
    args.vocab_hi = 400 if smoke else 10000
    args.check_prompt_len, args.check_tokens = (20, 6) if smoke else (256, 32)
    args.dtype = "bfloat16" if cuda else "float32"
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)

    report = Report(Path(args.out))
    budget = Budget(args.budget_s)

    def watchdog() -> None:
        report.data["killed_by_watchdog"] = f"exceeded {args.budget_s + 45:.0f} s"
        report.save()
        print("[w1] watchdog: time is up, exiting", flush=True)
        os._exit(3)

    timer = threading.Timer(args.budget_s + 45, watchdog)
    timer.daemon = True
    timer.start()

    report.data["environment"] = environment(device)
    report.data["workload"] = {
        "name": "W1" if not smoke else "W1-smoke",
        "prompts": args.prompts,
        "prompt_len": [args.min_prompt, args.max_prompt],
        "new_tokens": args.new_tokens,
        "temperature": 1.0,
        "dtype": args.dtype,
        "model": SMOKE_MODEL if smoke else QWEN3_0_6B,
    }
    report.save()
    prompts = w1_prompts(args.prompts, args.min_prompt, args.max_prompt, args.vocab_hi)
    root = Path(tempfile.mkdtemp(prefix="w1-"))
    hf = build_model_dir(SMOKE_MODEL if smoke else QWEN3_0_6B, device, dtype, root)
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    m = hf.config
    kv_per_token = 2 * m.num_hidden_layers * m.num_key_value_heads * m.head_dim * dtype.itemsize
    bw = measure_bandwidth(device)
    report.data["roofline"] = {
        "measured_bw": roofline(prompts, args.new_tokens, weight_bytes, kv_per_token, bw),
        "nominal_bw": roofline(prompts, args.new_tokens, weight_bytes, kv_per_token, NOMINAL_BW),
    }
    if any("fp8" in v.split("+") for v in args.variants.split(",")):
        # An fp8 engine reads its quantised linears once per step: 1 byte per weight plus one
        # float32 scale per 128x128 block; embeddings, lm_head and norms stay in `dtype`.
        fp8_bytes = sum(
            p.numel() + 4 * (-(-p.shape[0] // 128)) * (-(-p.shape[1] // 128))
            if n.endswith("proj.weight")
            else p.numel() * p.element_size()
            for n, p in hf.named_parameters()
        )
        report.data["roofline_fp8_weights"] = {
            "measured_bw": roofline(prompts, args.new_tokens, fp8_bytes, kv_per_token, bw)
        }
    report.save()

    main_engine: dict[str, Any] = {}

    def keep_main(engine: Any) -> dict[str, Any]:
        return batch1_and_latency(args, engine, prompts, weight_bytes, bw)

    def variant(name: str) -> None:
        # "<backend>[+graphs][+fused][+overlap][+fp8][+nomixed][+nopdl][+nogs][+ranks1]"
        # (EngineConfig.fused_kernels, .overlap_schedule, .quantization; nomixed: cuda_graph_mixed
        # off, mixed steps eager; nopdl: EngineConfig.pdl off; nogs: graph_sampling off; ranks1:
        # the multi-rank engine with one rank, parallel/engine.py)
        backend, *opts = name.split("+")
        graphs = "graphs" in opts and cuda
        fused = "fused" in opts
        overlap = "overlap" in opts
        fp8 = "fp8" in opts
        mixed = "nomixed" not in opts
        pdl = "nopdl" not in opts
        graph_sampling = "nogs" not in opts
        if budget.left() < 40:
            report.data.setdefault("skipped", []).append(f"variant {name}: out of time")
            return
        first = not main_engine
        res = report.phase(
            f"engine[{name}]",
            lambda: engine_variant(
                args,
                root,
                hf,
                prompts,
                backend,
                graphs,
                budget,
                keep_main if first else None,
                fused,
                overlap,
                fp8,
                mixed,
                pdl,
                graph_sampling,
                "ranks1" in opts,
            ),
        )
        if res is not None and first:
            main_engine["name"] = name

    def hf_baseline(size: int) -> None:
        if args.skip_hf:
            return
        if budget.left() < 20:
            report.data.setdefault("skipped", []).append(f"hf batch {size}: out of time")
            return
        cap = min(args.hf_cap_s, budget.left() - 10)
        report.phase(
            f"hf_generate[batch={size}]", lambda: hf_batches(hf, prompts, args.new_tokens, size, cap)
        )
        free_gpu()  # HF's KV cache at batch 256 is ~45 GB; the next engine wants its own pool

    # Most important first: the main variant (with batch-1 and latency), the HF batch that was
    # HF's best, the other variants, then HF in batches of 64 with whatever time is left.
    names = args.variants.split(",")
    variant(names[0])
    hf_baseline(args.prompts)
    if args.skip_kernels:
        report.data.setdefault("skipped", []).append("kernels, sampler: --skip-kernels")
    elif budget.left() > 60:
        report.phase("kernels", lambda: kernel_bench(args, prompts, SMOKE_MODEL if smoke else QWEN3_0_6B))
    else:
        report.data.setdefault("skipped", []).append("kernels: out of time")
    if budget.left() > 30 and not args.skip_kernels:
        report.phase("sampler", lambda: sampler_bench(QWEN3_0_6B["vocab_size"]))
    for name in names[1:]:
        variant(name)
    hf_baseline(max(1, args.prompts // 4))

    summarize(report, main_engine.get("name"))
    report.save()
    timer.cancel()
    print(f"[w1] wrote {args.out}", flush=True)


def overlap_agreement(phases: dict[str, Any]) -> dict[str, bool]:
    """For each `...+overlap` variant run next to the same variant without it: whether the greedy
    tokens of the correctness check are identical (overlap scheduling must not change tokens)."""
    out = {}
    for k, v in phases.items():
        if not (k.startswith("engine[") and k.endswith("+overlap]")):
            continue
        base = phases.get(k.replace("+overlap]", "]"), {})
        a, b = v.get("correctness", {}).get("greedy_tokens"), base.get("correctness", {}).get("greedy_tokens")
        if a is not None and b is not None:
            out[k] = a == b
    return out


def ranks1_ratio(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    """For each `...+ranks1` variant run next to the same variant without it: its W1 tok/s over the
    single-rank engine's (the multi-rank code path's cost with one rank; goal >= 0.97)."""
    out = {}
    for k, v in rows.items():
        base = rows.get(k.replace("+ranks1]", "]")) if k.endswith("+ranks1]") else None
        if base and base["output_tok_s"]:
            out[k] = round(v["output_tok_s"] / base["output_tok_s"], 3)
    return out


def summarize(report: Report, main: str | None) -> None:
    """The headline numbers next to each other."""
    phases = report.data.get("phases", {})
    roof = report.data.get("roofline", {}).get("measured_bw", {}).get("tok_s")
    hf_best = max(
        (
            v.get("output_tok_s", 0)
            for k, v in phases.items()
            if k.startswith("hf_generate") and "error" not in v
        ),
        default=0,
    )
    rows = {}
    for k, v in phases.items():
        if k.startswith("engine[") and "w1" in v:
            tps = v["w1"]["output_tok_s"]
            rows[k] = {
                "output_tok_s": tps,
                "fraction_of_roofline": round(tps / roof, 3) if roof else None,
                "x_hf_best": round(tps / hf_best, 2) if hf_best else None,
                "truncated": v["w1"]["truncated_at_time_cap"],
            }
    report.data["summary"] = {
        "ranks1_over_single_rank": ranks1_ratio(rows),
        "overlap_same_greedy_tokens": overlap_agreement(phases),
        "main_variant": main,
        "roofline_tok_s": roof,
        "hf_best_tok_s": hf_best,
        "engines": rows,
        "goal": ">= 60% of roofline; batch-1 step <= 2x weight read",
    }


if __name__ == "__main__":
    main()
