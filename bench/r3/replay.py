"""Router Replay benchmark: trainer/inference mismatch on a Qwen3-30B-A3B-shaped MoE,
with and without replaying the engine's expert choices in the trainer.

    # on the H200 (repo on PYTHONPATH; torchtitan/pydantic wheels in .whl/ are installed into
    # /tmp/site when missing), ~2-4 minutes:
    python3 bench/r3/replay.py --out $OUT/r3.json
    # CPU smoke run of the whole script on tiny shapes (what bench/tests/test_r3.py runs):
    .venv/bin/python bench/r3/replay.py --device cpu --smoke --out /tmp/r3.json

Per initialisation (`--inits`, default both):
  1. the trainer's model (trainer/model.py build path; `--layers` layers of Qwen3-30B-A3B: hidden
     2048, 32 heads / 4 KV heads x 128, 128 experts top-8 of width 768, vocab 151936) is built
     with random weights on the device in float32 and published as an HF directory by
     trainer.publish.Publisher, exactly as the trainer publishes version 0;
  2. our engine loads it in bf16 (its own CUDA kernels: attention_backend "auto", CUDA graphs)
     and samples `--new-tokens` tokens (T=1) for each of `--prompts` random prompts, with
     return_routed_experts;
  3. the completions become `Sample`s as the orchestrator builds them, and the trainer scores them
     the way train_step does (trainer.batch micro-batches, trainer.replay.micro_batch_routes,
     `routing(model, routes, replay)`, packed_logprobs), in bf16, with replay off and on:
       - "autocast": a single trainer process (trainer.nproc = 1): float32 weights under
         torch.autocast(bf16) (trainer.parallel.autocast_context);
       - "fsdp": the torchrun path, FSDP2 on a 1-rank group with MixedPrecisionPolicy(bf16)
         (trainer.parallel.parallelize), i.e. bf16 parameters.
  4. per row: k3 KL(pi_infer || pi_train) on the sampled tokens, max/mean |p_train - p_infer|,
     share of tokens with p_train/p_infer outside [0.5, 2], per-layer and mean routing agreement
     (the trainer's own top-k set vs the recorded one, over every recorded token), the KL ratio
     off/on (goal: >= 10), and the KL split between sampled tokens whose own routing flipped in
     some layer and the rest (bench/r3/README.md).
Plus a float32 sanity row on a tiny config (engine and trainer float32): replay on must give
agreement 1.0 and a near-zero KL; and `logits_check`: the float32 LM head on the device at the
real head shape against a float64 reference, and the chunked head against the plain one.

LM-head precision (`--logits`, default fp32): "fp32" runs both sides' logits as the bf16 GEMM's
float32 output (decode.engine.logits_fp32 / trainer.logits_fp32, the default); "bf16" a bf16
output. `--logits fp32,bf16` runs every initialisation with each, in one process (phases
`bf16/<init>` and `bf16/<init>/bf16_logits`; every phase records `logits_fp32`).

Residual stream (`--residual`, default fp32): ModelConfig.fp32_residual on both sides ("fp32": the
hidden state between layers is float32 in the engine and the trainer; "bf16": rounded to bf16 at
every residual add, as before). The published config.json carries it to the engine
(`relay_fp32_residual`), which reports what it loaded (`engine.engine_fp32_residual`).
`--residual fp32,bf16` runs every initialisation with each, in one process (phases
`bf16/<init>` and `bf16/<init>/bf16_residual`; every phase records `fp32_residual`).

Initialisations: "trainer" is torchtitan's init as trainer.model.build_model draws it (embeddings
std 1, layers std 0.02 with depth-scaled output projections: the residual stream is dominated by
the token embedding, every layer's contribution is small); "hf" is transformers' Qwen3-MoE init
(every linear and the embedding N(0, 0.02), norms 1: attention and MoE outputs dominate the
residual stream, closer to a trained model's balance). Random weights give near-uniform next-token
distributions over 151936 ids (the report includes the trainer's mean entropy), so the absolute
KLs are small; the off/on ratio is the comparison that carries over.

Each phase runs in its own try/except and the JSON is rewritten after every phase.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import gc
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _ensure_wheels() -> None:
    """The GPU machine lacks torchtitan/pydantic: install the carried .whl/ into /tmp/site once
    (as bench/trainer/step.py does)."""
    try:
        import pydantic  # noqa: F401
        import torchtitan  # noqa: F401
    except ImportError:
        site = Path("/tmp/site")
        if not site.exists():
            wheels = [str(p) for p in (REPO / ".whl").glob("*.whl")]
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                "--target",
                str(site),
            ]
            subprocess.run([*cmd, *wheels], check=True)
        sys.path.insert(0, str(site))
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


_ensure_wheels()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.machine import machine  # noqa: E402
from bench.results import write_result  # noqa: E402
from services.common.config import EngineConfig, ModelConfig, TrainerSection  # noqa: E402
from services.common.schemas import GenerateRequest, Sample, SamplingParams  # noqa: E402
from services.engine import LLMEngine  # noqa: E402
from trainer.attention import micro_batch_attention, packed_logprobs  # noqa: E402
from trainer.batch import micro_batches  # noqa: E402
from trainer.chunked import enable_chunked_output  # noqa: E402
from trainer.mismatch import MismatchStats, token_mismatch  # noqa: E402
from trainer.model import build_model  # noqa: E402
from trainer.parallel import autocast_context, parallelize  # noqa: E402
from trainer.publish import Publisher  # noqa: E402
from trainer.replay import micro_batch_routes, moe_routers, routing  # noqa: E402

KL_GOAL = 10.0  # the goal: replay cuts the mismatch KL at least 10x


# ------------------------------------------------------------------ model shapes


def qwen3_30b_a3b(layers: int) -> ModelConfig:
    """Qwen3-30B-A3B's HF config.json, with `layers` of its 48 layers."""
    return ModelConfig(
        arch="qwen3_moe",
        vocab_size=151936,
        dim=2048,
        n_layers=layers,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        hidden_dim=6144,  # unused: every layer is MoE (mlp_only_layers = [])
        max_seq_len=4096,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        qk_norm=True,
        tie_embeddings=False,
        n_routed_experts=128,
        n_experts_per_tok=8,
        moe_hidden_dim=768,
        first_k_dense=0,
        router_score="softmax",
        norm_topk_prob=True,
    )


