"""One-shot GPU check of the engine's fused paths (about a minute on an H200), one JSON out.

    python3 bench/engine/gpu_fused_check.py --out $OUT/fused_check.json

Compiled (not interpreted) Triton: the fused sampler (kernels/sampling.py) against log_softmax
and torch.argmax, its frequencies on a small distribution; add + RMSNorm and SiLU-mul
(ops/fused_norm.py) against torch; and a whole engine (debug-shaped Qwen3 model, bf16, CUDA
graphs) with everything fused (the CUDA default) against the same engine with the fused layer
paths off and the torch sampler: greedy tokens and log-probs. Exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from bench.results import write_result  # noqa: E402


def check_sampler() -> dict[str, Any]:
    from services.engine.kernels.sampling import fused_sample

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(64, 151936, device="cuda", generator=g) * 3).to(torch.bfloat16)
    temps = torch.tensor([0.0, 1.0, 0.7, 1.3] * 16, device="cuda")
    seeds = torch.arange(64, device="cuda", dtype=torch.int64) * 7919
    tokens, lps = fused_sample(logits, temps, seeds)
    scaled = logits.float() / torch.where(temps == 0, 1.0, temps)[:, None]
    ref = torch.log_softmax(scaled, -1).gather(1, tokens[:, None])[:, 0]
    greedy = temps == 0
    again, _ = fused_sample(logits, temps, seeds)
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0], device="cuda")
    n = 20000
    t2, _ = fused_sample(
        probs.log().expand(n, 4).contiguous(), torch.ones(n, device="cuda"), torch.arange(n, device="cuda")
    )
    freq = torch.bincount(t2, minlength=4).float() / n
    out = {
        "logprob_max_abs_diff": float((ref - lps).abs().max()),
        "greedy_equal_argmax": bool((tokens[greedy] == scaled[greedy].argmax(-1)).all()),
        "reproducible": bool(torch.equal(tokens, again)),
        "frequencies": [round(float(f), 4) for f in freq],
    }
    out["ok"] = (
        out["logprob_max_abs_diff"] < 1e-3
        and out["greedy_equal_argmax"]
        and out["reproducible"]
        and float((freq - probs).abs().max()) < 0.015
    )
    return out


def check_norms() -> dict[str, Any]:
    from ops.fused_norm import add_rms_norm, silu_mul

    g = torch.Generator(device="cuda").manual_seed(1)
    x, d = (torch.randn(300, 1024, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    w = (torch.rand(1024, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
    h, y = add_rms_norm(x, d, w, 1e-6)
    ref_y = torch.nn.functional.rms_norm((x + d).float(), (1024,), w.float(), 1e-6)
    gu = torch.randn(300, 6144, device="cuda", generator=g).to(torch.bfloat16)
    gate, up = gu.chunk(2, dim=-1)
    ref_s = torch.nn.functional.silu(gate.float()) * up.float()
    out = {
        "residual_exact": bool(torch.equal(h, x + d)),
        "norm_max_abs_diff": float((y.float() - ref_y).abs().max()),
        "silu_mul_max_abs_diff": float((silu_mul(gate, up).float() - ref_s).abs().max()),
    }
    out["ok"] = (
        out["residual_exact"] and out["norm_max_abs_diff"] < 0.05 and out["silu_mul_max_abs_diff"] < 0.05
    )
    return out


def check_engine(tmp: Path) -> dict[str, Any]:
    from services.common.config import EngineConfig, load_config
    from services.common.modeldir import hf_config
    from services.common.schemas import GenerateRequest, SamplingParams
    from services.common.weights_dir import write_model_dir
    from services.engine import LLMEngine
    from services.engine.layers.sampler import Sampler
    from services.engine.models.causal_lm import CausalLM

    m = load_config("debug").model.model_copy(update={"max_seq_len": 512})
    torch.manual_seed(0)
    state = {k: v for k, v in CausalLM(m, m.max_seq_len).state_dict().items() if "rope" not in k}
    path = write_model_dir(tmp / "step_0", state, hf_config(m, eos_token_id=0), None, {"version": 0})
    cfg = EngineConfig(
        device="cuda", dtype="bfloat16", max_batch_size=64, max_seq_len=512, fused_kernels=True
    )
    rng = random.Random(0)
    reqs = [
        GenerateRequest(
            input_ids=[rng.randrange(1, 60) for _ in range(rng.randrange(5, 200))],
            sampling=SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
        )
        for _ in range(40)
    ]
    fused = LLMEngine(path, cfg)
    fused_out = fused.generate(reqs)
    plain = LLMEngine(path, cfg)
    # The unfused reference: torch elementwise ops, separate projection GEMMs (the parameters stay
    # views of the fused weights, which separate GEMMs read just as well), eager steps (the graphs
    # were captured fused), the torch sampler.
    plain.model.fused_elementwise = False
    for layer in plain.model.model.layers:
        layer.self_attn.qkv = None  # type: ignore[union-attr]
        layer.mlp.gate_up = None  # type: ignore[union-attr]
    plain.graphs = None
    plain.sampler = Sampler()
    plain_out = plain.generate(reqs)
    same = sum(
        a.choices[0].output_ids == b.choices[0].output_ids for a, b in zip(fused_out, plain_out, strict=True)
    )
    diffs = [
        abs(x - y)
        for a, b in zip(fused_out, plain_out, strict=True)
        for x, y in zip(a.choices[0].logprobs, b.choices[0].logprobs, strict=False)
    ]
    seeded = [
        GenerateRequest(input_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=16, seed=3, ignore_eos=True))
    ]
    repro = fused.generate(seeded)[0].choices[0].output_ids == fused.generate(seeded)[0].choices[0].output_ids
    out = {
        "graphs_captured": fused.graphs is not None,
        "fused_modules": sum(
            1
            for layer in fused.model.model.layers
            if layer.self_attn.qkv is not None  # type: ignore[union-attr]
        ),
        "greedy_sequences_equal": f"{same}/{len(reqs)}",
        "logprob_max_abs_diff": max(diffs) if diffs else math.nan,
        "seeded_reproducible": repro,
    }
    # bf16: a near-tie can flip a greedy token and the sequences part ways; most must agree.
    out["ok"] = out["graphs_captured"] and same >= 0.9 * len(reqs) and repro
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA (the CPU side is tests/test_engine_fused_kernels.py)")
    from bench.engine.w1 import profile_setup

    # The header every results file carries: command, date, machine, and what is compared.
    _, _, _, _, result = profile_setup(
        False,
        "references computed in the same process: torch log_softmax/argmax for the sampler, the "
        "torch ops for the norms, the same engine with fused paths off and the torch sampler",
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in (
            ("sampler", check_sampler),
            ("norms", check_norms),
            ("engine", lambda: check_engine(Path(tmp))),
        ):
            try:
                result[name] = fn()
            except Exception:  # noqa: BLE001 - record and go on to the next check
                result[name] = {"ok": False, "error": traceback.format_exc()[-3000:]}
            write_result(args.out, result)
            print(f"[fused_check] {name}: {json.dumps(result[name])[:400]}", flush=True)
    checks = [result[k] for k in ("sampler", "norms", "engine")]
    sys.exit(0 if all(v.get("ok") for v in checks) else 1)


if __name__ == "__main__":
    main()
