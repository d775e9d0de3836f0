"""Where do the bf16 engine and the bf16 trainer round differently? (issue 7, Router Replay's KL floor)

With Router Replay the trainer routes every token to the experts the engine chose, so what is left
of the engine/trainer mismatch is bf16 numerics: each place where the two sides round at a
different point of the same function. This harness makes those places visible on a CPU:

  1. builds one random model (a small Qwen3-MoE, or a dense Qwen3) in the trainer (float32,
     transformers' init: every linear and the embedding N(0, 0.02), norms 1 — see
     bench/r3/README.md "Initialisations"), writes it as an HF directory (float32), and loads it in
     the engine (`LLMEngine`, bf16 on CPU: the torch path);
  2. runs the engine once over the same random token rows (one prefill span per row), recording
     every MoE layer's expert ids;
  3. runs the trainer over the same rows with those ids replayed (`trainer.replay.routing`):
     - `autocast`: float32 weights under torch.autocast(bf16) (the single-process trainer);
     - `bf16_params`: bf16 parameters, float32 buffers (what FSDP2's MixedPrecisionPolicy(bf16)
       computes with: it casts parameters only; rope_cache and expert_bias stay float32);
     - `float32`: the reference, same ids;
  4. reports, per layer and per tap (attention output, MoE/MLP output, router weights at the
     replayed ids, the residual stream after the layer), the max / mean |difference| of each bf16
     side against the float32 reference and of the engine against each trainer path, and at the
     end the log-prob difference of the next tokens and the full-vocabulary
     KL(p_engine || p_trainer).

CPU bf16 matmuls accumulate in float32 like the GPU's, so formulation differences (where a value
is rounded to bf16) show up here; kernel differences (Triton attention, grouped GEMMs, cuBLAS
split-K) do not. CPU autocast's op lists differ from CUDA's (CUDA runs rms_norm and softmax in
float32 under autocast, CPU does not); the trainer now computes q/k-norm, RoPE and the router's
softmax in float32 explicitly, and a layer norm's bf16 output is the same rounding of the same
float32 value either way, so both trainer paths compute the same function on both devices.
The engine's CPU path computes q/k-norm + RoPE as its GPU kernel does (float32, one rounding).

Run (CPU, ~10 s):
    .venv/bin/python bench/r3/numerics.py [--dense] [--perturb-norms] [--layers 4] [--rows 4] [--seq 64]
        [--out x.json]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from services.common.config import EngineConfig, ModelConfig  # noqa: E402
from services.engine import LLMEngine  # noqa: E402
from services.engine.batch import ForwardBatch, Span  # noqa: E402
from services.engine.moe import MoE as EngineMoE  # noqa: E402
from trainer.model import build_model, save_weights_dir  # noqa: E402
from trainer.replay import moe_routers, routing  # noqa: E402

TRAINER_PATHS = ("autocast", "bf16_params")
TAPS = ("attn", "mlp", "router_w", "resid")


def moe_config(layers: int = 4) -> ModelConfig:
    """Qwen3-30B-A3B's structure at CPU size: QK-norm, GQA, every layer MoE, softmax top-8 of 64
    renormalised, untied embeddings, RoPE theta 1e6."""
    return ModelConfig(
        arch="qwen3_moe",
        vocab_size=2048,
        dim=256,
        n_layers=layers,
        n_heads=8,
        n_kv_heads=2,
        head_dim=32,
        hidden_dim=512,
        max_seq_len=256,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        qk_norm=True,
        tie_embeddings=False,
        n_routed_experts=64,
        n_experts_per_tok=8,
        moe_hidden_dim=64,
        router_score="softmax",
        norm_topk_prob=True,
    )


def dense_config(layers: int = 4) -> ModelConfig:
    """The dense Qwen3 of the same size (SwiGLU of width 512)."""
    moe = {"n_routed_experts", "n_experts_per_tok", "moe_hidden_dim", "router_score", "norm_topk_prob"}
    return ModelConfig(**(moe_config(layers).model_dump(exclude=moe) | {"arch": "qwen3"}))


@torch.no_grad()
def hf_init(model: torch.nn.Module, seed: int, perturb_norms: bool = False) -> None:
    """transformers' Qwen3(-MoE) init: linears, experts, router and embedding N(0, 0.02), norms 1.
    perturb_norms: norm weights 1 + N(0, 0.2), float32 values that are not bf16 values, as after
    training (norms at exactly 1 hide how each side rounds the weight multiply)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
            if perturb_norms:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.2)
        else:
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.02)