def smoke_moe(layers: int) -> ModelConfig:
    """Same structure at CPU size (vocab >= the char tokenizer the published directory carries)."""
    return ModelConfig(
        arch="qwen3_moe",
        vocab_size=1024,
        dim=128,
        n_layers=layers,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        hidden_dim=256,
        max_seq_len=512,
        rope_theta=1_000_000.0,
        tie_embeddings=False,
        n_routed_experts=16,
        n_experts_per_tok=4,
        moe_hidden_dim=64,
        router_score="softmax",
        norm_topk_prob=True,
    )


def mid_moe(layers: int) -> ModelConfig:
    """A CPU-sized proxy with the routing of the real shape's kind (64 experts top-8, dim 512):
    `--shape mid`, for a quick look at flip rates without a GPU."""
    return ModelConfig(
        arch="qwen3_moe",
        vocab_size=4096,
        dim=512,
        n_layers=layers,
        n_heads=8,
        n_kv_heads=2,
        head_dim=64,
        hidden_dim=512,
        max_seq_len=512,
        rope_theta=1_000_000.0,
        tie_embeddings=False,
        n_routed_experts=64,
        n_experts_per_tok=8,
        moe_hidden_dim=128,
        router_score="softmax",
        norm_topk_prob=True,
    )


def tiny_moe() -> ModelConfig:
    """The float32 sanity row's model: debug-moe-sized, untied, top-2 of 8."""
    return ModelConfig(
        arch="qwen3_moe",
        vocab_size=128,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        hidden_dim=128,
        max_seq_len=512,
        tie_embeddings=False,
        n_routed_experts=8,
        n_experts_per_tok=2,
        moe_hidden_dim=32,
        router_score="softmax",
        norm_topk_prob=True,
    )


def model_toml(name: str) -> ModelConfig:
    """configs/models/<name>.toml as a ModelConfig."""
    with open(REPO / "configs" / "models" / f"{name}.toml", "rb") as f:
        return ModelConfig(**tomllib.load(f))


def reshaped(m: ModelConfig, **update: Any) -> ModelConfig:
    return ModelConfig.model_validate({**m.model_dump(), **update})


# GLM-5 reduced in depth: one leading dense layer, then MoE layers. Full width (hidden 6144, MLA
# and DSA dims, expert width 2048, vocabulary 154880); the routed experts per MoE layer are
# `experts` of GLM-5's 256 (top-8 kept): one full-width MoE layer is 9.7B parameters.
GLM5_EXPERTS = 32  # what one GPU of an EP=8 group holds of the 256: the same per-expert load
# Nemotron-3 Nano at full width (hidden 2688, all 128 experts top-6, Mamba-2 64 x 64 heads):
# three Mamba-2, two MoE and one attention layer (bench/engine/nemotron_gpu.py's pattern).
NEMOTRON3_PATTERN = "MEM*EM"
BF16_MAX_SEQ = 4096  # RoPE tables of the reduced shapes (the prompts stay below)


def glm5_reduced(layers: int, experts: int = GLM5_EXPERTS) -> ModelConfig:
    """configs/models/glm5.toml with `layers` layers (the first dense) and `experts` routed experts."""
    if layers < 2:
        raise ValueError("--layers: the GLM-5 shape needs >= 2 (one dense, then MoE)")
    return reshaped(
        model_toml("glm5"),
        n_layers=layers,
        first_k_dense=1,
        n_routed_experts=experts,
        n_mtp_layers=0,
        max_seq_len=BF16_MAX_SEQ,
    )


