"""Where the batch-1 decode step's time goes (the target: a step within 2x of one weight read).

Builds W1's Qwen3-0.6B-shaped random-weight model, runs the engine with its CUDA defaults (Triton
paged attention, CUDA graphs, fused kernels, overlap scheduling), prefills one 512-token prompt,
decodes a few tokens, then profiles the captured batch-1 graph's replays with torch.profiler (CUPTI
records the kernels inside a graph) and, separately, the whole engine step. Reports per kernel
(name, calls per replay, mean us, share), per category (GEMM, attention, norm/rope/elementwise,
other), the kernel count per layer, and each decode GEMM's time next to the time to read its
weight at the measured copy bandwidth: which kernels are latency-bound, not bandwidth-bound.

    python3 bench/engine/profile_batch1.py --out $OUT/profile_batch1.json      (H200)
    .venv/bin/python bench/engine/profile_batch1.py --out /tmp/p.json --smoke  (CPU: eager, no graph)

--compare FIELDS (boolean EngineConfig switches, comma-separated; docs/engine.md): in one process,
builds the engine with the switches all off and all on (same weights, same decode-GEMM choices:
they are made once per process), runs the greedy tokens of a few prompts (each alone, then all as
one batch) keeping every logits row of the batch-1 runs, and reports for both the batch-1 graph
replay time (alternating between the two engines), the engine step time and the kernel count per
replay. Exits 2, after writing the JSON, if the check fails:
- `pdl` alone (Programmatic Dependent Launch): the same arithmetic, so the tokens must be
  identical and the logits within one float32 ulp (a difference is a race: a kernel reading
  before its wait);
- anything else may sum in another order, so logits may differ by bf16 rounding: each row until
  the first greedy token that differs must be within 1% of the row's largest logit.
--pin-gemv FILE pins the decode-GEMM choices a results file recorded instead of timing ~30
Triton configurations at warm-up (for a short GPU call).

    python3 bench/engine/profile_batch1.py --compare pdl --out $OUT/pdl_compare.json        (H200)
    .venv/bin/python bench/engine/profile_batch1.py --compare pdl --smoke --out /tmp/p.json   (CPU)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from bench.engine.w1 import build_model_dir, measure_bandwidth, profile_setup
from bench.results import write_result
from services.engine.kernels.gemv import graph_time_us, replay_us


def categorize(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("gemm", "gemv", "nvjet", "cutlass", "sm90_xmma", "matmul", "splitk")):
        return "gemm"
    if any(s in n for s in ("attn", "attention", "paged", "decode_kernel", "reduce_partitions")):
        return "attention"
    if any(s in n for s in ("norm", "rope", "silu", "act_and_mul", "elementwise", "add", "mul", "copy")):
        return "norm_rope_elementwise"
    return "other"


def kernel_table(prof: Any, replays: int) -> list[dict[str, Any]]:
    agg: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            agg[e.name].append(e.device_time)  # us
    total = sum(sum(v) for v in agg.values()) or 1.0
    rows = [
        {
            "kernel": name[:160],
            "category": categorize(name),
            "calls_per_replay": round(len(ts) / replays, 2),
            "mean_us": round(sum(ts) / len(ts), 2),
            "us_per_replay": round(sum(ts) / replays, 1),
            "share": round(sum(ts) / total, 4),
        }
        for name, ts in agg.items()
    ]
    return sorted(rows, key=lambda r: -r["us_per_replay"])


def gemm_vs_bandwidth(model: Any, device: torch.device, bw: float) -> list[dict[str, Any]]:
    """Each distinct decode GEMM of one layer at M = 1, eager (cuBLAS, as the graph runs it): time vs its
    weight read at the copy bandwidth. Latency-bound GEMMs are what a 2x step cannot afford."""
    layer = model.model.layers[0]
    out = []
    seen = set()
    for name, mod in layer.named_modules():
        w = getattr(mod, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or tuple(w.shape) in seen:
            continue
        seen.add(tuple(w.shape))
        x = torch.randn(1, w.shape[1], device=device, dtype=w.dtype)
        for _ in range(10):
            torch.nn.functional.linear(x, w)
        us = graph_time_us(lambda x=x, w=w: torch.nn.functional.linear(x, w))
        read_us = w.numel() * w.element_size() / bw * 1e6
        out.append(
            {
                "module": name,
                "shape": list(w.shape),
                "us_in_graph": round(us, 2),
                "weight_read_us": round(read_us, 2),
                "over_read": round(us / read_us, 2),
            }
        )
    return out


def engine_config(
    cuda: bool, device: torch.device, switch: dict[str, bool] | None = None, max_batch: int = 8
) -> Any:
    """The engine's CUDA defaults, a small pool and batch. With a switch ({field: value},
    --compare), those fields set and no mixed-step graphs (prompts here are <= 512 tokens)."""
    from services.common.config import EngineConfig

    # The decode graphs only: a compare times the batch-1 decode step, and the mixed-step graphs
    # would be captured twice for nothing.
    extra: dict[str, Any] = (
        {} if switch is None else {**switch, "max_num_batched_tokens": 2048, "cuda_graph_mixed": False}
    )
    return EngineConfig(
        device=device.type,
        dtype="bfloat16" if cuda else "float32",
        max_batch_size=max_batch,
        max_seq_len=1536,
        num_kv_blocks=256,
        enable_prefix_caching=False,
        **extra,
    )


def step_times_ms(eng: Any, prompt: list[int], cuda: bool, tokens: int = 64) -> dict[str, float | None]:
    """One request of `tokens` tokens, stepped to the end: the median step with a sync after each
    (the historical figure) and the mean step of the decode phase without per-step syncs (what
    overlap scheduling delivers: step N+1 is launched before N's tokens are read)."""
    from services.common.schemas import GenerateRequest, SamplingParams

    def request() -> Any:
        sampling = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True)
        return eng.add_request(GenerateRequest(input_ids=prompt, sampling=sampling))

    state = request()
    synced = []
    while not state.finished:
        t0 = time.perf_counter()
        eng.step()
        if cuda:
            torch.cuda.synchronize()
        synced.append((time.perf_counter() - t0) * 1e3)
    state = request()
    for _ in range(8):  # prefill and the first decodes
        eng.step()
    if cuda:
        torch.cuda.synchronize()
    n, t0 = 0, time.perf_counter()
    while not state.finished:
        eng.step()
        n += 1
    if cuda:
        torch.cuda.synchronize()
    tail = synced[8:]
    return {
        "engine_step_ms_median": round(sorted(tail)[len(tail) // 2], 4) if tail else None,
        "engine_step_ms_unsynced_mean": round((time.perf_counter() - t0) * 1e3 / n, 4) if n else None,
    }


def profile_replays(graph: Any, replays: int, n_layers: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Kernels of `replays` replays of a captured graph (CUPTI sees the kernels inside a graph)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    rows = kernel_table(prof, replays)
    per_replay = round(sum(r["calls_per_replay"] for r in rows), 1)
    cats: dict[str, float] = defaultdict(float)
    for r in rows:
        cats[r["category"]] += r["us_per_replay"]
    summary = {
        "kernels_per_replay": per_replay,
        "kernels_per_layer": round(per_replay / n_layers, 2),
        # With PDL kernels overlap, so this sum can exceed the replay's wall time.
        "kernel_us_per_replay": round(sum(r["us_per_replay"] for r in rows), 1),
        "categories_us_per_replay": {k: round(v, 1) for k, v in cats.items()},
    }
    return summary, rows


def profile_one(args: argparse.Namespace, cuda: bool, device: torch.device, root: Path, report: dict[str, Any],
                weight_bytes: int) -> None:  # fmt: skip
    """The single-engine profile (config defaults, PDL included): where the batch-1 step goes."""
    from services.engine import LLMEngine

    eng = LLMEngine(root, engine_config(cuda, device))
    report["pdl"] = eng.pdl
    prompt = list(range(2, 514)) if cuda else list(range(2, 40))
    report.update(step_times_ms(eng, prompt, cuda))
    if cuda and eng.graphs is not None:
        bw = measure_bandwidth(device)
        report["bandwidth_bytes_s"] = bw
        report["weight_read_ms"] = weight_bytes / bw * 1e3
        g = eng.graphs.graphs[eng.graphs.last_key]
        report["graph_replay_ms"] = replay_us(g, 50) / 1e3
        summary, rows = profile_replays(g, args.replays, len(eng.model.model.layers))
        report.update(summary)
        report["kernels"] = rows[:40]
        report["gemm_vs_bandwidth"] = gemm_vs_bandwidth(eng.model, device, bw)
        from services.engine.kernels import gemv

        report["decode_gemm_choices"] = gemv.choices()  # kernels/gemv.py, chosen at graph warm-up
        # The whole step (graph + logits + sampler + host), for where the rest goes.
        from torch.profiler import ProfilerActivity, profile

        from services.common.schemas import GenerateRequest, SamplingParams

        eng.add_request(
            GenerateRequest(
                input_ids=prompt, sampling=SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
            )
        )
        for _ in range(10):
            eng.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(args.replays):
                eng.step()
            torch.cuda.synchronize()
        step_rows = kernel_table(prof, args.replays)
        report["step_kernels_outside_graph"] = [r for r in step_rows if r["calls_per_replay"] <= 3][:25]


class LogitsTap:
    """Keeps a copy of every logits tensor the engine computes, to compare two engines' numerics
    row by row: CausalLM.logits outside a graph, and the decode graphs' static logits after each
    replay (a clone queued behind it)."""

    def __init__(self, eng: Any):
        self.rows: list[torch.Tensor] = []
        self.taps = [(eng.model, "logits")]
        if eng.graphs is not None:
            self.taps.append((eng.graphs, "run"))
        for obj, name in self.taps:
            fn = getattr(obj, name)
            # An instance attribute: shadows the method until close().
            setattr(obj, name, lambda *a, fn=fn, **k: self.keep(fn(*a, **k)))

    def keep(self, out: torch.Tensor) -> torch.Tensor:
        self.rows.append(out.detach().clone())
        return out

    def close(self) -> list[torch.Tensor]:
        for obj, name in self.taps:
            delattr(obj, name)
        return self.rows


def greedy_runs(eng: Any, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    """Greedy tokens of each prompt alone (the batch-1 graph) with every logits row, then of all
    prompts as one batch (a larger graph)."""
    from services.common.schemas import GenerateRequest, SamplingParams

    def req(p: list[int]) -> Any:
        return GenerateRequest(
            input_ids=p, sampling=SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        )

    tap = LogitsTap(eng)
    try:
        alone = [eng.generate([req(p)])[0].choices[0].output_ids for p in prompts]
    finally:
        logits = tap.close()
    batched = [r.choices[0].output_ids for r in eng.generate([req(p) for p in prompts])]
    return {"alone": alone, "batched": batched, "logits": logits}


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between same-shaped float tensors (same-sign
    values: adjacent floats have adjacent integer bit patterns)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return -1
    if not a.dtype.is_floating_point:
        return 0 if torch.equal(a, b) else -1
    as_int = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
    return int((a.view(as_int).long() - b.view(as_int).long()).abs().max()) if a.numel() else 0


def rows_before_divergence(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The logits rows in order up to and including the first whose greedy token differs: after
    it the two runs decode different contexts."""
    kept = []
    for a, b in pairs:
        kept.append((a, b))
        if a.shape != b.shape or not torch.equal(a.argmax(-1), b.argmax(-1)):
            break
    return kept


def compare(args: argparse.Namespace, cuda: bool, device: torch.device, root: Path, report: dict[str, Any],
            weight_bytes: int, vocab: int) -> bool:  # fmt: skip
    """Both engines (args.compare's fields all off, all on) in this process; returns True if the
    check passes."""
    from services.engine import LLMEngine

    fields = args.compare.split(",")
    rng = random.Random(0)
    lengths = (512, 100, 37, 300) if cuda else (30, 9, 17, 4)
    prompts = [[rng.randrange(2, vocab) for _ in range(n)] for n in lengths]
    engines = {
        name: LLMEngine(root, engine_config(cuda, device, dict.fromkeys(fields, value), 4))
        for name, value in (("off", False), ("on", True))
    }
    res: dict[str, Any] = {name: {"pdl_resolved": e.pdl} for name, e in engines.items()}
    if not cuda:
        res["note"] = (
            "CPU: the engine's GPU-only switches (PDL, fused kernels, CUDA graphs) resolve off in both"
        )
    elif "pdl" in fields and not engines["on"].pdl:
        res["note"] = "PDL is not usable on this device (ops/pdl.py): both engines run without it"
    runs = {name: greedy_runs(e, prompts, args.check_tokens) for name, e in engines.items()}
    off, on = runs["off"], runs["on"]
    tokens_ok = off["alone"] == on["alone"] and off["batched"] == on["batched"]
    pairs = list(zip(off["logits"], on["logits"], strict=True))
    bitwise = all(torch.equal(a, b) for a, b in pairs)
    ulps = [ulp_distance(a, b) for a, b in pairs]
    max_ulp = -1 if any(u < 0 for u in ulps) else max(ulps, default=0)  # -1: shapes or dtypes differ
    max_abs = max((float((a.float() - b.float()).abs().max()) for a, b in pairs), default=0.0)
    early = rows_before_divergence(pairs)
    rel = max(
        (float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in early), default=0.0
    )
    res["check"] = {
        "prompts": list(lengths),
        "new_tokens": args.check_tokens,
        "greedy_tokens_identical": tokens_ok,
        "logits_rows_compared": sum(a.shape[0] for a, _ in pairs),
        "logits_dtype": str(pairs[0][0].dtype) if pairs else None,
        "logits_bitwise_identical": bitwise,
        "logits_max_ulp": max_ulp,
        "logits_max_abs_diff": max_abs,
        "rows_before_divergence": len(early),
        "max_diff_over_row_max_before_divergence": rel,
    }
    if not tokens_ok:
        res["check"]["tokens_off"] = off["alone"]
        res["check"]["tokens_on"] = on["alone"]
    del runs, off, on, pairs
    prompt = prompts[0]
    for _ in range(2):  # alternate, so clock or thermal drift hits both alike
        for name, e in engines.items():
            res[name].setdefault("_steps", []).append(step_times_ms(e, prompt, cuda))
    for name in engines:
        steps = res[name].pop("_steps")
        for key in steps[0]:
            vals = [s[key] for s in steps if s[key] is not None]
            res[name][key] = round(statistics.median(vals), 4) if vals else None
    if cuda and all(e.graphs is not None for e in engines.values()):
        bw = measure_bandwidth(device)
        report["bandwidth_bytes_s"] = bw
        report["weight_read_ms"] = weight_bytes / bw * 1e3
        graphs = {name: e.graphs.graphs[e.graphs.last_key] for name, e in engines.items()}
        replay: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(5):
            for name, g in graphs.items():
                replay[name].append(replay_us(g, 50) / 1e3)
        for name, e in engines.items():
            res[name]["graph_replay_ms"] = round(statistics.median(replay[name]), 4)
            res[name]["graph_replay_ms_all"] = [round(x, 4) for x in replay[name]]
            summary, rows = profile_replays(graphs[name], args.replays, len(e.model.model.layers))
            res[name].update(summary)
            res[name]["kernels"] = rows[:25]
            for key in ("graph_replay_ms", "engine_step_ms_median", "engine_step_ms_unsynced_mean"):
                if res[name].get(key) is not None:
                    res[name][f"{key}_over_weight_read"] = round(res[name][key] / report["weight_read_ms"], 3)
        res["graph_replay_on_over_off"] = round(
            res["on"]["graph_replay_ms"] / res["off"]["graph_replay_ms"], 4
        )
        from services.engine.kernels import gemv

        res["decode_gemm_choices"] = gemv.choices()  # made once (the first engine's warm-up), shared
    report["compare"] = {"fields": fields, **res}
    if fields == ["pdl"]:
        # Logits may differ by one ulp at most (e.g. a reduction that compiled differently); tokens
        # must not differ at all: a difference is a race (a kernel reading before its gdc_wait).
        return tokens_ok and 0 <= max_ulp <= 1
    return bool(early) and rel <= 1e-2


def pin_gemv(path: Path, dtype: torch.dtype) -> dict[str, str]:
    """Pin the decode-GEMM choices a previous run recorded ("NxK,M<=b" -> "(bn, bk, warps)" or
    "F.linear", as gemv.choices() writes them); returns what was pinned."""
    import ast

    from services.engine.kernels import gemv

    doc = json.loads(path.read_text())
    # A profile's file, a compare's, or an older --pdl-compare's.
    where = (doc, doc.get("compare", {}), doc.get("pdl_compare", {}))
    found = next((d["decode_gemm_choices"] for d in where if d.get("decode_gemm_choices")), {})
    for key, choice in found.items():
        shape, bucket = key.split(",M<=")
        n, k = (int(v) for v in shape.split("x"))
        cfg = choice.split(" + ")[0]  # some files also name the prologues a GEMV took
        gemv.pin(n, k, int(bucket), dtype, None if cfg == "F.linear" else tuple(ast.literal_eval(cfg)))
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument(
        "--compare",
        help="boolean EngineConfig fields (comma-separated, e.g. pdl) all off vs all on in one process (see above)",
    )
    ap.add_argument(
        "--pin-gemv",
        help="a results JSON whose decode_gemm_choices are pinned instead of timed at warm-up",
    )
    ap.add_argument("--check-tokens", type=int, default=32, help="greedy tokens per prompt (--compare)")
    args = ap.parse_args()
    from services.common.config import EngineConfig

    switches = {name for name, f in EngineConfig.model_fields.items() if f.annotation is bool}
    unknown = set((args.compare or "pdl").split(",")) - switches
    if unknown:
        ap.error(f"--compare: not boolean EngineConfig fields: {sorted(unknown)} (one of {sorted(switches)})")
    cuda, device, dtype, model_kw, report = profile_setup(
        args.smoke,
        "the time to read the weights once at the measured device copy bandwidth (same process)",
    )
    root = Path(tempfile.mkdtemp(prefix="prof1-"))
    hf = build_model_dir(model_kw, device, dtype, root)
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    del hf
    ok = True
    if args.pin_gemv and cuda:
        report["pinned_gemv"] = pin_gemv(Path(args.pin_gemv), dtype)
    if args.compare:
        ok = compare(args, cuda, device, root, report, weight_bytes, model_kw["vocab_size"])
        report["check"] = (
            "passed" if ok else f"FAILED: {args.compare} changed the numerics (see compare.check)"
        )
    else:
        profile_one(args, cuda, device, root, report, weight_bytes)
    write_result(args.out, report)
    skip = ("kernels", "machine")
    brief = {k: v for k, v in report.items() if k not in skip}
    if "compare" in brief:
        brief["compare"] = {
            k: ({kk: vv for kk, vv in v.items() if kk != "kernels"} if isinstance(v, dict) else v)
            for k, v in brief["compare"].items()
        }
    print(json.dumps(brief, indent=1)[:8000])
    if not ok:
        print(f"CHECK FAILED: {report['check']}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
