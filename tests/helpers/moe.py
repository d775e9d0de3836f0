"""What the MoE / Router Replay test modules (test_router_replay.py, test_router_replay_deepseek.py,
test_mismatch.py) share: small random Qwen3-MoE and DeepSeek-V3 configs, random tokens and
recorded routes, a tap on the MoE routers, samples carrying routed experts, a CPU engine's
samples, the engine -> trainer replay check and one trainer step run in-process or under
torchrun. Weight inits stay in their modules: each draws its random weights in its own order,
which the tests' numbers depend on."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from helpers.trainer_process import run_trainer_steps
from services.common import routing as wire
from services.common.bus import Bus
from services.common.config import EngineConfig, ModelConfig, RunConfig
from services.common.schemas import (
    GenerateChoice,
    GenerateRequest,
    RolloutGroup,
    Sample,
    SamplingParams,
    TrainerStepMetrics,
)
from services.common.weights_dir import read_model_dir, step_dir
from trainer.batch import micro_batches
from trainer.loss import token_logprobs
from trainer.model import build_model, moe_layer_ids
from trainer.replay import RoutingRecord, micro_batch_routes, moe_routers, routing


def small_moe(**kw: object) -> ModelConfig:
    """A random small Qwen3-MoE: a leading dense layer, untied embeddings, 8 experts top-2."""
    base: dict[str, object] = dict(
        arch="qwen3_moe",
        vocab_size=50,
        dim=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        hidden_dim=48,
        max_seq_len=64,
        tie_embeddings=False,
        n_routed_experts=8,
        n_experts_per_tok=2,
        moe_hidden_dim=16,
        first_k_dense=1,
        norm_topk_prob=True,
    )
    return ModelConfig(**(base | kw))


def small_ds(**kw: object) -> ModelConfig:
    """A random small DeepSeek-V3: low-rank q, MLA, one leading dense layer, sigmoid scores with a
    correction bias, 4 groups of 2 experts (2 kept), top-2, one shared expert, scaling 2.5."""
    base: dict[str, object] = dict(
        arch="deepseek_v3",
        vocab_size=64,  # the char tokenizer (61) padded
        dim=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=4,
        head_dim=12,
        hidden_dim=48,
        max_seq_len=64,
        qk_norm=False,
        tie_embeddings=False,
        n_routed_experts=8,
        n_shared_experts=1,
        n_experts_per_tok=2,
        moe_hidden_dim=16,
        first_k_dense=1,
        routed_scaling_factor=2.5,
        router_score="sigmoid",
        norm_topk_prob=True,
        n_group=4,
        topk_group=2,
        expert_bias=True,
        q_lora_rank=16,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
    )
    return ModelConfig(**(base | kw))


def small_glm(**kw: object) -> ModelConfig:
    """A random small GLM-5: small_ds's MLA + MoE with one expert group (GLM-5's routing), HF's
    rms_norm_eps 1e-5 (the latent norms keep 1e-6), and a DSA indexer selecting each query's 6
    best keys out of up to 64 (8 indexer heads: a key ties at score 0 only if every head's relu
    is 0)."""
    base: dict[str, object] = dict(
        arch="glm_moe_dsa",
        n_group=1,
        topk_group=1,
        norm_eps=1e-5,
        index_topk=6,
        index_n_heads=8,
        index_head_dim=8,
    )
    return small_ds(**(base | kw))


def small_nemotron(**kw: object) -> ModelConfig:
    """A random small Nemotron-H: every mixer kind (Mamba-2 with 2 B/C groups, GQA attention,
    squared-ReLU MLP, and two MoE layers of 8 experts top-2 with a shared expert of its own width,
    sigmoid scores with a correction bias), a Mamba chunk of 8 tokens so scans span chunks."""
    base: dict[str, object] = dict(
        arch="nemotron_h",
        vocab_size=64,
        dim=32,
        n_layers=6,
        hybrid_pattern="M*EM-E",
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        hidden_dim=48,
        max_seq_len=64,
        qk_norm=False,
        tie_embeddings=False,
        norm_eps=1e-5,
        mamba_n_heads=4,
        mamba_head_dim=8,
        ssm_state_size=8,
        mamba_n_groups=2,
        mamba_chunk_size=8,
        n_routed_experts=8,
        n_experts_per_tok=2,
        moe_hidden_dim=16,
        n_shared_experts=1,
        shared_expert_hidden_dim=24,
        routed_scaling_factor=2.5,
        router_score="sigmoid",
        norm_topk_prob=True,
        expert_bias=True,
    )
    return ModelConfig(**(base | kw))


def tokens(m: ModelConfig, *, b: int, t: int, seed: int = 1) -> torch.Tensor:
    """Seeded random token ids [b, t] in the model's vocabulary. b and t have no defaults: the
    modules that share this use different ones."""
    return torch.randint(0, m.vocab_size, (b, t), generator=torch.Generator().manual_seed(seed))


def random_routes(m: ModelConfig, b: int, t: int, seed: int = 2) -> torch.Tensor:
    """Distinct random expert ids per (token, layer): [B, T, layers, k]. They ignore groups and
    correction biases: replay must not care."""
    g = torch.Generator().manual_seed(seed)
    n_layers = len(moe_layer_ids(m))
    scores = torch.rand(b, t, n_layers, m.n_routed_experts, generator=g)
    return scores.topk(m.n_experts_per_tok, dim=-1).indices


def own_choice(model: torch.nn.Module, layer: int, x: torch.Tensor, m: ModelConfig) -> torch.Tensor:
    """HF's sigmoid-routed selection (DeepSeek-style, one expert group) for one MoE layer's input: top-k of
    sigmoid(gate(x)) + the correction bias."""
    moe = model.layers[str(layer)].moe
    with torch.no_grad():
        choice = torch.sigmoid(moe.router.gate(x).float()) + moe.expert_bias
    return choice.topk(m.n_experts_per_tok, dim=-1).indices


class RouterCall(NamedTuple):
    """One forward of one MoE router: the router, its input and its (weights, ids, counts)."""

    router: torch.nn.Module
    x: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    counts: torch.Tensor


class RouterTap:
    """Captures each MoE router's input and output on every forward, in call order (one call per
    MoE layer per model forward)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: list[RouterCall] = []
        self.handles = [r.register_forward_hook(self._hook) for r in moe_routers(model)]

    def _hook(
        self, mod: torch.nn.Module, inp: tuple[torch.Tensor, ...], out: tuple[torch.Tensor, ...]
    ) -> None:
        self.calls.append(RouterCall(mod, inp[0].detach(), out[0].detach(), out[1].detach(), out[2].detach()))

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def routed_sample(rid: str, n: int, m: ModelConfig, rng: np.random.Generator) -> tuple[Sample, np.ndarray]:
    """A sample of n random tokens (2 prompt, n - 2 trained) with random distinct expert ids per
    (token, MoE layer) drawn from `rng`, the last token unrecorded as the engine leaves it (it is
    never forwarded). Returns the sample and its routing array [n, layers, k]."""
    layers = len(moe_layer_ids(m))
    dtype = wire.routing_dtype(m.n_routed_experts)
    ids = np.stack(
        [rng.permutation(m.n_routed_experts)[: m.n_experts_per_tok] for _ in range(n * layers)]
    ).reshape(n, layers, -1)
    arr = ids.astype(dtype)
    arr[-1] = wire.unrecorded(dtype)
    s = Sample(
        rollout_id=rid,
        tokens=rng.integers(0, m.vocab_size, n).tolist(),
        loss_mask=[0] * 2 + [1] * (n - 2),
        logprobs=[0.0] * n,
        versions=[0] * n,
        reward=0.0,
        routed_experts=wire.encode(arr),
    )
    return s, arr