def nemotron3_reduced(pattern: str = NEMOTRON3_PATTERN) -> ModelConfig:
    """configs/models/nemotron3.toml with the layers of `pattern` (M Mamba-2, E MoE, * attention)."""
    return reshaped(
        model_toml("nemotron3"), n_layers=len(pattern), hybrid_pattern=pattern, max_seq_len=BF16_MAX_SEQ
    )


def bf16_shape(args: argparse.Namespace) -> ModelConfig:
    """The model of the bf16 rows, from --shape (and --layers, --experts, --pattern)."""
    if args.shape == "glm5":
        return glm5_reduced(args.layers, args.experts)
    if args.shape == "nemotron3":
        return nemotron3_reduced(args.pattern)
    if args.shape in ("smoke-glm5", "smoke-nemotron"):
        # the debug config at CPU size with smoke_moe's vocabulary, width and routing (untied:
        # the "peaked" init redraws only the output matrix)
        return reshaped(
            tiny_of(args.shape),
            vocab_size=1024,
            dim=128,
            n_routed_experts=16,
            n_experts_per_tok=4,
            tie_embeddings=False,
        )
    shapes = {"qwen3-30b-a3b": qwen3_30b_a3b, "mid": mid_moe, "smoke": smoke_moe}
    return shapes[args.shape](args.layers)


def tiny_of(shape: str) -> ModelConfig:
    """The float32 sanity row's model for the bf16 rows' architecture: debug-moe-sized qwen3_moe,
    or the debug-glm5 / debug-nemotron configs (GLM-5's indexer keeping 16 keys, so prompts
    longer than that run sparse attention on both sides)."""
    if "glm5" in shape:
        return model_toml("debug-glm5")
    if "nemotron" in shape:
        return model_toml("debug-nemotron")
    return tiny_moe()


def default_inits(shape: str) -> str:
    """Qwen3-MoE: torchtitan's and transformers' inits; GLM-5 / Nemotron-3: transformers' (the
    layers' share of the residual stream a trained model has, where routing flips show)."""
    return "hf" if ("glm5" in shape or "nemotron" in shape) else "trainer,hf"


@torch.no_grad()
def build_trainer_model(m: ModelConfig, init: str, seed: int, device: torch.device) -> torch.nn.Module:
    """The trainer's model (float32, on `device`) with random weights drawn by `init`."""
    if init == "peaked":
        # torchtitan's init with the output matrix redrawn at std 4/sqrt(dim): the final norm's
        # output has RMS 1, so logits have a std of ~4 and next-token distributions are neither
        # flat (random weights otherwise give ~log(vocab) entropy, where any KL is tiny) nor
        # one-hot (bench/engine/nemotron_gpu.py draws its model the same way).
        return build_model(m, seed=seed, device=device, init_std=4 / m.dim**0.5)
    model = build_model(m, seed=seed, device=device)
    if init == "hf":
        # transformers' _init_weights (Qwen3-MoE, GlmMoeDsa, NemotronH): N(0, initializer_range=
        # 0.02) for every linear (router gate and experts included) and the embedding; RMSNorm
        # weights 1. Other vectors (Mamba-2's A_log, D, dt_bias; the indexer's LayerNorm bias)
        # and Mamba-2's depthwise convolution keep the trainer's init, as transformers keeps
        # their own.
        g = torch.Generator(device=device).manual_seed(seed)
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1 and not name.endswith("bias"):
                p.fill_(1.0)
            elif p.dim() >= 2 and "conv" not in name:
                p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=p.dtype) * 0.02)
    elif init != "trainer":
        raise ValueError(f"--inits: unknown initialisation {init!r} (trainer, hf, peaked)")
    return model


# ------------------------------------------------------------------ engine side


