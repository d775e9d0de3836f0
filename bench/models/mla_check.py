"""GPU correctness of the paged MLA decode kernels (services/engine/kernels/mla_decode.py), compiled,
before anything times them; one JSON out (a minute or two, mostly Triton compiles).

    python3 bench/models/mla_check.py --out $OUT/mla_check.json
    python3 bench/models/mla_check.py --time --out $OUT/mla_check.json  # then time_kernels
    (bench/models/run.py runs the same checks as its first phase, mla_check)

  kernels  at GLM-5's width (64 heads, kv_lora_rank 512 + rope 64, indexer 32 heads x 128,
           index_topk 2048), bf16 pool on shuffled 16-token pages, rows of 1..5000 keys: dense
           decode (one program per row, and the split work list + merge) and the sparse decode
           over the kernel-selected top-k against the float32 torch reference of the same
           positions; the indexer's paged scores against torch over the gathered keys.
  engine   the tiny Kimi (DeepSeek-V3 architecture) and GLM-5 (DSA top-16) weights in float32:
           greedy tokens and log-probs of the Triton MLA backend, eager and with CUDA graphs,
           against the torch backend in the same process.
Exits non-zero if a check fails (the CPU side is tests/test_mla_kernels.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.machine import machine  # noqa: E402
from bench.results import write_result  # noqa: E402

PAGE = 16
BF16_TOL = 2e-2  # bf16 pool and queries, float32 softmax: the reference is float32 on the same values


def _batch(
    ctx: list[int], heads: int, key_cap: int, sms: int, seed: int, dev: torch.device
) -> tuple[Any, Any, int]:
    from services.engine.batch import HostBatch, Span

    rng = np.random.default_rng(seed)
    n_pages = sum(-(-c // PAGE) for c in ctx) + 4
    free = list(rng.permutation(n_pages))
    spans = [Span([int(free.pop()) for _ in range(-(-c // PAGE))], c - 1, [1]) for c in ctx]
    hb = HostBatch.build(spans, PAGE)
    return hb, hb.to_forward_batch(dev, -(-heads // 16), sms, key_cap), n_pages * PAGE


def check_kernels(dev: torch.device, smoke: bool = False) -> dict[str, Any]:
    """smoke: tiny shapes (the debug configs' widths) for a CPU run under TRITON_INTERPRET=1."""
    from services.engine.batch import num_sms
    from services.engine.kernels.mla_decode import index_scores, mla_decode, reference_mla_decode, select_topk

    sms = num_sms(dev)
    heads, rank, rope, topk, hi, di = (4, 32, 8, 80, 4, 16) if smoke else (64, 512, 64, 2048, 32, 128)
    scale = (192 + rope) ** -0.5
    out: dict[str, Any] = {}
    cases = {
        "dense_split": ([1, 100, 2047, 2048, 2049, 5000, 17, 700], 0),
        "dense_one_program_per_row": ([(i * 37) % 2000 + 1 for i in range(80)], 0),
        "sparse_split": ([1, 100, 2047, 2048, 2049, 5000, 17, 4100], topk),
    }
    if smoke:
        cases = {"dense_split": ([1, 70, 133], 0), "sparse_split": ([5, 79, 300], topk)}
    ok = True
    for name, (ctx, cap) in cases.items():
        hb, fb, rows = _batch(ctx, heads, cap, sms, len(name), dev)
        dec = fb.paged.decode
        g = torch.Generator(device=dev).manual_seed(0)
        pool = torch.randn(rows, rank + rope, device=dev, generator=g).bfloat16()
        q = torch.randn(len(ctx), heads, rank + rope, device=dev, generator=g).bfloat16()
        tables = [hb.tables[i].tolist() for i in range(len(ctx))]
        keep = None
        idx = None
        row: dict[str, Any] = {
            "rows": len(ctx),
            "work_items": None if dec.work is None else len(dec.work.item_row),
        }
        if cap:
            keys = torch.randn(rows, di, device=dev, generator=g).bfloat16()
            iq = torch.randn(len(ctx), hi, di, device=dev, generator=g).bfloat16()
            iw = torch.randn(len(ctx), hi, device=dev, generator=g)
            scores = index_scores(iq, iw, keys, dec, di**-0.5, PAGE)
            err = 0.0
            for i, c in enumerate(ctx):
                kk = keys[[tables[i][p // PAGE] * PAGE + p % PAGE for p in range(c)]].float()
                want = (iw[i, :, None] * torch.relu(iq[i].float() @ kk.T * di**-0.5)).sum(0)
                err = max(err, float((scores[i, :c] - want).abs().max() / want.abs().max().clamp_min(1e-6)))
                ok = ok and bool(torch.isneginf(scores[i, c:]).all())
            row["index_scores_max_rel_err"] = err
            ok = ok and err < 1e-4
            idx = select_topk(scores, topk)
            keep = [idx[i, : min(c, topk)].tolist() for i, c in enumerate(ctx)]
            ok = ok and all(min(k) >= 0 and max(k) < c for k, c in zip(keep, ctx, strict=True))
        got = mla_decode(q, pool, dec, scale, PAGE, rank, idx).float().cpu()
        ref = reference_mla_decode(q, pool, list(range(len(ctx))), ctx, tables, scale, PAGE, rank, keep)
        err = float((got - ref).abs().max())
        row["max_abs_err"] = err
        row["ok"] = err < BF16_TOL and bool(torch.isfinite(got).all())
        ok = ok and row["ok"]
        out[name] = row
    out["ok"] = ok
    return out


def check_engine(tmp: Path, dev: torch.device) -> dict[str, Any]:
    """On CUDA the graphs must be captured; on CPU (a smoke run) there are none."""
    from services.common.config import EngineConfig, load_config
    from services.common.schemas import GenerateRequest, SamplingParams
    from services.engine import LLMEngine
    from trainer.model import build_model, save_weights_dir

    out: dict[str, Any] = {}
    ok = True
    prompts = [[3 + (j * 7 + n) % 50 for j in range(n)] for n in (5, 40, 1, 23, 90, 61)]
    reqs = [
        GenerateRequest(input_ids=p, sampling=SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        for p in prompts
    ]
    for model in ("debug-kimi", "debug-glm5"):
        m = load_config(model).model
        state = build_model(m, seed=0, init_std=0.02).state_dict()  # spread-out next-token distributions
        path = save_weights_dir(m, state, tmp / model / "step_0", {"version": 0})
        res: dict[str, Any] = {}
        outs = {}
        for name, backend, graphs in (
            ("torch", "torch", False),
            ("triton", "triton", False),
            ("graphs", "triton", True),
        ):
            cfg = EngineConfig(
                device=dev.type,
                max_batch_size=8,
                max_seq_len=160,
                attention_backend=backend,
                cuda_graphs=graphs,
            )
            eng = LLMEngine(path, cfg)
            res[f"{name}_graphs_captured"] = eng.graphs is not None
            outs[name] = eng.generate(reqs)
        for name in ("triton", "graphs"):
            same = sum(
                a.choices[0].output_ids == b.choices[0].output_ids
                for a, b in zip(outs["torch"], outs[name], strict=True)
            )
            diff = max(
                abs(x - y)
                for a, b in zip(outs["torch"], outs[name], strict=True)
                for x, y in zip(a.choices[0].logprobs, b.choices[0].logprobs, strict=False)
            )
            res[f"{name}_greedy_equal"] = f"{same}/{len(reqs)}"
            res[f"{name}_logprob_max_abs_diff"] = diff
            ok = ok and same == len(reqs) and diff < 1e-4
        ok = ok and (res["graphs_graphs_captured"] or dev.type != "cuda")
        out[model] = res
    out["ok"] = ok
    return out


def time_kernels(dev: torch.device, smoke: bool = False) -> dict[str, Any]:
    """One GLM-5-width layer's decode attention (64 heads, latent 512 + rope 64) at W1-like
    batches under a grid of launch settings: dense over every key, and sparse over the indexer's
    top 2048 (the indexer's scoring and top-k timed apart). Effective bandwidth = the latent bytes
    the kernel must read / its median time, next to the device copy bandwidth measured here; the
    torch path's gather + SDPA on the same dense batch is the baseline. Not a check: numbers to
    tune MLA_DECODE_TUNING with."""
    from bench.engine.w1 import measure_bandwidth

    grid = [{"block_n": 32, "num_warps": 4, "num_stages": 2}]
    if not smoke:
        grid += [
            {"block_n": n, "num_warps": w, "num_stages": st}
            for n in (16, 32, 64)
            for w in (4, 8)
            for st in (1, 2, 3)
            if (n, w, st) != (32, 4, 2)
        ]
    out: dict[str, Any] = {"copy_bandwidth_bytes_s": measure_bandwidth(dev), "settings": grid}
    rng = np.random.default_rng(0)
    batches = {"b16_ctx4096": [4096] * 16, "b256_w1": [int(c) for c in rng.integers(612, 1536, 256)]}
    if smoke:
        batches = {"b4": [40, 90, 7, 130]}
    for name, ctx in batches.items():
        for sparse in (False, True):
            out[f"{name}_{'sparse' if sparse else 'dense'}"] = _time_case(ctx, sparse, grid, dev, smoke)
    return out


def _time_case(
    ctx: list[int], sparse: bool, grid: list[dict[str, int]], dev: torch.device, smoke: bool
) -> dict[str, Any]:
    from bench.engine.w1 import _time_ms
    from services.engine.batch import num_sms
    from services.engine.kernels.mla_decode import index_scores, mla_decode, select_topk

    heads, rank, rope, topk, hi, di = (4, 32, 8, 80, 4, 16) if smoke else (64, 512, 64, 2048, 32, 128)
    reps = 3 if smoke else 20
    hb, fb, rows = _batch(ctx, heads, topk if sparse else 0, num_sms(dev), 0, dev)
    dec = fb.paged.decode
    g = torch.Generator(device=dev).manual_seed(0)
    dtype = torch.float32 if smoke else torch.bfloat16
    pool = torch.randn(rows, rank + rope, device=dev, generator=g).to(dtype)
    q = torch.randn(len(ctx), heads, rank + rope, device=dev, generator=g).to(dtype)
    row: dict[str, Any] = {
        "rows": len(ctx),
        "work_items": None if dec.work is None else len(dec.work.item_row),
    }
    idx = None
    keys_read = sum(ctx)
    if sparse:
        ik = torch.randn(rows, di, device=dev, generator=g).to(dtype)
        iq = torch.randn(len(ctx), hi, di, device=dev, generator=g).to(dtype)
        iw = torch.randn(len(ctx), hi, device=dev, generator=g)
        row["index_scores_ms"] = _time_ms(lambda: index_scores(iq, iw, ik, dec, di**-0.5, PAGE), reps)
        scores = index_scores(iq, iw, ik, dec, di**-0.5, PAGE)
        row["select_topk_ms"] = _time_ms(lambda: select_topk(scores, topk), reps)
        idx = select_topk(scores, topk)
        keys_read = sum(min(c, topk) for c in ctx)
    nbytes = keys_read * (rank + rope) * pool.element_size()
    row["latent_bytes"] = nbytes
    times = []
    for t in grid:
        ms = _time_ms(lambda t=t: mla_decode(q, pool, dec, 0.07, PAGE, rank, idx, tuning=t), reps)
        times.append({**t, "ms": round(ms, 4), "bytes_s": nbytes / (ms / 1e3)})
    row["best"] = min(times, key=lambda r: r["ms"])
    row["by_setting"] = times
    if not sparse:
        from services.engine.batch import ForwardBatch, Span

        spans = [Span(hb.tables[i, : -(-c // PAGE)].tolist(), c - 1, [1]) for i, c in enumerate(ctx)]

        def torch_path() -> None:
            grp = ForwardBatch.build(spans, dev, max(ctx) + 1, PAGE).groups[0]
            b, n = grp.block_tables.shape
            at = (grp.block_tables[:, :, None] * PAGE + torch.arange(PAGE, device=dev)).view(b, n * PAGE)
            lat = pool[at][:, None]  # [B, 1, ctx, rank + rope]: one latent head
            qq = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, b - len(ctx)))[:, :, None]
            torch.nn.functional.scaled_dot_product_attention(
                qq, lat, lat[..., :rank], attn_mask=grp.mask, scale=0.07, enable_gqa=True
            )

        row["torch_gather_sdpa_ms"] = _time_ms(torch_path, max(3, reps // 4))
    return row


def run_checks(tmp: Path, dev: torch.device, smoke: bool = False) -> dict[str, Any]:
    """Both checks (each recorded even if the other fails); `ok` only if both pass."""
    result: dict[str, Any] = {}
    for name, fn in (
        ("kernels", lambda: check_kernels(dev, smoke)),
        ("engine", lambda: check_engine(tmp, dev)),
    ):
        try:
            result[name] = fn()
        except Exception:  # noqa: BLE001 - recorded; the other check still runs
            result[name] = {"ok": False, "error": traceback.format_exc()[-3000:]}
    result["ok"] = all(result[k].get("ok") for k in ("kernels", "engine"))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (set TRITON_INTERPRET=1)")
    ap.add_argument("--time", action="store_true", help="after the checks, time the kernels (time_kernels)")
    args = ap.parse_args()
    if not (args.smoke or torch.cuda.is_available()):
        sys.exit("needs CUDA (or --smoke under TRITON_INTERPRET=1)")
    dev = torch.device("cpu" if args.smoke else "cuda")
    result: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "baseline": "float32 torch reference (kernels) and the torch MLA backend (engine), same process",
    }
    with tempfile.TemporaryDirectory(prefix="mla-check-") as tmp:
        result.update(run_checks(Path(tmp), dev, args.smoke))
    write_result(args.out, result)
    if args.time:
        try:
            result["timing"] = time_kernels(dev, args.smoke)
        except Exception:  # noqa: BLE001 - recorded; the checks stand
            result["timing"] = {"error": traceback.format_exc()[-3000:]}
        write_result(args.out, result)
    print({k: v for k, v in result.items() if k != "timing"})
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