class PackedReplay(NamedTuple):
    samples: list[Sample]
    seq_lens: list[int]  # the packed row's documents
    replayed: list[float]  # tokens replayed per MoE layer in the packed forward


def check_packed_replay_equals_padded(
    model: torch.nn.Module, m: ModelConfig, lengths: list[int], rtol: float, atol: float
) -> PackedReplay:
    """Random routed samples of `lengths` (one generator, seed 0): the trainer's packed micro-batch
    (document attention: `model` has it enabled; positions restarting per sample) replays each
    sample's recorded routes to the log-probs a padded batch gives it, within rtol/atol."""
    from trainer.attention import micro_batch_attention, packed_logprobs
    from trainer.packing import packed_micro_batches

    rng = np.random.default_rng(0)
    # One generator for all, drawn in order (each sample's ids, then its tokens).
    samples = [routed_sample(f"s{i}", n, m, rng)[0] for i, n in enumerate(lengths)]
    (mb,) = micro_batches(samples, 10_000)
    (routes,) = micro_batch_routes(samples, m, False, 10_000)
    with torch.no_grad(), routing(model, routes, replay=True):
        logp, _ = token_logprobs(model, mb.tokens)
    padded = {}
    for row in range(mb.tokens.shape[0]):
        n = int(mb.loss_mask[row].sum()) + 2
        padded[tuple(mb.tokens[row, :n].tolist())] = logp[row, 1 : n - 1]
    (pmb,) = packed_micro_batches(samples, 10_000)
    (proutes,) = micro_batch_routes(samples, m, True, 10_000)
    assert len(pmb.seq_lens) == len(lengths)
    with torch.no_grad(), routing(model, proutes, replay=True) as rec, micro_batch_attention(model, pmb):
        plogp, _ = packed_logprobs(model, pmb)
    packed = {}
    start = 0
    for seg in pmb.seq_lens:
        toks = pmb.inputs[0, start : start + seg].tolist() + [int(pmb.targets[0, start + seg - 1])]
        packed[tuple(toks)] = plogp[0, start + 1 : start + seg]
        start += seg
    assert set(packed) == set(padded)
    for k, v in padded.items():
        torch.testing.assert_close(packed[k], v, rtol=rtol, atol=atol)
    return PackedReplay(samples, list(pmb.seq_lens), rec.replayed.tolist())