def publish(
    model: torch.nn.Module, m: ModelConfig, dest: Path, dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """Write the model as version 0 with the trainer's own publisher (an HF directory in `dtype`;
    None: the parameters' float32)."""
    t0 = time.perf_counter()
    pub = Publisher(m, dtype=dtype)
    pub.publish(model, 0, dest, background=False)
    out = {
        "publish_s": round(time.perf_counter() - t0, 2),
        "bytes": pub.last.bytes if pub.last else None,
        "publish_dtype": str(dtype or torch.float32),
    }
    del pub  # drops the pinned host buffers
    gc.collect()
    return out


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


EngineHook = Callable[[LLMEngine], dict[str, Any]]


def sample_with_engine(
    model_dir: Path,
    ecfg: EngineConfig,
    prompts: list[list[int]],
    new_tokens: int,
    seed: int,
    with_engine: EngineHook | None = None,
) -> tuple[list[Sample], dict[str, Any]]:
    """Sample from our engine and turn each completion into the trainer's `Sample` (one turn: the
    choice's routed_experts already has one row per token, the last one unrecorded).
    with_engine: run on the loaded engine after sampling (its result lands under "with_engine"),
    so another measurement shares the weight load."""
    t0 = time.perf_counter()
    eng = LLMEngine(model_dir, ecfg)
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=seed)
    reqs = [GenerateRequest(input_ids=p, sampling=params, return_routed_experts=True) for p in prompts]
    t0 = time.perf_counter()
    resps = eng.generate(reqs)
    gen_s = time.perf_counter() - t0
    samples = []
    for i, (p, r) in enumerate(zip(prompts, resps, strict=True)):
        c = r.choices[0]
        if c.routed_experts is None:
            raise RuntimeError(f"prompt {i}: the engine returned no routed_experts ({c.finish_reason})")
        n_out = len(c.output_ids)
        samples.append(
            Sample(
                rollout_id=f"r3-{i}",
                tokens=p + c.output_ids,
                loss_mask=[0] * len(p) + [1] * n_out,
                logprobs=[0.0] * len(p) + list(c.logprobs),
                versions=[-1] * len(p) + list(c.versions),
                reward=0.0,
                routed_experts=c.routed_experts,
            )
        )
    info = {
        "engine_dtype": ecfg.dtype,
        "engine_logits_fp32": ecfg.logits_fp32,
        "engine_fp32_residual": eng.model.fp32_residual,  # as loaded from config.json
        "attention_backend": eng.attention_backend,
        "cuda_graphs": eng.graphs is not None,
        "engine_load_s": round(load_s, 2),
        "generate_s": round(gen_s, 2),
        "prompts": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "sampled_tokens": sum(sum(s.loss_mask) for s in samples),
    }
    if with_engine is not None:
        info["with_engine"] = _try(functools.partial(with_engine, eng))
    del eng
    free()
    return samples, info


def publish_and_sample(
    model: torch.nn.Module,
    m: ModelConfig,
    dest: Path,
    device: torch.device,
    dtype: str,
    prompts: list[list[int]],
    max_seq_len: int,
    new_tokens: int,
    seed: int,
    logits_fp32: bool = True,
    with_engine: EngineHook | None = None,
    engine_update: dict[str, Any] | None = None,
    publish_in_engine_dtype: bool = False,
) -> tuple[list[Sample], dict[str, Any]]:
    """Publish `model` as version 0 at `dest` and sample `new_tokens` per prompt from our engine
    loading it in `dtype`: the samples, and the publish and engine numbers for the report.
    engine_update: EngineConfig fields over these (a larger batch or context for `with_engine`).
    publish_in_engine_dtype: write the directory in `dtype`, as trainer/train.py publishes for its
    engines (else float32; the engine rounds to `dtype` at load: the same values)."""
    info = publish(model, m, dest, getattr(torch, dtype) if publish_in_engine_dtype else None)
    fields: dict[str, Any] = dict(
        device=device.type,
        dtype=dtype,
        max_batch_size=len(prompts),
        max_seq_len=max_seq_len,
        torch_threads=engine_threads(device),
        logits_fp32=logits_fp32,
    )
    ecfg = EngineConfig(**{**fields, **(engine_update or {})})
    samples, info["engine"] = sample_with_engine(dest, ecfg, prompts, new_tokens, seed, with_engine)
    return samples, info


# ------------------------------------------------------------------ trainer side