@dataclass
class Run:
    """One forward's taps: per layer, [N, D] float32 (router_w: [N, k]); logp: [N, V]."""

    taps: dict[str, list[torch.Tensor]] = field(default_factory=lambda: {t: [] for t in TAPS})
    logp: torch.Tensor | None = None
    ids: list[torch.Tensor] = field(default_factory=list)  # engine only: [N, k] per MoE layer


def _flat(x: Any) -> torch.Tensor:
    t = x[0] if isinstance(x, tuple) else x
    return t.detach().float().reshape(-1, t.shape[-1])


def run_engine(eng: LLMEngine, rows: torch.Tensor) -> Run:
    """One prefill span per row; taps through forward hooks on the engine's modules."""
    out = Run()
    hooks = []
    for layer in eng.model.model.layers:
        hooks.append(layer.self_attn.register_forward_hook(lambda m, i, o: out.taps["attn"].append(_flat(o))))
        if isinstance(layer.mlp, EngineMoE):
            hooks.append(layer.mlp.register_forward_hook(lambda m, i, o: out.taps["mlp"].append(_flat(o[0]))))
            hooks.append(layer.mlp.register_forward_hook(lambda m, i, o: out.ids.append(o[1].clone())))
            # The weights as the experts are weighted by them: in the model dtype's values (combine).
            hooks.append(
                layer.mlp.gate.register_forward_hook(
                    lambda m, i, o: out.taps["router_w"].append(_flat(o[0].to(eng.dtype)))
                )
            )
        else:
            hooks.append(layer.mlp.register_forward_hook(lambda m, i, o: out.taps["mlp"].append(_flat(o))))
        hooks.append(layer.register_forward_hook(lambda m, i, o: out.taps["resid"].append(_flat(o))))
    try:
        n = eng.kv.blocks_for(eng.kv.max_seq_len)
        spans = [Span(list(range(s * n, (s + 1) * n)), 0, rows[s].tolist()) for s in range(rows.shape[0])]
        with torch.inference_mode():
            batch = ForwardBatch.build(spans, eng.device, eng.kv.max_seq_len, eng.kv.block_size)
            logits = eng.model.logits(eng.model(batch, eng.kv))
            out.logp = torch.log_softmax(logits.float(), dim=-1)
    finally:
        for h in hooks:
            h.remove()
    return out


def bf16_params(model: torch.nn.Module) -> torch.nn.Module:
    """A copy computing as FSDP2 with MixedPrecisionPolicy(param_dtype=bf16) does: parameters in
    bf16, buffers (rope_cache, expert_bias) as they are."""
    clone = copy.deepcopy(model)
    for p in clone.parameters():
        p.data = p.data.to(torch.bfloat16)
    return clone


def run_trainer(model: torch.nn.Module, rows: torch.Tensor, routes: torch.Tensor | None, amp: Any) -> Run:
    """The trainer's forward over `rows` [B, T] with `routes` [B, T, layers, k] replayed."""
    out = Run()
    hooks = []
    for block in model.layers.values():  # type: ignore[union-attr]
        hooks.append(block.attention.register_forward_hook(lambda m, i, o: out.taps["attn"].append(_flat(o))))
        ffn = block.moe if getattr(block, "moe_enabled", False) else block.feed_forward
        hooks.append(ffn.register_forward_hook(lambda m, i, o: out.taps["mlp"].append(_flat(o))))
        hooks.append(block.register_forward_hook(lambda m, i, o: out.taps["resid"].append(_flat(o))))
    for r in moe_routers(model):
        hooks.append(r.register_forward_hook(lambda m, i, o: out.taps["router_w"].append(_flat(o[0]))))
    try:
        ctx = routing(model, routes, replay=True) if routes is not None else contextlib.nullcontext()
        with torch.no_grad(), ctx, amp:
            logits = model(rows)
        out.logp = torch.log_softmax(logits.float(), dim=-1).reshape(-1, logits.shape[-1])
    finally:
        for h in hooks:
            h.remove()
    return out


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    d = (a - b).abs()
    return {"max": float(d.max()), "mean": float(d.mean())}