def choice_sample(
    rid: str, prompt: list[int], c: GenerateChoice, reward: float = 0.0, advantage: float = 0.0
) -> Sample:
    """The sample of one engine choice: the prompt untrained, the output trained with the engine's
    log-probs, versions and routed experts."""
    return Sample(
        rollout_id=rid,
        tokens=prompt + c.output_ids,
        loss_mask=[0] * len(prompt) + [1] * len(c.output_ids),
        logprobs=[0.0] * len(prompt) + c.logprobs,
        versions=[-1] * len(prompt) + c.versions,
        reward=reward,
        advantage=advantage,
        routed_experts=c.routed_experts,
    )


def engine_samples(d: Path, m: ModelConfig, quantization: str = "none") -> list[Sample]:
    """The CPU engine's samples from the weights directory `d`: two prompts + 12 sampled tokens
    each (contexts past a small model's DSA top-k and over several Mamba-2 chunks, on prefill and
    decode), with their routed experts."""
    from services.engine import LLMEngine  # the engine is heavy: only the tests that use it

    cfg = EngineConfig(
        device="cpu", max_batch_size=8, max_seq_len=m.max_seq_len, block_size=4, quantization=quantization
    )
    eng = LLMEngine(d, cfg)
    prompts = [[5, 9, 14, 20, 3, 7, 11, 2, 30], [30, 31, 2, 8, 11, 12, 40, 41, 13, 50, 6]]
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=4)
    reqs = [GenerateRequest(input_ids=p, sampling=params, return_routed_experts=True) for p in prompts]
    return [
        choice_sample(f"s{i}", p, r.choices[0])
        for i, (p, r) in enumerate(zip(prompts, eng.generate(reqs), strict=True))
    ]


def replay_engine_samples(
    model: torch.nn.Module, m: ModelConfig, model_dir: Path, max_seq_len: int
) -> tuple[RoutingRecord, list[Sample]]:
    """The CPU engine loads `model_dir` (the weights of `model`) and samples two prompts with
    routing capture; the trainer's `model` scores the samples in one padded micro-batch replaying
    the recorded ids and must reproduce the engine's log-probs. Returns the replay's record and
    the samples, for the caller's checks of the counts."""
    from services.engine import LLMEngine  # the engine is heavy: only the tests that use it

    eng = LLMEngine(
        model_dir, EngineConfig(device="cpu", max_batch_size=8, max_seq_len=max_seq_len, block_size=4)
    )
    prompts = [[5, 9, 14, 20, 3, 7], [30, 31, 2, 8, 11, 12, 40, 41, 13]]
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=4)
    reqs = [GenerateRequest(input_ids=p, sampling=params, return_routed_experts=True) for p in prompts]
    samples = []
    for i, (p, resp) in enumerate(zip(prompts, eng.generate(reqs), strict=True)):
        c = resp.choices[0]
        assert c.routed_experts is not None and c.routed_experts.shape[0] == len(p) + len(c.output_ids)
        samples.append(choice_sample(f"s{i}", p, c))
    (mb,) = micro_batches(samples, 10_000)  # one micro-batch (longest sample first)
    (routes,) = micro_batch_routes(samples, m, False, 10_000)
    assert routes is not None
    with torch.no_grad(), routing(model, routes, replay=True) as rec:
        logp, _ = token_logprobs(model, mb.tokens)
    mask = mb.loss_mask > 0
    torch.testing.assert_close(logp[mask], mb.logp_infer[mask], rtol=0, atol=2e-5)
    return rec, samples


def run_one_step(
    cfg: RunConfig, run_dir: Path, redis_url: str, groups: list[RolloutGroup], timeout_s: float
) -> tuple[TrainerStepMetrics, dict[str, torch.Tensor]]:
    """One trainer step on `groups` for `cfg` (run.max_steps 1, its step_0 weights in run_dir),
    run by `run_trainer_steps` (under torchrun for nproc > 1, waited for at most timeout_s).
    Returns the step's metrics and the published step_1 tensors."""
    bus = Bus(redis_url, cfg.redis.prefix)
    for g in groups:
        bus.push_group(g)
    run_trainer_steps(cfg, run_dir, redis_url, timeout_s)
    ((_, mt),) = bus.read_metrics()
    return mt, read_model_dir(step_dir(run_dir, 1))[1]


def nemotron_model(m: ModelConfig, seed: int = 0) -> torch.nn.Module:
    """Random weights where every part matters: weights and norms perturbed, dt_bias and D moved,
    decisive routing (gate std 1) and a correction bias that changes the selection."""
    model = build_model(m, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 or "norm" in name or name.endswith(("dt_bias", ".D")):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
        for r in moe_routers(model):
            r.gate.weight.copy_(torch.randn(r.gate.weight.shape, generator=g))
        for block in model.layers.values():
            if block.moe_enabled:
                block.moe.expert_bias.copy_(0.5 * torch.rand(m.n_routed_experts, generator=g))
    return model