class OwnTopK:
    """Forward hooks on the MoE routers: each router's OWN top-k expert ids (whatever it routes
    by), recomputed from its input as TokenChoiceTopKRouter does, for the per-token split of the
    KL into tokens with and without a flipped expert set."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.ids: list[torch.Tensor] = []  # per MoE layer, this forward: [tokens, top_k]
        self.handles = [r.register_forward_hook(self._hook) for r in moe_routers(model)]

    @torch.no_grad()
    def _hook(self, mod: Any, inp: tuple[torch.Tensor, ...], _out: Any) -> None:
        logits = mod.gate_logits(inp[0])  # ReplayRouter's own float32 logits (trainer/replay.py)
        scores = torch.sigmoid(logits) if mod.score_func == "sigmoid" else torch.softmax(logits, dim=1)
        if len(inp) > 1 and inp[1] is not None:
            scores = scores + inp[1]
        if mod.num_expert_groups is not None:
            scores = mod._get_node_limited_routing_scores(scores)
        self.ids.append(torch.topk(scores, k=mod.top_k, dim=-1).indices)

    def flipped(self, route: torch.Tensor) -> torch.Tensor:
        """[B, T] bool: some MoE layer's own expert set differs from the recorded one at that
        input position (recorded rows only); `route` is [B, T, layers, top_k]."""
        b, t, layers, k = route.shape
        own = torch.stack([ids.view(b, t, k) for ids in self.ids], dim=2)
        diff = (own.sort(dim=-1).values != route.sort(dim=-1).values).any(dim=-1)
        recorded = (route >= 0).all(dim=-1)
        return (diff & recorded).any(dim=-1)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def score(
    model: torch.nn.Module,
    m: ModelConfig,
    samples: list[Sample],
    tc: TrainerSection,
    device: torch.device,
    replay: bool,
    amp: Any,
) -> dict[str, Any]:
    """The trainer's log-probs of the sampled tokens, as train_step computes them (no backward),
    and the mismatch against the engine's log-probs."""
    t0 = time.perf_counter()
    budget = tc.micro_batch_tokens
    mbs = micro_batches(samples, budget)
    routes = micro_batch_routes(samples, m, packing=False, token_budget=budget)
    stats = MismatchStats()
    ent_sum = 0.0
    log_r_max = 0.0
    # k3 sums and token counts over sampled tokens whose own position has a flipped expert set
    # (in any MoE layer) and over the others; flips earlier in the context reach both via attention.
    split = {"flipped": [0.0, 0.0], "unflipped": [0.0, 0.0]}
    for mb, route in zip(mbs, routes, strict=True):
        mb = mb.to(device)
        route = route.to(device) if route is not None else None
        tap = OwnTopK(model)
        try:
            with (
                routing(model, route, replay) as rec,
                micro_batch_attention(model, mb),
            ):
                with amp:
                    logp, ent = packed_logprobs(model, mb, tc.logprob_chunk_tokens)
        finally:
            tap.close()
        stats.add(token_mismatch(logp, mb.logp_infer, mb.loss_mask))
        stats.add_routing(rec.agree, rec.total, rec.replayed)
        mask = mb.loss_mask > 0
        ent_sum += float(ent[mask].double().sum().item())
        log_r = (logp.double() - mb.logp_infer.double())[mask]
        log_r_max = max(log_r_max, float(log_r.abs().max().item()))
        if route is not None:
            k3 = torch.exp(log_r) - 1.0 - log_r
            flip = tap.flipped(route)[mask]
            for key, sel in (("flipped", flip), ("unflipped", ~flip)):
                split[key][0] += float(k3[sel].sum().item())
                split[key][1] += float(sel.sum().item())
    out: dict[str, Any] = dict(stats.summary())
    n = max(stats.tokens, 1.0)
    out.update(
        tokens=int(stats.tokens),
        log_ratio_abs_max=log_r_max,
        train_entropy_mean=ent_sum / n,
        flipped_token_frac=split["flipped"][1] / n,
        # mean k3 over each part's tokens (None for a part without tokens)
        **{f"kl_k3_{key}_tokens": (kl / count if count else None) for key, (kl, count) in split.items()},
        score_s=round(time.perf_counter() - t0, 2),
    )
    return out


def off_on(
    model: torch.nn.Module,
    m: ModelConfig,
    samples: list[Sample],
    tc: TrainerSection,
    device: torch.device,
    amp: Any,
) -> dict[str, Any]:
    off = score(model, m, samples, tc, device, replay=False, amp=amp)
    on = score(model, m, samples, tc, device, replay=True, amp=amp)
    kl_off, kl_on = off["mismatch_kl_k3"], on["mismatch_kl_k3"]
    ratio = kl_off / kl_on if kl_on > 0 else float("inf")
    return {"replay_off": off, "replay_on": on, "kl_ratio_off_on": ratio, "kl_goal_10x_met": ratio >= KL_GOAL}


def single_process(model: torch.nn.Module, tc: TrainerSection, device: torch.device) -> torch.nn.Module:
    """The model as one trainer process holds it (trainer.nproc = 1: no process group)."""
    model, _, _ = parallelize(model, tc, 1, device, distributed=False)
    return model.eval()


def score_mode(
    model: torch.nn.Module,
    m: ModelConfig,
    samples: list[Sample],
    tc: TrainerSection,
    device: torch.device,
    fsdp: bool,
) -> dict[str, Any]:
    """off_on in one trainer mode, on a `single_process` model:
    - fsdp=False: the single process's weights as they are, under the trainer's autocast
      context (autocast(bf16) over float32 weights for a bf16 trainer, nothing for float32);
    - fsdp=True: the torchrun path, FSDP2 mixed precision (bf16 parameters and compute) over a
      1-rank group, sharding `model` in place; autocast off, as the trainer does with FSDP."""
    if not fsdp:
        return off_on(model, m, samples, tc, device, autocast_context(tc, device, False))
    group = OneRankGroup(device)
    try:
        # fsdp "always": the default "auto" would not wrap a 1-rank group (trainer.parallel.use_fsdp)
        sharded, _, _ = parallelize(
            model, tc.model_copy(update={"fsdp": "always"}), 1, device, distributed=True
        )
        res = off_on(sharded, m, samples, tc, device, autocast_context(tc, device, True))
        res["note"] = "FSDP2 on a 1-rank group, MixedPrecisionPolicy(param_dtype=bf16)"
        return res
    finally:
        group.close()


