"""On one device: the engine generates with the debug model, the trainer's torchtitan model
re-scores the same tokens, and one RL step runs; reports the log-prob gap and the timings.

    python bench/gpu_debug/parity.py --device cuda --out $OUT/parity.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from bench.results import write_result
from services.common.config import EngineConfig, load_config
from services.common.schemas import GenerateRequest, SamplingParams
from services.engine import LLMEngine
from trainer.loss import ratio_loss, token_logprobs
from trainer.model import build_model, save_weights_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = torch.device(args.device)
    cfg = load_config("debug")
    model = build_model(cfg.model, seed=0, init_std=cfg.trainer.init_std)
    d = save_weights_dir(cfg.model, model.state_dict(), Path(tempfile.mkdtemp()) / "step_0", {"version": 0})
    engine = LLMEngine(
        d, EngineConfig(device=args.device, dtype="float32", max_batch_size=1024, max_seq_len=256)
    )
    g = torch.Generator().manual_seed(0)
    reqs = [
        GenerateRequest(
            input_ids=torch.randint(
                3, 60, (int(torch.randint(4, 64, (1,), generator=g)),), generator=g
            ).tolist(),
            sampling=SamplingParams(
                temperature=1.0, max_tokens=args.max_tokens, n=args.n, seed=i, ignore_eos=True
            ),
        )
        for i in range(args.prompts)
    ]
    engine.generate(reqs[:2])  # warm-up (kernels, allocator)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    resps = engine.generate(reqs)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    gen_s = time.perf_counter() - t0
    n_gen = sum(len(c.output_ids) for r in resps for c in r.choices)

    model = model.to(dev)
    worst = 0.0
    total = 0.0
    count = 0
    seqs, infer = [], []
    for req, resp in zip(reqs, resps, strict=True):
        for c in resp.choices:
            seqs.append(req.input_ids + c.output_ids)
            infer.append((len(req.input_ids), c.logprobs))
    t1 = time.perf_counter()
    with torch.no_grad():
        for toks, (plen, lp) in zip(seqs, infer, strict=True):
            logp, _ = token_logprobs(model, torch.tensor([toks], device=dev))
            diff = (logp[0, plen - 1 :].float().cpu() - torch.tensor(lp)).abs()
            worst = max(worst, float(diff.max()))
            total += float(diff.sum())
            count += diff.numel()
    score_s = time.perf_counter() - t1

    # One RL step over the whole batch (padded), as the trainer does.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    L = max(len(s) for s in seqs)
    tokens = torch.zeros((len(seqs), L), dtype=torch.long)
    mask = torch.zeros((len(seqs), L - 1))
    lpi = torch.zeros((len(seqs), L - 1))
    for i, (toks, (plen, lp)) in enumerate(zip(seqs, infer, strict=True)):
        tokens[i, : len(toks)] = torch.tensor(toks)
        mask[i, plen - 1 : len(toks) - 1] = 1
        lpi[i, plen - 1 : len(toks) - 1] = torch.tensor(lp)
    adv = torch.randn(len(seqs))
    tokens, mask, lpi, adv = (t.to(dev) for t in (tokens, mask, lpi, adv))
    for _ in range(2):  # first is warm-up
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        opt.zero_grad()
        logp, ent = token_logprobs(model, tokens)
        loss, st = ratio_loss(
            logp,
            lpi,
            adv,
            mask,
            ratio_low=0.5,
            ratio_high=2.0,
            total_loss_tokens=int(mask.sum()),
            entropy=ent,
        )
        loss.backward()
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        step_s = time.perf_counter() - t2
    out = {
        "command": " ".join(sys.argv),
        "machine": torch.cuda.get_device_name(dev)
        if dev.type == "cuda"
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": str(dev),
        "sequences": len(seqs),
        "generated_tokens": n_gen,
        "engine_generate_s": gen_s,
        "engine_tokens_per_s": n_gen / gen_s,
        "trainer_rescore_s": score_s,
        "logprob_abs_diff_max": worst,
        "logprob_abs_diff_mean": total / max(1, count),
        "rl_step_s": step_s,
        "rl_step_tokens": int(mask.sum()),
        "masked_ratio_frac": st.masked_tokens / max(1.0, st.loss_tokens),
    }
    print(json.dumps(out, indent=1))
    if args.out:
        write_result(args.out, out)


if __name__ == "__main__":
    main()
