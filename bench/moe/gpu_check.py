"""MoE / MLA engine check on one GPU: grouped expert GEMMs, bf16 engine vs HF, routed-expert capture.

    # on the H200 (device tool), with the small wheels in .whl carried along, ~2-4 minutes:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PWD python3 bench/moe/gpu_check.py --out $OUT/moe_gpu.json
    # CPU smoke test of the script itself (tiny sizes, float32):
    .venv/bin/python bench/moe/gpu_check.py --device cpu --smoke --out /tmp/moe_gpu.json

Phases (each in its own try/except; the JSON is rewritten after every phase):
  1. experts: `torch._grouped_mm` (bf16) against the per-expert loop and the per-pair gathered
     bmm (bf16) and a float32 reference, on DeepSeek-ish expert shapes, at decode-sized and
     prefill-sized token counts; the time of each (gather only up to 256 tokens: it copies one
     expert's weights per pair).
  2. qwen3_moe / deepseek_v3 / glm_moe_dsa (GLM-5, DSA engaged past 64 keys) engines on the device (bf16 and float32; for qwen3_moe also the
     Triton attention backend with CUDA-graph decode): sampled generation with
     return_routed_experts, then HF transformers (float32, same weights, teacher-forced on the
     same tokens) scores it: |engine log-prob - HF log-prob| of the sampled tokens, and the share of
     (token, MoE layer) rows whose engine expert set equals HF's router top-k.
Expected: float32 engines agree with HF to ~1e-5 and on every expert set; bf16 ones to bf16
rounding, with a few percent of expert sets differing on near-ties (the router itself runs in
float32, but its input is the bf16 residual stream).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.results import write_result
from services.common import routing  # noqa: E402
from services.common.config import EngineConfig, ModelConfig  # noqa: E402
from services.common.schemas import GenerateRequest, SamplingParams  # noqa: E402
from services.engine import LLMEngine  # noqa: E402
from services.engine.layers.moe import ExpertWeights  # noqa: E402


def timed(fn: Any, device: torch.device, iters: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / iters * 1e3


@torch.inference_mode()
def phase_experts(device: torch.device, smoke: bool) -> dict[str, Any]:
    e, d, i, k = (8, 64, 32, 2) if smoke else (128, 2048, 768, 8)
    m = ModelConfig(arch="qwen3_moe", dim=d, n_routed_experts=e, n_experts_per_tok=k, moe_hidden_dim=i)
    g = torch.Generator().manual_seed(0)
    ref = ExpertWeights(m)
    ref.gate_up_proj.copy_(torch.randn(ref.gate_up_proj.shape, generator=g) * d**-0.5)
    ref.down_proj.copy_(torch.randn(ref.down_proj.shape, generator=g) * i**-0.5)
    ref = ref.to(device)
    low = ExpertWeights(m).to(device, torch.bfloat16)
    low.load_state_dict(ref.state_dict())
    out: dict[str, Any] = {"experts": e, "dim": d, "inter": i, "top_k": k, "tokens": {}}
    for t in (1, 64) if smoke else (1, 64, 256, 4096):
        x = torch.randn(t, d, generator=g).to(device)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(device)
        w = torch.rand(t, k, generator=g).to(device)
        want = ref(x, ids, w, kernel="loop")
        scale = want.abs().max().item()
        xb = x.bfloat16()
        iters = 3 if smoke else 20
        row: dict[str, float] = {}
        for kernel in ("grouped", "loop", "gather") if t <= 256 else ("grouped", "loop"):
            got = low(xb, ids, w, kernel=kernel)
            row[f"{kernel}_vs_fp32_max_rel"] = (got.float() - want).abs().max().item() / scale
            row[f"{kernel}_ms"] = timed(
                lambda xb=xb, ids=ids, w=w, kernel=kernel: low(xb, ids, w, kernel=kernel), device, iters
            )
        out["tokens"][t] = row
    return out


def hf_model(kind: str, smoke: bool) -> Any:
    import transformers
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = {
        "vocab_size": 512,
        "hidden_size": 64 if smoke else 512,
        "intermediate_size": 128 if smoke else 1024,
        "moe_intermediate_size": 32 if smoke else 256,
        "num_hidden_layers": 2 if smoke else 4,
        "num_attention_heads": 4 if smoke else 8,
        "max_position_embeddings": 1024,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
    }
    if kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(
            **common,
            num_key_value_heads=2 if smoke else 4,
            head_dim=16 if smoke else 64,
            num_experts=8 if smoke else 64,
            num_experts_per_tok=2 if smoke else 8,
            norm_topk_prob=True,
            mlp_only_layers=[0],
        )
        model = Qwen3MoeForCausalLM(cfg)
    else:
        mla = kind == "deepseek_v3"
        dsa = {} if mla else {"index_topk": 16 if smoke else 64, "index_n_heads": 8, "index_head_dim": 32}
        cls = "DeepseekV3" if mla else "GlmMoeDsa"
        cfg = getattr(transformers, f"{cls}Config")(
            **common,
            **dsa,
            n_routed_experts=8 if smoke else 64,
            num_experts_per_tok=2 if smoke else 6,
            n_group=2 if smoke else 8,
            topk_group=1 if smoke else 3,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            q_lora_rank=48 if smoke else 256,
            kv_lora_rank=32 if smoke else 128,
            qk_nope_head_dim=16 if smoke else 64,
            qk_rope_head_dim=8 if smoke else 32,
            v_head_dim=16 if smoke else 64,
        )
        model = getattr(transformers, f"{cls}ForCausalLM")(cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return model.eval()


@torch.no_grad()
def hf_score(hf: Any, tokens: list[int], device: torch.device) -> tuple[np.ndarray, torch.Tensor]:
    """HF's router ids [T, moe_layers, k] and log-softmax rows [T, vocab] on `tokens`."""
    got: list[torch.Tensor] = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, o: got.append(o[2]))
        for layer in hf.model.layers
        if hasattr(layer.mlp, "gate")
    ]
    try:
        logits = hf(torch.tensor([tokens], device=device)).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(got, dim=1).cpu().numpy(), torch.log_softmax(logits, dim=-1)