class OneRankGroup:
    """A 1-process group (nccl on CUDA, gloo on CPU): what FSDP2 needs, as under torchrun."""

    def __init__(self, device: torch.device) -> None:
        self.owned = False
        self.env: list[str] = []  # variables set here, removed again by close()
        if dist.is_initialized():
            return
        if "RANK" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            self.env = [k for k in env if k not in os.environ]
            os.environ.update({k: env[k] for k in self.env})
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
        self.owned = True

    def close(self) -> None:
        if self.owned and dist.is_initialized():
            dist.destroy_process_group()
        # (trainer.train.Dist reads RANK/WORLD_SIZE as "launched by torchrun")
        for k in self.env:
            os.environ.pop(k, None)


def phase_bf16(
    args: argparse.Namespace,
    init: str,
    device: torch.device,
    workdir: Path,
    logits_fp32: bool = True,
    fp32_residual: bool = True,
    with_engine: EngineHook | None = None,
    engine_update: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One initialisation: publish, sample with the bf16 engine, score in the bf16 trainer.
    logits_fp32: both sides' LM head with a float32 output (else rounded to bf16).
    fp32_residual: ModelConfig.fp32_residual on both sides (else the bf16 residual stream).
    with_engine, engine_update: see publish_and_sample."""
    cuda = device.type == "cuda"
    m = bf16_shape(args).model_copy(update={"fp32_residual": fp32_residual})
    out: dict[str, Any] = {
        "init": init,
        "model": m.model_dump(include=SHAPE_FIELDS),
        "logits_fp32": logits_fp32,
        "fp32_residual": fp32_residual,
    }
    t0 = time.perf_counter()
    model = build_trainer_model(m, init, args.seed, device)
    # as train.py: same parameters, chunked head when chunk > 0, its logits' precision
    enable_chunked_output(model, logits_fp32)
    out["build_s"] = round(time.perf_counter() - t0, 2)
    prompts = make_prompts(args.prompts, args.prompt_min, args.prompt_max, m.vocab_size, args.seed)
    # CPU smoke: bf16 too (the torch path); the engine picks its own kernels on CUDA.
    samples, info = publish_and_sample(
        model,
        m,
        workdir / f"{init}-step_0",
        device,
        "bfloat16",
        prompts,
        max_seq_len=args.prompt_max + args.new_tokens + 16,
        new_tokens=args.new_tokens,
        seed=args.seed,
        logits_fp32=logits_fp32,
        with_engine=with_engine,
        engine_update=engine_update,
        publish_in_engine_dtype=args.publish_dtype == "engine",
    )
    out.update(info)
    tc = TrainerSection(
        device=device.type,
        dtype="bfloat16",
        micro_batch_tokens=args.micro_batch_tokens,
        logprob_chunk_tokens=args.chunk,
        logits_fp32=logits_fp32,
    )
    model = single_process(model, tc, device)
    out["autocast"] = _try(lambda: score_mode(model, m, samples, tc, device, fsdp=False))
    if args.fsdp:  # the same model, sharded in place after the autocast rows
        out["fsdp"] = _try(lambda: score_mode(model, m, samples, tc, device, fsdp=True))
    if cuda:
        out["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
    return out  # the model and its shards are freed by the caller's free()


def phase_logits_check(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """On the device, the float32 LM head at the real head shape (dim 2048, vocab 151936, 64 rows):
    ops.lm_head.float32_logits (CUDA: torch.mm out_dtype) against a float64 reference
    of the bf16 inputs, the bf16-output GEMM's error for scale, and the trainer's chunked head
    (forward + backward, logits recomputed) against the plain float32 head."""
    from ops.lm_head import float32_logits, mm_out_dtype_works
    from trainer.chunked import chunked_logprobs, float32_head
    from trainer.loss import logprobs_from_logits

    dim, vocab, rows = (64, 1000, 16) if args.smoke else (2048, 151936, 64)
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    h = torch.randn(rows, dim, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(vocab, dim, generator=g) * 0.02).to(device, torch.bfloat16)
    ref = h.double() @ w.double().t()
    got = float32_logits(h, w)
    old = torch.nn.functional.linear(h, w)
    out: dict[str, Any] = {
        "shape": [rows, dim, vocab],
        "mm_out_dtype": mm_out_dtype_works(device),
        "dtype": str(got.dtype),
        "fp32_abs_err_max": float((got.double() - ref).abs().max()),
        "bf16_abs_err_max": float((old.double() - ref).abs().max()),
    }
    t = torch.randint(0, vocab, (rows,), generator=g).to(device)
    res = []
    for chunked in (True, False):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        logp = (
            chunked_logprobs(hh, ww, t, 16)[0]
            if chunked
            else logprobs_from_logits(float32_head(hh, ww), t)[0]
        )
        logp.sum().backward()
        assert hh.grad is not None and ww.grad is not None
        res.append((logp.detach().double(), hh.grad.double(), ww.grad.double()))
    (lc, ghc, gwc), (lf, ghf, gwf) = res
    out["chunked_vs_plain"] = {
        "logp_abs_max": float((lc - lf).abs().max()),
        "grad_h_rel": float((ghc - ghf).norm() / ghf.norm()),
        "grad_w_rel": float((gwc - gwf).norm() / gwf.norm()),
    }
    return out


def phase_fp32_sanity(args: argparse.Namespace, device: torch.device, workdir: Path) -> dict[str, Any]:
    """Engine and trainer both in float32 on a tiny config of the bf16 rows' architecture
    (tiny_of): replay on must agree on every expert set and leave only float32 rounding in the
    log-probs."""
    m = tiny_of(args.shape)
    init = "hf"  # (the debug configs are tied: "peaked" would make them near one-hot)
    model = build_trainer_model(m, init, args.seed, device)
    out: dict[str, Any] = {"model": m.model_dump(include=SHAPE_FIELDS), "arch": m.arch, "init": init}
    prompts = make_prompts(8 if args.smoke else 32, 8, 64, m.vocab_size, args.seed + 1)
    samples, info = publish_and_sample(
        model,
        m,
        workdir / "fp32-step_0",
        device,
        "float32",
        prompts,
        max_seq_len=min(m.max_seq_len, 64 + 64 + 16),
        new_tokens=16 if args.smoke else 64,
        seed=args.seed,
    )
    out.update(info)
    tc = TrainerSection(device=device.type, dtype="float32")
    out.update(score_mode(single_process(model, tc, device), m, samples, tc, device, fsdp=False))
    on = out["replay_on"]
    out["sanity_ok"] = on["routing_agreement_mean"] == 1.0 and on["mismatch_kl_k3"] < 1e-6
    return out


SHAPE_FIELDS = {
    "vocab_size",
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "n_routed_experts",
    "n_experts_per_tok",
    "moe_hidden_dim",
    "arch",
    "first_k_dense",
    "hybrid_pattern",
    "index_topk",
}


# ------------------------------------------------------------------ plumbing


def engine_threads(device: torch.device) -> int:
    """The engine sets torch's (process-wide) thread count: on the GPU machine it builds the
    model on the host before moving it (billions of parameters initialised there), so use its
    cores; on a shared CPU box stay at the default 1."""
    return max(1, min(16, os.cpu_count() or 1)) if device.type == "cuda" else 1


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _try(fn: Any) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001 - one failed part must not lose the others
        return {"error": traceback.format_exc()}


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers, one line per (init, trainer path)."""
    rows: dict[str, Any] = {}
    for key, phase in result.items():
        if not key.startswith("bf16/") or not isinstance(phase, dict):
            continue
        for path in ("autocast", "fsdp"):
            r = phase.get(path)
            if not isinstance(r, dict) or "replay_on" not in r:
                continue
            off, on = r["replay_off"], r["replay_on"]
            tag = "" if phase.get("logits_fp32", True) else "/bf16_logits"
            tag += "" if phase.get("fp32_residual", True) else "/bf16_residual"
            rows[f"{phase['init']}/{path}{tag}"] = {
                "logits_fp32": phase.get("logits_fp32", True),
                "fp32_residual": phase.get("fp32_residual", True),
                "kl_off": off["mismatch_kl_k3"],
                "kl_on": on["mismatch_kl_k3"],
                "kl_ratio_off_on": r["kl_ratio_off_on"],
                "agreement_off": off["routing_agreement_mean"],
                "agreement_on": on["routing_agreement_mean"],
                "ratio_out_off": off["mismatch_ratio_out_frac"],
                "ratio_out_on": on["mismatch_ratio_out_frac"],
                "flipped_token_frac": off["flipped_token_frac"],
                "kl_off_flipped_tokens": off["kl_k3_flipped_tokens"],
                "kl_off_unflipped_tokens": off["kl_k3_unflipped_tokens"],
                "goal_met": r["kl_goal_10x_met"],
            }
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON result file")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of the script)")
    ap.add_argument(
        "--shape",
        default=None,
        choices=["qwen3-30b-a3b", "mid", "smoke", "glm5", "nemotron3", "smoke-glm5", "smoke-nemotron"],
        help="model of the bf16 rows (default qwen3-30b-a3b; smoke with --smoke). glm5 / nemotron3: "
        "full width, reduced depth (glm5_reduced, nemotron3_reduced); smoke-glm5 / smoke-nemotron: "
        "configs/models/debug-glm5 / debug-nemotron",
    )
    ap.add_argument(
        "--layers", type=int, default=None, help="layers (default 4; glm5 3: one dense + MoE; smoke 2)"
    )
    ap.add_argument("--experts", type=int, default=GLM5_EXPERTS, help="glm5: routed experts per MoE layer")
    ap.add_argument("--pattern", default=NEMOTRON3_PATTERN, help="nemotron3: the layers (M, E, *)")
    ap.add_argument(
        "--inits",
        default=None,
        help="comma-separated: trainer, hf, peaked (default trainer,hf; glm5/nemotron shapes hf)",
    )
    ap.add_argument("--prompts", type=int, default=None, help="default 64 (smoke 6)")
    ap.add_argument("--new-tokens", type=int, default=None, help="per prompt; default 64 (smoke 12)")
    ap.add_argument("--prompt-min", type=int, default=None, help="default 32 (smoke 8)")
    ap.add_argument("--prompt-max", type=int, default=None, help="default 256 (smoke 24)")
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=0, help="trainer.logprob_chunk_tokens")
    ap.add_argument("--no-fsdp", dest="fsdp", action="store_false", help="skip the FSDP2 trainer path")
    ap.add_argument("--no-sanity", dest="sanity", action="store_false", help="skip the float32 row")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--publish-dtype",
        default="fp32",
        choices=["fp32", "engine"],
        help="the bf16 rows' published directory: fp32, or the engine's dtype (as trainer/train.py "
        "publishes; half the bytes to write and load, the same values loaded)",
    )
    ap.add_argument(
        "--logits",
        default="fp32",
        help="LM-head output precision on both sides, comma-separated: fp32 (default), bf16",
    )
    ap.add_argument(
        "--residual",
        default="fp32",
        help="residual stream on both sides (model.fp32_residual), comma-separated: fp32 (default), bf16",
    )
    args = ap.parse_args(argv)
    args.logits = [s.strip() for s in args.logits.split(",") if s.strip()]
    if not args.logits or any(x not in ("fp32", "bf16") for x in args.logits):
        ap.error("--logits: a comma-separated list of fp32, bf16")
    args.residual = [s.strip() for s in args.residual.split(",") if s.strip()]
    if not args.residual or any(x not in ("fp32", "bf16") for x in args.residual):
        ap.error("--residual: a comma-separated list of fp32, bf16")
    defaults: dict[str, Any] = (
        {"layers": 2, "prompts": 6, "new_tokens": 12, "prompt_min": 8, "prompt_max": 24}
        if args.smoke
        else {"layers": 4, "prompts": 64, "new_tokens": 64, "prompt_min": 32, "prompt_max": 256}
    )
    if args.shape is None:
        args.shape = "smoke" if args.smoke else "qwen3-30b-a3b"
    if args.shape == "glm5":
        # prompts longer than GLM-5's index_topk (2048): every sampled token's attention is sparse
        defaults.update(layers=3, prompts=32, prompt_min=2112, prompt_max=2560)
    if args.shape == "smoke-glm5":
        defaults.update(prompt_min=16, prompt_max=32)  # debug-glm5 keeps 16 keys
    defaults["inits"] = default_inits(args.shape)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.layers < 1 or args.prompts < 1 or args.new_tokens < 2 or args.prompt_min < 1:
        ap.error("--layers/--prompts/--prompt-min must be >= 1 and --new-tokens >= 2")
    if args.prompt_max < args.prompt_min:
        ap.error("--prompt-max must be >= --prompt-min")
    return args