def compare(a: Run, b: Run, rows: torch.Tensor) -> dict[str, Any]:
    """Per layer and tap |a - b|; next-token log-prob difference and KL(p_a || p_b) per token."""
    layers = []
    for i in range(len(a.taps["resid"])):
        layers.append({t: _diff(a.taps[t][i], b.taps[t][i]) for t in TAPS if i < len(a.taps[t])})
    assert a.logp is not None and b.logp is not None
    # rows: position t predicts token t + 1; the last position of each row has no target.
    bsz, t = rows.shape
    la, lb = a.logp.view(bsz, t, -1)[:, :-1], b.logp.view(bsz, t, -1)[:, :-1]
    tgt = rows[:, 1:, None]
    dlogp = (la.gather(-1, tgt) - lb.gather(-1, tgt)).squeeze(-1)
    kl = (la.exp() * (la - lb)).sum(-1)
    return {
        "layers": layers,
        "logp_abs_max": float(dlogp.abs().max()),
        "logp_abs_mean": float(dlogp.abs().mean()),
        # k3 over the next tokens, as trainer.mismatch reports it (r = p_train / p_infer)
        "kl_k3_next": float((torch.exp(-dlogp) - 1 + dlogp).mean()),
        "kl_full_mean": float(kl.mean()),
    }


def measure(
    m: ModelConfig,
    *,
    rows: int = 4,
    seq: int = 64,
    seed: int = 0,
    perturb_norms: bool = False,
    workdir: Path | None = None,
) -> dict[str, Any]:
    """Everything above for one model; returns a JSON-able dict (see the module docstring)."""
    torch.manual_seed(seed)
    model = build_model(m, seed=seed).eval()
    hf_init(model, seed, perturb_norms)
    tokens = torch.randint(0, m.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(seed + 1))
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        d = save_weights_dir(m, model.state_dict(), workdir / "w", {"version": 0})
        ecfg = dict(device="cpu", max_batch_size=rows, max_seq_len=max(seq, 16), block_size=16)
        eng = LLMEngine(d, EngineConfig(dtype="bfloat16", **ecfg))
        eng32 = LLMEngine(d, EngineConfig(dtype="float32", **ecfg))
        e16 = run_engine(eng, tokens)
        e32 = run_engine(eng32, tokens)

    def routes_of(run: Run) -> torch.Tensor | None:  # [N, k] per MoE layer -> [B, T, layers, k]
        return torch.stack(run.ids, dim=1).view(rows, seq, len(run.ids), -1) if run.ids else None

    routes = routes_of(e16)
    ref = run_trainer(model, tokens, routes, contextlib.nullcontext())
    ref_own = run_trainer(model, tokens, routes_of(e32), contextlib.nullcontext())
    trainer = {
        "autocast": run_trainer(model, tokens, routes, torch.autocast("cpu", dtype=torch.bfloat16)),
        "bf16_params": run_trainer(bf16_params(model), tokens, routes, contextlib.nullcontext()),
    }
    out: dict[str, Any] = {
        "model": m.model_dump(include={"arch", "dim", "n_layers", "n_routed_experts", "n_experts_per_tok"}),
        "tokens": rows * (seq - 1),
        # float32 engine vs float32 trainer replaying its ids: the parity floor (~1e-6)
        "fp32_engine_vs_fp32_trainer": compare(e32, ref_own, tokens),
        "engine_bf16_vs_fp32": compare(e16, ref, tokens),
    }
    for name, run in trainer.items():
        out[f"trainer_{name}_vs_fp32"] = compare(run, ref, tokens)
        out[f"engine_vs_trainer_{name}"] = compare(e16, run, tokens)
    return out


def summary(res: dict[str, Any]) -> str:
    """A table: per layer, the max |diff| of the residual stream after the layer, then log-probs."""
    keys = [
        "fp32_engine_vs_fp32_trainer",
        "engine_bf16_vs_fp32",
        *(f"trainer_{p}_vs_fp32" for p in TRAINER_PATHS),
    ]
    keys += [f"engine_vs_trainer_{p}" for p in TRAINER_PATHS]
    lines = [f"{'':34s}" + "".join(f"{k:>12s}" for k in ("attn", "mlp", "router_w", "resid"))]
    for k in keys:
        for i, layer in enumerate(res[k]["layers"]):
            cells = "".join(f"{layer[t]['mean']:12.3e}" if t in layer else f"{'-':>12s}" for t in TAPS)
            lines.append(f"{k + f' L{i} mean':34s}{cells}")
        r = res[k]
        lines.append(
            f"{k + ' logp':34s} |dlogp| max {r['logp_abs_max']:.3e} mean {r['logp_abs_mean']:.3e}"
            f"  kl_k3 {r['kl_k3_next']:.3e}  kl_full {r['kl_full_mean']:.3e}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dense", action="store_true", help="dense Qwen3 instead of the MoE")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--perturb-norms", action="store_true", help="norm weights 1 + N(0, 0.2), as if trained")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    m = dense_config(args.layers) if args.dense else moe_config(args.layers)
    res = measure(m, rows=args.rows, seq=args.seq, seed=args.seed, perturb_norms=args.perturb_norms)
    print(summary(res))
    if args.out is not None:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