def phase_engine(
    kind: str, device: torch.device, smoke: bool, variants: list[dict[str, Any]]
) -> dict[str, Any]:
    hf = hf_model(kind, smoke)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        hf = hf.to(device)
        rng = random.Random(0)
        n_prompts = 4 if smoke else 32
        prompts = [
            [rng.randrange(2, 512) for _ in range(rng.randint(10, 40 if smoke else 300))]
            for _ in range(n_prompts)
        ]
        for v in variants:
            name = "-".join(f"{k}={val}" for k, val in v.items())
            try:
                eng = LLMEngine(
                    tmp, EngineConfig(device=device.type, max_batch_size=64, max_seq_len=1024, **v)
                )
                params = SamplingParams(
                    temperature=1.0, max_tokens=16 if smoke else 64, ignore_eos=True, seed=3
                )
                reqs = [
                    GenerateRequest(input_ids=p, sampling=params, return_routed_experts=True) for p in prompts
                ]
                t0 = time.perf_counter()
                resps = eng.generate(reqs)
                gen_s = time.perf_counter() - t0
                same = rows = 0
                diffs: list[float] = []
                for p, r in zip(prompts, resps, strict=True):
                    c = r.choices[0]
                    assert c.routed_experts is not None
                    ids = routing.decode(c.routed_experts)
                    full = p + c.output_ids
                    want_ids, lp = hf_score(hf, full[:-1], device)
                    match = (np.sort(ids[:-1], -1) == np.sort(want_ids, -1)).all(-1)
                    same += int(match.sum())
                    rows += match.size
                    want_lp = lp[len(p) - 1 :].gather(1, torch.tensor(c.output_ids, device=device)[:, None])[
                        :, 0
                    ]
                    diffs.extend((torch.tensor(c.logprobs, device=device) - want_lp).abs().tolist())
                out[name] = {
                    "attention_backend": eng.attention_backend,
                    "cuda_graphs": eng.graphs is not None,
                    "generate_s": round(gen_s, 3),
                    "routing_rows": rows,
                    "routing_match_frac": same / rows,
                    "logprob_absdiff_max": max(diffs),
                    "logprob_absdiff_mean": sum(diffs) / len(diffs),
                }
                del eng
            except Exception:  # noqa: BLE001 - report and go on with the next variant
                out[name] = {"error": traceback.format_exc()}
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    device = torch.device(args.device)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    result: dict[str, Any] = {
        "command": "python3 " + " ".join(sys.argv),
        "machine": machine,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "baseline": "HF transformers float32 on the same weights (log-probs, router top-k); float32 experts",
        "torch": torch.__version__,
        "device": str(device),
    }
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        write_result(path, result, default=str)

    cuda = device.type == "cuda"
    fp32: dict[str, Any] = {"dtype": "float32"}
    bf16: dict[str, Any] = {"dtype": "bfloat16"} if cuda else {"dtype": "float32", "block_size": 8}
    # MLA: the torch path, and on CUDA the Triton MLA decode kernels (kernels/mla_decode.py) with
    # CUDA-graph decode, each against HF.
    mla = [fp32 | {"attention_backend": "torch"}, bf16 | {"attention_backend": "torch"}]
    if cuda:
        mla += [
            fp32 | {"attention_backend": "triton", "cuda_graphs": True},
            bf16 | {"attention_backend": "triton", "cuda_graphs": True},
        ]
    phases: list[tuple[str, Any]] = [
        ("experts", lambda: phase_experts(device, args.smoke)),
        (
            "qwen3_moe",
            lambda: phase_engine(
                "qwen3_moe",
                device,
                args.smoke,
                [fp32 | {"attention_backend": "torch"}, bf16 | {"attention_backend": "torch"}]
                # CUDA-graph decode: bf16 runs _grouped_mm inside the graph, float32 the gather kernel
                + (
                    [
                        bf16 | {"attention_backend": "triton", "cuda_graphs": True},
                        fp32 | {"attention_backend": "triton", "cuda_graphs": True},
                    ]
                    if cuda
                    else []
                ),
            ),
        ),
        ("deepseek_v3", lambda: phase_engine("deepseek_v3", device, args.smoke, mla)),
        ("glm_moe_dsa", lambda: phase_engine("glm_moe_dsa", device, args.smoke, mla)),
    ]
    for name, fn in phases:
        t0 = time.perf_counter()
        try:
            result[name] = fn()
        except Exception:  # noqa: BLE001 - one failed phase must not lose the others
            result[name] = {"error": traceback.format_exc()}
        result[f"{name}_s"] = round(time.perf_counter() - t0, 1)
        write()
        print(name, json.dumps(result[name], default=str)[:2000], flush=True)


if __name__ == "__main__":
    main()