def bench_device(kind: str) -> torch.device:
    """ "cuda" (the current card, made current) or "cpu". An indexed device: NCCL's
    init_process_group(device_id=...) wants one."""
    if kind != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    return device


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = bench_device(args.device)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else " ".join(argv),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": str(device),
        "torch": torch.__version__,
        "machine": machine(),
        "args": vars(args),
        "kl_goal": KL_GOAL,
    }

    def write() -> None:
        result["headline"] = headline(result)
        write_result(path, result, default=str)

    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="r3-") as tmp:
        phases: list[tuple[str, Any]] = [
            (
                f"bf16/{init}"
                + ("" if lg == "fp32" else "/bf16_logits")
                + ("" if res == "fp32" else "/bf16_residual"),
                lambda init=init, lg=lg, res=res: phase_bf16(
                    args, init, device, Path(tmp), lg == "fp32", res == "fp32"
                ),
            )
            for init in [s.strip() for s in args.inits.split(",") if s.strip()]
            for lg in args.logits
            for res in args.residual
        ]
        if args.sanity:
            phases.append(("fp32_sanity", lambda: phase_fp32_sanity(args, device, Path(tmp))))
        phases.append(("logits_check", lambda: phase_logits_check(args, device)))
        for name, fn in phases:
            t0 = time.perf_counter()
            result[name] = _try(fn)
            result[f"{name}_s"] = round(time.perf_counter() - t0, 1)
            free()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            write()
            print(name, json.dumps(result[name], default=str)[:3000], flush=True)
            # each model directory is several GB at full size: drop it once used
            for d in Path(tmp).iterdir():
                shutil.rmtree(d, ignore_errors=True)
    result["total_s"] = round(time.perf_counter() - t_all, 1)
    write()
    print("headline", json.dumps(result["headline"], indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
