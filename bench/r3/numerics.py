"""Where do the bf16 engine and the bf16 trainer round differently? (Router Replay's KL floor)

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
Both sides' LM-head logits are float32 by default (`logits_fp32`, ops/lm_head.py);
`--bf16-logits` measures a bf16-output head.

Floor sources (`--sources`, `floor_sources()`): on CPU the two sides are bitwise equal with replay,
so the GPU's floor (kernels summing in different orders) is emulated on the trainer side, one
toggle at a time, and the mismatch KL is reported with bf16 and with float32 logits:
  - `head_order`: the LM head's float32 accumulator perturbed by a relative N(0, eps) with
    eps = 2^-24 * sqrt(dim) (the spread of float32 sums of `dim` products in another order, as
    cuBLAS tiles or split-K give); the bf16-logits arm rounds the perturbed value to bf16, the
    float32 arm keeps it;
  - `body_flip`: every attention and MLP/MoE output element moved to its neighbouring bf16 value
    with probability p (a bf16-output kernel whose float32 sum lands on the other side of a
    rounding boundary: Triton paged attention vs SDPA, grouped vs per-expert GEMMs).
These are models of the GPU's differences, not measurements of them; what they show is how much
each source is amplified by rounding the logits to bf16.

Residual stream (`--residual`, `residual_sources()`): ModelConfig.fp32_residual on both sides
(default fp32: the hidden state between layers in float32, each residual add in float32; bf16:
rounded at every add). `--residual fp32,bf16 --sources` runs the floor sources with each stream,
side by side: how much of the emulated body_flip floor the float32 stream removes (a sub-ulp
sublayer difference is not rounded up to a whole ulp of the larger residual).

Head alone (`--head`, `head_only()`): the LM head at the real shape (dim 2048, vocabulary 151936)
with a real accumulation-order difference (one float32 GEMM against the same products summed as
4 split-K partial GEMMs), near-uniform (hf init) and peaked (trained-like) logits: the head's whole
share of the floor with bf16 and with float32 logits.

Run (CPU, ~10 s; --sources ~10 s more; --head ~2 min):
    .venv/bin/python bench/r3/numerics.py [--dense] [--perturb-norms] [--layers 4] [--rows 4] [--seq 64]
        [--bf16-logits] [--residual fp32|bf16|fp32,bf16] [--sources] [--head] [--out x.json]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.machine import machine  # noqa: E402
from bench.results import write_result  # noqa: E402
from services.common.config import EngineConfig, ModelConfig  # noqa: E402
from services.engine import LLMEngine  # noqa: E402
from services.engine.batch import ForwardBatch, Span  # noqa: E402
from services.engine.layers.moe import MoE as EngineMoE  # noqa: E402
from trainer.chunked import enable_chunked_output  # noqa: E402
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
    logits: torch.Tensor | None = None  # [N, V] as the head returned them (float32 or bf16)
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
            out.logits = logits
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
    logits_fp32: bool = True,
    fp32_residual: bool = True,
) -> dict[str, Any]:
    """Everything above for one model; returns a JSON-able dict (see the module docstring).
    logits_fp32: both sides' LM head with a float32 output (EngineConfig / trainer.logits_fp32).
    fp32_residual: ModelConfig.fp32_residual on both sides (the engine reads it from config.json)."""
    m = m.model_copy(update={"fp32_residual": fp32_residual})
    torch.manual_seed(seed)
    model = build_model(m, seed=seed).eval()
    hf_init(model, seed, perturb_norms)
    enable_chunked_output(model, logits_fp32)  # the trainer's head, as train.py sets it up
    tokens = torch.randint(0, m.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(seed + 1))
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        d = save_weights_dir(m, model.state_dict(), workdir / "w", {"version": 0})
        ecfg = dict(
            device="cpu",
            max_batch_size=rows,
            max_seq_len=max(seq, 16),
            block_size=16,
            logits_fp32=logits_fp32,
        )
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
        "logits_fp32": logits_fp32,
        "fp32_residual": fp32_residual,
        # float32 engine vs float32 trainer replaying its ids: the parity floor (~1e-6)
        "fp32_engine_vs_fp32_trainer": compare(e32, ref_own, tokens),
        "engine_bf16_vs_fp32": compare(e16, ref, tokens),
    }
    for name, run in trainer.items():
        out[f"trainer_{name}_vs_fp32"] = compare(run, ref, tokens)
        out[f"engine_vs_trainer_{name}"] = compare(e16, run, tokens)
    return out


def _flip_hook(p: float, gen: torch.Generator) -> Any:
    """Forward hook: each element of a bf16 output moves to a neighbouring bf16 value (up or down
    at random) with probability p (`body_flip`)."""

    def hook(m: torch.nn.Module, i: Any, o: torch.Tensor) -> torch.Tensor:
        assert o.dtype == torch.bfloat16, o.dtype
        hit = torch.rand(o.shape, generator=gen) < p
        to = torch.where(torch.rand(o.shape, generator=gen) < 0.5, float("inf"), float("-inf"))
        return torch.where(hit, torch.nextafter(o, to.to(o.dtype)), o)

    return hook


def _order_hook(eps: float, gen: torch.Generator, store: list[torch.Tensor]) -> Any:
    """Forward hook on the trainer's float32 head: x * (1 + N(0, eps)) (`head_order`); keeps the
    result in `store` (the arms are derived from it)."""

    def hook(m: torch.nn.Module, i: Any, o: torch.Tensor) -> torch.Tensor:
        assert o.dtype == torch.float32, o.dtype
        if eps > 0:
            o = o * (1 + eps * torch.randn(o.shape, generator=gen))
        store.append(o)
        return o

    return hook


SOURCE_ROWS: dict[str, tuple[bool, float]] = {
    # name: (head_order on, body_flip probability)
    "none": (False, 0.0),
    "head_order": (True, 0.0),
    "body_flip_1e-3": (False, 1e-3),
    "body_flip_1e-2": (False, 1e-2),
    "head_order+body_flip_1e-3": (True, 1e-3),
}


def floor_sources(
    m: ModelConfig,
    *,
    rows: int = 4,
    seq: int = 64,
    seed: int = 0,
    perturb_norms: bool = False,
    fp32_residual: bool = True,
) -> dict[str, Any]:
    """The replay floor by emulated source (module docstring, "Floor sources"), each with the
    logits rounded to bf16 (`bf16_logits`: the engine with logits_fp32 off, the trainer's float32
    accumulator rounded) and kept in float32 (`fp32_logits`: both sides' logits_fp32 head).
    Trainer: bf16 parameters (FSDP2's mixed precision), the engine's expert ids replayed.
    fp32_residual: ModelConfig.fp32_residual on both sides (`residual_sources` runs both)."""
    m = m.model_copy(update={"fp32_residual": fp32_residual})
    torch.manual_seed(seed)
    model = build_model(m, seed=seed).eval()
    hf_init(model, seed, perturb_norms)
    enable_chunked_output(model, True)
    tokens = torch.randint(0, m.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(seed + 1))
    with tempfile.TemporaryDirectory() as tmp:
        d = save_weights_dir(m, model.state_dict(), Path(tmp) / "w", {"version": 0})
        ecfg = EngineConfig(device="cpu", dtype="bfloat16", max_batch_size=rows, max_seq_len=max(seq, 16))
        eng = LLMEngine(d, ecfg)
        engine: dict[str, Run] = {}
        for arm, fp32 in (("bf16_logits", False), ("fp32_logits", True)):
            eng.model.logits_fp32 = fp32
            engine[arm] = run_engine(eng, tokens)
    routes = torch.stack(engine["fp32_logits"].ids, dim=1).view(rows, seq, len(engine["fp32_logits"].ids), -1)
    trainer_model = bf16_params(model)
    eps = 2.0**-24 * m.dim**0.5
    out: dict[str, Any] = {
        "tokens": rows * (seq - 1),
        "head_order_eps": eps,
        "fp32_residual": fp32_residual,
        "rows": {},
    }
    for name, (order, p) in SOURCE_ROWS.items():
        gen = torch.Generator().manual_seed(seed + 7)
        store: list[torch.Tensor] = []
        hooks = [trainer_model.output.register_forward_hook(_order_hook(eps if order else 0.0, gen, store))]
        if p > 0:
            for block in trainer_model.layers.values():  # type: ignore[union-attr]
                ffn = block.moe if getattr(block, "moe_enabled", False) else block.feed_forward
                hooks.append(block.attention.register_forward_hook(_flip_hook(p, gen)))
                hooks.append(ffn.register_forward_hook(_flip_hook(p, gen)))
        try:
            run_trainer(trainer_model, tokens, routes, contextlib.nullcontext())  # logits: `store`
        finally:
            for h in hooks:
                h.remove()
        (x,) = store
        row: dict[str, Any] = {}
        for arm, logits in (("bf16_logits", x.bfloat16()), ("fp32_logits", x)):
            mine = engine[arm].logits
            assert mine is not None and mine.dtype == logits.dtype, (arm, mine, logits.dtype)
            row[arm] = _logits_kl(mine, logits.reshape(mine.shape), tokens)
        b, f = row["bf16_logits"]["kl_full_mean"], row["fp32_logits"]["kl_full_mean"]
        row["kl_bf16_over_fp32"] = b / f if f > 0 else (float("inf") if b > 0 else 1.0)
        out["rows"][name] = row
    return out


def residual_sources(
    m: ModelConfig, *, rows: int = 4, seq: int = 64, seed: int = 0, perturb_norms: bool = False
) -> dict[str, Any]:
    """floor_sources with the residual stream in bf16 and in float32 (ModelConfig.fp32_residual),
    same model, tokens and emulated differences; `kl_bf16_over_fp32_residual` per source: what the
    float32 stream removes of that source's floor (float32 logits, the default head)."""
    kw = dict(rows=rows, seq=seq, seed=seed, perturb_norms=perturb_norms)
    arms = {
        name: floor_sources(m, fp32_residual=fp32, **kw) for name, fp32 in (("bf16", False), ("fp32", True))
    }
    ratio: dict[str, float] = {}
    for name in SOURCE_ROWS:
        b, f = (arms[a]["rows"][name]["fp32_logits"]["kl_full_mean"] for a in ("bf16", "fp32"))
        ratio[name] = b / f if f > 0 else (float("inf") if b > 0 else 1.0)
    return {"by_residual": arms, "kl_bf16_over_fp32_residual": ratio}


def residual_summary(res: dict[str, Any]) -> str:
    lines = ["floor by emulated source, float32 logits, residual stream bf16 vs float32 (fp32_residual):"]
    lines.append(f"{'source':28s}{'KL bf16 resid':>16s}{'KL fp32 resid':>16s}{'bf16/fp32':>12s}")
    arms = res["by_residual"]
    for name, r in res["kl_bf16_over_fp32_residual"].items():
        b, f = (arms[a]["rows"][name]["fp32_logits"]["kl_full_mean"] for a in ("bf16", "fp32"))
        lines.append(f"{name:28s}{b:16.3e}{f:16.3e}{r:12.2f}")
    return "\n".join(lines)


def _logits_kl(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor) -> dict[str, float]:
    """KL(softmax(a) || softmax(b)) and the target log-prob difference, in float64 from the two
    sides' logits [N, V]: KLs of 1e-12 are below the float32 log-softmax's own rounding."""
    bsz, t = rows.shape
    la = torch.log_softmax(a.double(), -1).view(bsz, t, -1)[:, :-1]
    lb = torch.log_softmax(b.double(), -1).view(bsz, t, -1)[:, :-1]
    dlogp = (la.gather(-1, rows[:, 1:, None]) - lb.gather(-1, rows[:, 1:, None])).squeeze(-1)
    return {
        "logits_differ_frac": float((a != b).double().mean()),
        "logp_abs_max": float(dlogp.abs().max()),
        "logp_abs_mean": float(dlogp.abs().mean()),
        "kl_full_mean": float((la.exp() * (la - lb)).sum(-1).mean()),
    }


def head_only(
    dim: int = 2048, vocab: int = 151936, rows: int = 256, splits: int = 4, seed: int = 0
) -> dict[str, Any]:
    """The LM head alone at the real shape (Qwen3-30B-A3B: dim 2048, vocabulary 151936), with a
    *real* accumulation-order difference instead of an emulated one: side A is one float32 GEMM
    of the bf16 inputs, side B the same products summed as `splits` split-K partial GEMMs (what a
    split-K or differently tiled kernel does). Same hidden states on both sides, so this is the
    head's whole share of the floor: KL between the sides with the logits rounded to bf16 and kept
    in float32. Hidden rows N(0, 1) (a final RMSNorm's output); weights N(0, std) for std 0.02
    (the hf init: logits ~ N(0, 0.9), near-uniform) and 0.2 (logits ~ N(0, 9): peaked
    distributions, entropy a few nats, closer to a trained model's)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, dim, generator=g).bfloat16().float()
    out: dict[str, Any] = {"dim": dim, "vocab": vocab, "rows": rows, "splits": splits, "by_weight_std": {}}
    w0 = torch.randn(vocab, dim, generator=g)
    for std in (0.02, 0.2):
        w = (w0 * std).bfloat16().float()
        a = h @ w.t()
        k = dim // splits
        b = sum(h[:, j * k : (j + 1) * k] @ w[:, j * k : (j + 1) * k].t() for j in range(splits))
        assert isinstance(b, torch.Tensor)
        row: dict[str, Any] = {"logit_std": float(a.std())}
        for arm, (xa, xb) in (("bf16_logits", (a.bfloat16(), b.bfloat16())), ("fp32_logits", (a, b))):
            la, lb = torch.log_softmax(xa.double(), -1), torch.log_softmax(xb.double(), -1)
            row[arm] = {
                "logits_differ_frac": float((xa != xb).double().mean()),
                "kl_full_mean": float((la.exp() * (la - lb)).sum(-1).mean()),
            }
        row["entropy_mean"] = float(-(la.exp() * la).sum(-1).mean())
        out["by_weight_std"][str(std)] = row
    return out


def sources_summary(res: dict[str, Any]) -> str:
    lines = [f"floor sources (emulated on the trainer side; head_order eps {res['head_order_eps']:.2e}):"]
    head = ("KL bf16 logits", "KL fp32 logits", "bf16/fp32", "differ bf16", "differ fp32")
    lines.append(f"{'source':28s}" + "".join(f"{h:>16s}" for h in head))
    for name, r in res["rows"].items():
        b, f = r["bf16_logits"], r["fp32_logits"]
        lines.append(
            f"{name:28s}{b['kl_full_mean']:16.3e}{f['kl_full_mean']:16.3e}{r['kl_bf16_over_fp32']:16.2f}"
            f"{b['logits_differ_frac']:16.3e}{f['logits_differ_frac']:16.3e}"
        )
    return "\n".join(lines)


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
    ap.add_argument("--bf16-logits", action="store_true", help="both sides' LM head with a bf16 output")
    ap.add_argument("--sources", action="store_true", help="also the floor by emulated source (docstring)")
    ap.add_argument(
        "--residual",
        default="fp32",
        help="fp32 or bf16: ModelConfig.fp32_residual for the main table and --sources; "
        "fp32,bf16: also the --sources floor with each, side by side (residual_sources)",
    )
    ap.add_argument("--head", action="store_true", help="also the head alone at the real shape (head_only)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    residual = [x.strip() for x in args.residual.split(",") if x.strip()]
    if not residual or any(x not in ("fp32", "bf16") for x in residual):
        ap.error("--residual: fp32, bf16 or fp32,bf16")
    torch.set_num_threads(1)
    m = dense_config(args.layers) if args.dense else moe_config(args.layers)
    kw = dict(rows=args.rows, seq=args.seq, seed=args.seed, perturb_norms=args.perturb_norms)
    fp32_residual = residual[0] == "fp32"
    res = measure(m, logits_fp32=not args.bf16_logits, fp32_residual=fp32_residual, **kw)
    print(summary(res))
    if args.sources:
        res["floor_sources"] = floor_sources(m, fp32_residual=fp32_residual, **kw)
        print(sources_summary(res["floor_sources"]))
        if len(residual) > 1:
            res["residual_sources"] = residual_sources(m, **kw)
            print(residual_summary(res["residual_sources"]))
    if args.head:
        res["head_only"] = head_only(seed=args.seed)
        print("head alone (real shape, split-K order on one side):")
        for std, r in res["head_only"]["by_weight_std"].items():
            b, f = r["bf16_logits"], r["fp32_logits"]
            print(
                f"  weight std {std}: logit std {r['logit_std']:.2f}, entropy {r['entropy_mean']:.2f}:"
                f" KL bf16 logits {b['kl_full_mean']:.3e} (differ {b['logits_differ_frac']:.2e}),"
                f" fp32 logits {f['kl_full_mean']:.3e} (differ {f['logits_differ_frac']:.2e})"
            )
    if args.out is not None:
        record = {
            "command": " ".join(
                ["python3", "bench/r3/numerics.py", *(sys.argv[1:] if argv is None else argv)]
            ),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": machine(),
            "baseline": "the float32 engine against the float32 trainer in the same process "
            "(fp32_engine_vs_fp32_trainer); each bf16 row is also measured against float32",
        }
        write_result(args.out, {**record, **res})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
