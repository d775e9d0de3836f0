"""The capacity plan: memory per GPU, predicted step time and the node split that balances it.

`make plan MODEL=<config> [NODES=<n>]` reads the model and cluster from a run config, the workload
assumptions from its `[plan]` table and the rates measured in `bench/` (`configs/plan/rates.toml`,
each rate with the result file it was read from), and prints what one RL step costs.

The step model (asynchronous, `max_off_policy_steps >= 1`): the rollout side (decode, prefill,
weight apply on inference) and the trainer side (train + the part of publishing that blocks
training) run concurrently, so a step takes the longer of the two and the other side waits. The
synchronous baseline (`max_off_policy_steps = 0`) adds them, and waits for the longest rollout.

GPU rates are scaled from the measured shape to the planned one by a stated rule: decode reads
the bytes a step touches (weights the batch routes to, plus KV) at the measured fraction of HBM
bandwidth; prefill and training run the model's FLOPs at the measured fraction of the dense bf16
peak (MFU). On CPU (the debug config) nothing is bandwidth- or FLOP-bound; there the rates are the
debug model's own measured step costs.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from sbatch.all_to_all import ELEM_BYTES, Fabric, moe_all_to_all_s, spans_nodes, trainer_exchanges
from services.common.config import ConfigError, ModelConfig, ParallelConfig, RunConfig, load_config

REPO = Path(__file__).resolve().parent.parent
RATES_FILE = REPO / "configs" / "plan" / "rates.toml"
# Share of HBM a plan may fill: the rest is the allocator's slack, CUDA graphs, NCCL buffers.
HBM_USABLE = 0.9


@dataclass(frozen=True)
class Device:
    name: str
    hbm_bytes: float
    bf16_flops: float  # dense peak, per GPU
    hbm_bytes_per_s: float = 0.0  # the device copy bandwidth measured on it (Rates)
    nvlink_bytes_per_s: float = 450e9  # NVLink 4, one direction (900 GB/s both ways)


# Datasheet numbers (SXM parts): memory size, the bf16 peak MFU is read against, NVLink. The memory
# bandwidth is the copy bandwidth measured on each card (Rates).
DEVICES = {
    "h100": Device("H100 SXM", 80e9, 989e12),
    "h200": Device("H200 SXM", 141e9, 989e12),
}


class Rate(BaseModel):
    """One measured rate and where it came from."""

    value: float = 0.0  # read from `file` by load_rates
    unit: str
    machine: str
    file: str  # a result file under bench/, relative to the repository root
    key: str  # dotted path of the value inside that JSON file
    per: str = ""  # dotted path of a divisor in the same file (value = scale * key / per)
    scale: float = 1.0
    note: str = ""

    def from_file(self, root: Path = REPO) -> float:
        """The value as the result file gives it, so a rate can't drift from its source."""
        import json

        data = json.loads((root / self.file).read_text())

        def get(path: str) -> float:
            node = data
            for part in path.split("."):
                node = node[int(part)] if isinstance(node, list) else node[part]
            return float(node)

        v = get(self.key) * self.scale
        return v / get(self.per) if self.per else v

    def cite(self) -> str:
        return f"{self.value:g} {self.unit} ({self.machine}; {self.file})"


class Rates(BaseModel):
    """The rates the planner uses, each read from a result file in `bench/` (configs/plan/rates.toml)."""

    copy_bytes_per_s_h100: Rate  # device copy bandwidth, the decode roofline's
    copy_bytes_per_s_h200: Rate
    decode_hbm_fraction: Rate  # decode tokens/s against the bytes-read roofline at that bandwidth
    prefill_mfu: Rate  # prompt tokens' FLOPs against the bf16 peak
    train_mfu_dense: Rate
    train_mfu_moe: Rate
    publish_bytes_per_s: Rate  # per trainer rank: device -> host copy that blocks training
    # Per inference rank: weights read and applied. None until measured: the plan then says so
    # and counts no apply time.
    apply_bytes_per_s: Rate | None = None
    # Per GPU: bytes leaving it per second in an all-to-all among the GPUs of one node (the
    # all-to-all bus bandwidth). None until measured: the plan then takes the NVLink datasheet's
    # rate and says so (docs/capacity.md names the entry to add).
    all_to_all_bytes_per_s: Rate | None = None
    cpu_decode_step_s: Rate  # the debug model: one engine step at the debug batch, CPU
    cpu_train_s_per_token: Rate  # the debug model: trainer seconds per trained token, CPU
    # CPU-seconds per rollout the orchestrator and the sandbox spend in a debug run (CPU plan:
    # every process shares the machine's cores).
    cpu_orchestrator_s_per_rollout: Rate
    cpu_sandbox_s_per_rollout: Rate


def load_rates(path: Path = RATES_FILE, root: Path = REPO) -> Rates:
    """The rates of `path`, each value read from its result file (a missing file or key is an
    error naming the rate)."""
    with path.open("rb") as f:
        table = tomllib.load(f)
    for name, entry in table.items():
        rate = Rate.model_validate(entry)
        try:
            entry["value"] = rate.from_file(root)
        except (OSError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"rate {name}: cannot read {rate.key} from {rate.file}: {e!r}") from None
    return Rates.model_validate(table)


class Memory(BaseModel):
    trainer_state_gb: float  # fp32 params, grads and Adam moments, per trainer GPU
    trainer_activations_gb: float
    trainer_total_gb: float
    trainer_fits: bool
    inference_weights_gb: float  # per inference GPU
    inference_kv_gb: float  # per inference GPU, at the planned concurrency and mean context
    inference_state_gb: float  # per inference GPU: the Mamba-2 state slots (0 without Mamba layers)
    inference_total_gb: float
    inference_fits: bool
    kv_tokens_capacity: int  # tokens of KV one decode engine holds after its weights and state slots
    device_gb: float


class StepTimes(BaseModel):
    rollout_s: float  # decode (+ prefill when colocated) for one step's rollouts
    decode_s: float
    prefill_s: float
    train_s: float
    publish_blocked_s: float
    apply_s: float
    tail_s: float  # the longest rollout's own decode time
    step_async_s: float
    step_sync_s: float
    trainer_wait_s: float
    inference_wait_s: float
    bound_by: Literal["decode", "prefill", "train", "apply", "cpu"]
    # Expert-parallel all-to-all of the step (sbatch/all_to_all.py), counted inside decode_s,
    # prefill_s and train_s.
    all_to_all_decode_s: float = 0.0
    all_to_all_prefill_s: float = 0.0
    all_to_all_train_s: float = 0.0


class WeightsTraffic(BaseModel):
    """What one step's weights cost the shared filesystem: the trainer ranks write a version
    (each its share, in parallel), then every inference engine reads it (each GPU its slice)."""

    version_gb: float  # one published version, in what the engines serve
    trainer_rank_gb: float  # written by each trainer GPU
    inference_rank_gb: float  # read by each inference GPU
    engines: int  # decode and prefill engines: each reads a whole version
    write_gb: float  # to the filesystem per step
    read_gb: float  # from it per step
    budget_s: float  # the share of the step publish + apply may take
    fs_gb_per_s: float  # the aggregate bandwidth that fits write, then read, in budget_s
    trainer_node_gb_per_s: float  # one trainer node's writes at that bandwidth
    inference_node_gb_per_s: float  # one inference node's reads at that bandwidth


class Split(BaseModel):
    trainer_nodes: int
    decode_nodes: int
    prefill_nodes: int


class Plan(BaseModel):
    model: str
    device: str
    split: Split
    rollouts_per_step: int
    tokens_per_step: float
    generated_per_step: float
    memory: Memory
    times: StepTimes
    weights: WeightsTraffic | None = None
    balanced: Split | None = None
    balanced_times: StepTimes | None = None
    off_policy_steps: int = 1
    searched: bool = False  # whether a balanced split was looked for
    rates_used: dict[str, str] = Field(default_factory=dict)
    assumptions: dict[str, str] = Field(default_factory=dict)


# ---------------------------------------------------------------------- model arithmetic


def attention_layers(m: ModelConfig) -> int:
    """Layers with attention (a hybrid stack's `*` layers; every layer otherwise)."""
    return m.hybrid_pattern.count("*") if m.is_hybrid else m.n_layers


def kv_bytes_per_token(m: ModelConfig) -> float:
    """KV bytes one token keeps in every attention layer: MLA's latent + rope key (bf16) and DSA's
    fp8 indexer key, or K and V per KV head (bf16)."""
    if m.is_mla:
        b = (m.kv_lora_rank + m.qk_rope_head_dim) * 2 * m.n_layers
        return b + (m.index_head_dim * m.n_layers if m.index_topk else 0)
    return 2 * m.n_kv_heads * m.head_dim * 2 * attention_layers(m)


def recurrent_state_bytes(m: ModelConfig) -> float:
    """Bytes one sequence keeps whatever its length: each Mamba-2 layer's float32 SSM state
    (heads x head_dim x state) and its convolution's last inputs (bf16); 0 without Mamba layers."""
    if not m.is_hybrid:
        return 0.0
    ssm = m.mamba_n_heads * m.mamba_head_dim * m.ssm_state_size * 4
    conv = (
        (m.mamba_n_heads * m.mamba_head_dim + 2 * m.mamba_n_groups * m.ssm_state_size)
        * (m.mamba_conv_kernel - 1)
        * 2
    )
    return float((ssm + conv) * m.hybrid_pattern.count("M"))


def kv_bytes_read_per_token(m: ModelConfig, context: float) -> float:
    """KV bytes one decoded token reads at a given context: every cached token, or with DSA the
    indexer keys of every token and the latents of its top-k."""
    if m.is_mla and m.index_topk:
        attended = min(context, m.index_topk) * (m.kv_lora_rank + m.qk_rope_head_dim) * 2
        return (attended + context * m.index_head_dim) * m.n_layers
    return context * kv_bytes_per_token(m)


def attention_flops_per_token(m: ModelConfig, context: float) -> float:
    """Score and value FLOPs of one token against `context` keys (causal: about half on
    average for a prompt, so callers pass the mean attended length)."""
    keys = min(context, m.index_topk) if m.index_topk else context
    if m.is_mla:
        per_key = m.n_heads * ((m.qk_nope_head_dim + m.qk_rope_head_dim) + m.v_head_dim)
    else:
        per_key = m.n_heads * 2 * m.head_dim
    return 2 * keys * per_key * attention_layers(m)


def experts_touched(m: ModelConfig, tokens: float) -> float:
    """Expected routed experts one MoE layer reads for `tokens` independently routed tokens."""
    if not m.is_moe:
        return 0.0
    k, e = m.n_experts_per_tok, m.n_routed_experts
    return e * (1 - (1 - k / e) ** tokens)


def expert_params(m: ModelConfig) -> int:
    """Parameters of one routed expert (SwiGLU gate/up/down; nemotron_h's squared-ReLU up/down)."""
    return (2 if m.is_hybrid else 3) * m.dim * m.moe_hidden_dim


def routed_expert_params(m: ModelConfig) -> int:
    """Parameters of every routed expert of every MoE layer (0 for a dense model)."""
    return len(m.moe_layers()) * m.n_routed_experts * expert_params(m) if m.is_moe else 0


def _step_weights(m: ModelConfig, batch: float) -> tuple[float, float]:
    """(weights other than routed experts, routed expert weights) one decode step of `batch`
    independently routed sequences reads, in parameters. Every weight but the input embedding (a
    gather; tied, it is the LM head and read) is read once a step, routed experts only where the
    batch's tokens go."""
    p = m.param_counts()
    weights = p["total"] - (0 if m.tie_embeddings else m.vocab_size * m.dim)
    routed = routed_expert_params(m)
    touched = len(m.moe_layers()) * experts_touched(m, batch) * expert_params(m) if m.is_moe else 0.0
    return weights - routed, touched


def decode_step_bytes(m: ModelConfig, batch: float, context: float, weight_bytes: float) -> float:
    """Bytes one decode step of `batch` sequences reads: the weights its tokens touch and their KV."""
    rest, routed = _step_weights(m, batch)
    return (rest + routed) * weight_bytes + batch * kv_bytes_read_per_token(m, context)


# ---------------------------------------------------------------------- one engine over many GPUs


def kv_share_per_rank(m: ModelConfig, tp: int) -> float:
    """The share of a token's KV one rank of a tp group keeps: its KV heads (one, replicated, when
    there are fewer KV heads than ranks); all of MLA's latent, which every head reads."""
    if m.is_mla:
        return 1.0
    return max(1, m.n_kv_heads // tp) / m.n_kv_heads


def engine_params_per_rank(m: ModelConfig, par: ParallelConfig) -> float:
    """Parameters one rank of an engine holds: everything but the routed experts split over tp
    (replicated over dp_attention groups), the routed experts split over ep (over tp when ep = 1).
    Norms, routers and MLA's down-projections, which tensor parallelism replicates, are counted as
    split: under tp = 1 (data-parallel attention) that is exact."""
    routed = routed_expert_params(m)
    rest = m.param_counts()["total"] - routed
    return rest / par.tp + routed / (par.ep if par.ep > 1 else par.tp)


def decode_step_bytes_per_rank(
    m: ModelConfig, par: ParallelConfig, batch: float, context: float, weight_bytes: float
) -> float:
    """Bytes one rank reads in a decode step of `batch` sequences over the whole engine: its share
    of the weights the batch touches, and the KV of its attention group's sequences."""
    rest, routed = _step_weights(m, batch)
    weights = rest / par.tp + routed / (par.ep if par.ep > 1 else par.tp)
    kv = batch / par.dp_attention * kv_bytes_read_per_token(m, context) * kv_share_per_rank(m, par.tp)
    return weights * weight_bytes + kv


class EngineLayout(BaseModel):
    """One decode or prefill engine over its GPUs, and the memory per GPU it implies."""

    role: str
    engines: int
    par: ParallelConfig
    nodes_per_engine: float  # < 1: several engines share a node
    heads_per_rank: int
    kv_heads_per_rank: int  # MLA: every rank keeps the whole latent
    experts_per_rank: int
    vocab_per_rank: int
    sequences_per_group: float  # of the engine's max_batch_size, per attention group
    weights_gb: float  # per GPU
    kv_gb: float  # per GPU, at the planned concurrency and mean context
    # Per GPU: the engine's Mamba-2 state slots, one per sequence of max_batch_size (the engine
    # allocates them whole, out of the KV budget: services/engine/kv_cache.pool_blocks).
    state_gb: float
    kv_room_tokens: int  # per attention group: tokens of KV its GPUs hold after weights and state slots
    device_gb: float

    @property
    def fits(self) -> bool:
        return (self.weights_gb + self.kv_gb + self.state_gb) * 1e9 <= self.device_gb * 1e9 * HBM_USABLE


def engine_layout(cfg: RunConfig, role: Literal["decode", "prefill"], dev: Device) -> EngineLayout:
    m = cfg.model
    par = cfg.decode.parallel if role == "decode" else cfg.prefill_parallel
    engine = cfg.decode.engine if role == "decode" else (cfg.prefill.engine or cfg.decode.engine)
    comp = getattr(cfg.slurm, role)
    engines = cfg.decode.replicas if role == "decode" else max(1, comp.nodes)
    wbytes = 1.0 if engine.quantization == "fp8" else 2.0
    weights = engine_params_per_rank(m, par) * wbytes
    per_group = engine.max_batch_size / par.dp_attention
    ctx = cfg.plan.rollout_tokens / 2  # a rollout's mean context over its lifetime
    token_kv = kv_bytes_per_token(m) * kv_share_per_rank(m, par.tp)
    kv = per_group * ctx * token_kv
    # The engine's slots and its padding slot (services/engine/state_cache.py), a rank holding its
    # tp share of the Mamba-2 heads' states; 0 without Mamba-2.
    states = (per_group + 1) * recurrent_state_bytes(m) / par.tp
    room = max(0.0, dev.hbm_bytes * HBM_USABLE - weights - states) / token_kv
    return EngineLayout(
        role=role,
        engines=engines,
        par=par,
        nodes_per_engine=comp.nodes / engines if engines else 0.0,
        heads_per_rank=m.n_heads // par.tp,
        kv_heads_per_rank=m.n_kv_heads if m.is_mla else max(1, m.n_kv_heads // par.tp),
        experts_per_rank=m.n_routed_experts // par.ep,
        vocab_per_rank=m.vocab_size // par.tp,
        sequences_per_group=per_group,
        weights_gb=weights / 1e9,
        kv_gb=kv / 1e9,
        state_gb=states / 1e9,
        kv_room_tokens=int(room),
        device_gb=dev.hbm_bytes / 1e9,
    )


def render_layout(m: EngineLayout, gpus_per_node: int) -> list[str]:
    """The layout as the dry run prints it (sbatch/slurm.py describe)."""
    p = m.par
    per_node = round(1 / m.nodes_per_engine) if m.nodes_per_engine else 0
    if m.nodes_per_engine > 1:  # an engine over several nodes (sbatch/slurm.py: engine_ranks)
        span = round(m.nodes_per_engine)
        where = (
            f"each over {span} nodes, {p.ranks // span} rank(s) per node"
            + (" on its GPUs" if gpus_per_node else " as processes")
            + " (rank 0 on the first; a rendezvous in Redis)"
        )
    elif gpus_per_node:
        where = f"{per_node} engine(s) per node, ranks 0-{p.ranks - 1} of each on its own GPUs"
    else:
        where = f"ranks 0-{p.ranks - 1} as local processes"
    return [
        f"  {m.role}: {m.engines} engine(s) x {p.ranks} rank(s) (tp {p.tp}, dp_attention {p.dp_attention},"
        f" ep {p.ep}); {where}",
        f"    per rank: {m.heads_per_rank} attention heads, {m.kv_heads_per_rank} KV heads"
        + (f", {m.experts_per_rank} routed experts" if m.experts_per_rank else "")
        + f", {m.vocab_per_rank:,} vocabulary rows; attention group of {p.tp} rank(s) serves"
        f" {m.sequences_per_group:g} sequences",
        f"    per GPU: weights {m.weights_gb:.1f} GB + KV {m.kv_gb:.1f} GB"
        + (f" + Mamba-2 states {m.state_gb:.1f} GB" if m.state_gb else "")
        + f" of {m.device_gb:.0f}:"
        f" {'fits' if m.fits else 'DOES NOT FIT'}; KV room {m.kv_room_tokens:,} tokens per attention group",
    ]


# ---------------------------------------------------------------------- the plan


def _mfu(cfg: RunConfig, rates: Rates) -> Rate:
    return rates.train_mfu_moe if cfg.model.is_moe else rates.train_mfu_dense


def gpu_counts(cfg: RunConfig, split: Split) -> tuple[int, int, int]:
    """GPUs of the trainer, decode and prefill: the split's nodes under Slurm; the processes the
    local launcher starts (trainer.nproc, replicas x engine ranks), one GPU each, otherwise."""
    if cfg.slurm.launcher == "slurm":
        s = cfg.slurm
        return (
            split.trainer_nodes * s.trainer.gpus_per_node,
            split.decode_nodes * s.decode.gpus_per_node,
            split.prefill_nodes * s.prefill.gpus_per_node,
        )
    pre_par = cfg.prefill.parallel or cfg.decode.parallel
    pre = cfg.prefill.replicas * pre_par.ranks
    return cfg.trainer.nproc, cfg.decode.replicas * cfg.decode.parallel.ranks, pre


def memory(cfg: RunConfig, split: Split, dev: Device) -> Memory:
    m = cfg.model
    p = m.param_counts()
    tgpus = max(1, gpu_counts(cfg, split)[0])
    state = p["total"] * 16 / tgpus
    # Saved layer inputs under per-layer activation checkpointing (bf16), one micro-batch per
    # GPU, context parallel splitting its tokens; plus one layer's recompute (about 34 x dim bytes
    # a token) and a chunked LM head.
    tokens = cfg.trainer.micro_batch_tokens / cfg.trainer.cp
    act = tokens * m.dim * 2 * m.n_layers + tokens * m.dim * 34
    lay = engine_layout(cfg, "decode", dev)
    weights, kv, states = lay.weights_gb * 1e9, lay.kv_gb * 1e9, lay.state_gb * 1e9
    usable = dev.hbm_bytes * HBM_USABLE
    kv_cap = lay.kv_room_tokens * cfg.decode.parallel.dp_attention
    return Memory(
        trainer_state_gb=state / 1e9,
        trainer_activations_gb=act / 1e9,
        trainer_total_gb=(state + act) / 1e9,
        trainer_fits=state + act <= usable,
        inference_weights_gb=weights / 1e9,
        inference_kv_gb=kv / 1e9,
        inference_state_gb=states / 1e9,
        inference_total_gb=(weights + kv + states) / 1e9,
        inference_fits=weights + kv + states <= usable,
        kv_tokens_capacity=int(kv_cap),
        device_gb=dev.hbm_bytes / 1e9,
    )


def _weight_bytes(cfg: RunConfig) -> float:
    return 1.0 if cfg.decode.engine.quantization == "fp8" else 2.0


def version_bytes(m: ModelConfig, quantization: str) -> float:
    """Bytes of one published weights version in what the engines serve: bf16, 2 bytes a
    parameter; FP8 (ops/fp8/checkpoint.is_fp8_weight), 1 byte for every attention,
    MLP and expert weight plus a float32 scale per 128x128 tile, 2 bytes for what an FP8 engine
    keeps in bf16 (embedding, LM head, MoE routers, MLA's kv_b_proj, norms)."""
    total = m.param_counts()["total"]
    if quantization != "fp8":
        return 2.0 * total
    high = m.vocab_size * m.dim * (1 if m.tie_embeddings else 2) + m.dim * (2 * m.n_layers + 1)
    if m.is_moe:
        high += (m.n_layers - m.first_k_dense) * m.n_routed_experts * m.dim
    if m.is_mla:
        high += m.n_layers * m.kv_lora_rank * m.n_heads * (m.qk_nope_head_dim + m.v_head_dim)
    low = total - high
    return low * (1 + 4 / 128**2) + 2 * high


def rank_version_bytes(cfg: RunConfig, par: ParallelConfig) -> float:
    """Bytes of a version one engine rank reads: its parameters (engine_params_per_rank) at the
    version's mean bytes a parameter."""
    m = cfg.model
    per_param = version_bytes(m, cfg.decode.engine.quantization) / m.param_counts()["total"]
    return engine_params_per_rank(m, par) * per_param


def weights_traffic(cfg: RunConfig, split: Split, share: float = 0.1) -> WeightsTraffic:
    """One step's weights through the shared filesystem: written once (every trainer GPU its
    share), read once per inference engine (every rank of it its slice; what ranks of a node read
    twice comes from its page cache), one after the other; the aggregate bandwidth that keeps both
    inside `share` of plan.step_target_s (300 s if unset)."""
    v = version_bytes(cfg.model, cfg.decode.engine.quantization)
    tgpus, dgpus, pgpus = gpu_counts(cfg, split)
    dec, pre = cfg.decode.parallel, cfg.prefill_parallel
    engines = dgpus // dec.ranks + pgpus // pre.ranks
    tgpus = max(1, tgpus)
    budget = share * (cfg.plan.step_target_s or 300.0)
    write, read = v, v * engines
    bw = (write + read) / budget
    t_write, t_read = write / bw, read / bw
    return WeightsTraffic(
        version_gb=v / 1e9,
        trainer_rank_gb=v / tgpus / 1e9,
        inference_rank_gb=rank_version_bytes(cfg, dec) / 1e9,
        engines=engines,
        write_gb=write / 1e9,
        read_gb=read / 1e9,
        budget_s=budget,
        fs_gb_per_s=bw / 1e9,
        trainer_node_gb_per_s=v / max(1, split.trainer_nodes) / t_write / 1e9,  # Slurm nodes
        # the engines read at once, each a version (a node's ranks share its page cache)
        inference_node_gb_per_s=v / t_read / 1e9 if engines else 0.0,
    )


def fabric(cfg: RunConfig, dev: Device, rates: Rates) -> Fabric:
    """The all-to-all rates: within a node the measured one, else the NVLink datasheet's; across
    nodes the cluster's stated network bandwidth per GPU (plan.nic_gb_per_s)."""
    a2a = rates.all_to_all_bytes_per_s
    return Fabric(a2a.value if a2a else dev.nvlink_bytes_per_s, cfg.plan.nic_gb_per_s * 1e9)


def gpus_per_node(cfg: RunConfig, role: Literal["trainer", "decode", "prefill"], ranks: int) -> int:
    """GPUs of a node of `role` under Slurm; the local launcher's processes share one machine."""
    if cfg.slurm.launcher == "slurm":
        return max(1, getattr(cfg.slurm, role).gpus_per_node)
    return ranks


def step_times_gpu(cfg: RunConfig, split: Split, dev: Device, rates: Rates) -> StepTimes:
    m, w = cfg.model, cfg.plan
    p = m.param_counts()
    rollouts = cfg.orchestrator.batch_size * cfg.orchestrator.group_size
    generated = rollouts * w.generated_tokens
    new_prompt = rollouts * (w.rollout_tokens - w.generated_tokens) * w.prefill_miss
    par = cfg.decode.parallel
    tgpus, dgpus, pre_gpus = gpu_counts(cfg, split)
    if tgpus < 1 or dgpus < 1:
        raise ValueError("the plan needs at least one trainer and one decode GPU")
    engines = max(1, dgpus // par.ranks)
    batch = cfg.decode.engine.max_batch_size
    ctx = w.rollout_tokens / 2
    net = fabric(cfg, dev, rates)
    # The ranks of an engine step together: a step takes as long as one rank's reads, then its
    # share of the batch's rows through every MoE layer's dispatch and combine.
    step_bytes = decode_step_bytes_per_rank(m, par, batch, ctx, _weight_bytes(cfg))
    a2a_step = moe_all_to_all_s(
        m,
        batch / par.ranks,
        par.ep,
        gpus_per_node(cfg, "decode", par.ranks),
        ELEM_BYTES[cfg.decode.engine.dtype],
        net,
    )
    t_step = step_bytes / (rates.decode_hbm_fraction.value * dev.hbm_bytes_per_s) + a2a_step
    steps = generated / (engines * batch)
    decode_s = steps * t_step
    tail_s = tail_generated(cfg) * t_step
    pre_flops = new_prompt * (2 * p["active"] + attention_flops_per_token(m, ctx / 2))
    colocated = pre_gpus == 0
    pre_par, pre_role, pre_engine = cfg.prefill_parallel, "prefill", cfg.prefill.engine or cfg.decode.engine
    if colocated:
        pre_gpus, pre_par, pre_role, pre_engine = dgpus, par, "decode", cfg.decode.engine
    # Each rank of a prefill engine dispatches its share of the engine's prompt tokens.
    a2a_prefill = moe_all_to_all_s(
        m,
        new_prompt / pre_gpus,
        pre_par.ep,
        gpus_per_node(cfg, pre_role, pre_par.ranks),  # type: ignore[arg-type]
        ELEM_BYTES[pre_engine.dtype],
        net,
    )
    prefill_s = pre_flops / (rates.prefill_mfu.value * dev.bf16_flops * pre_gpus) + a2a_prefill
    rollout_s = decode_s + prefill_s if colocated else max(decode_s, prefill_s)
    tokens = rollouts * w.rollout_tokens
    tc = cfg.trainer
    recompute = 4 / 3 if tc.activation_checkpoint != "none" else 1.0
    train_flops = tokens * (6 * p["active"] * recompute + 3 * attention_flops_per_token(m, ctx))
    a2a_train = moe_all_to_all_s(
        m,
        tokens / tgpus,
        tc.ep,
        gpus_per_node(cfg, "trainer", tgpus),
        ELEM_BYTES[tc.dtype],
        net,
        trainer_exchanges(tc.activation_checkpoint),
    )
    train_s = train_flops / (_mfu(cfg, rates).value * dev.bf16_flops * tgpus) + a2a_train
    version = version_bytes(m, cfg.decode.engine.quantization)
    publish_s = version / tgpus / rates.publish_bytes_per_s.value
    apply = rates.apply_bytes_per_s
    # Each rank reads and applies its own slice, all ranks at once.
    apply_s = rank_version_bytes(cfg, cfg.decode.parallel) / apply.value if apply else 0.0
    t = _combine(cfg, decode_s, prefill_s, rollout_s, train_s, publish_s, apply_s, tail_s)
    return t.model_copy(
        update={
            "all_to_all_decode_s": steps * a2a_step,
            "all_to_all_prefill_s": a2a_prefill,
            "all_to_all_train_s": a2a_train,
        }
    )


def all_to_all_notes(cfg: RunConfig, dev: Device, rates: Rates, used: dict[str, str]) -> dict[str, str]:
    """The all-to-all rates the plan used, into `used` when measured, as assumptions otherwise."""
    m = cfg.model
    if not m.is_moe:
        return {}
    tc, dec, pre = cfg.trainer, cfg.decode.parallel, cfg.prefill_parallel
    groups = {
        "decode": (dec.ep, gpus_per_node(cfg, "decode", dec.ranks)),
        "prefill": (pre.ep, gpus_per_node(cfg, "prefill", pre.ranks)),
        "trainer": (tc.ep, gpus_per_node(cfg, "trainer", tc.nproc)),
    }
    ep_sides = [k for k, (ep, _) in groups.items() if ep > 1]
    where = ", ".join(f"{k} ep {groups[k][0]}" for k in ep_sides) or "no side runs expert parallel"
    notes: dict[str, str] = {}
    a2a = rates.all_to_all_bytes_per_s
    if a2a:
        used["all_to_all_bytes_per_s"] = a2a.cite()
    else:
        used["all_to_all_bytes_per_s"] = (
            "NOT MEASURED: no all-to-all rate in bench/ (bench/engine/multi.py has not run on 2 GPUs; "
            "bench/trainer/results/multi_h200x2_ep.json times whole EP steps only); the intra-node "
            "rate is an assumption below"
        )
        notes["all_to_all_intra_node"] = (
            f"{dev.nvlink_bytes_per_s / 1e9:g} GB/s leaving each GPU to GPUs of its node "
            f"({dev.name} datasheet: NVLink 4, 900 GB/s both ways; NCCL reaches less) ({where})"
        )
    across = [k for k in ep_sides if spans_nodes(*groups[k])]
    notes["all_to_all_inter_node"] = (
        f"{cfg.plan.nic_gb_per_s:g} GB/s leaving each GPU to other nodes (plan.nic_gb_per_s, the "
        "cluster's stated network bandwidth per GPU; not measured: no multi-node machine); "
        + (f"used by {', '.join(across)}" if across else "unused: every EP group is inside one node")
    )
    notes["all_to_all_not_counted"] = (
        "per-collective latency (an engine MoE layer issues 4: counts, rows, expert ids, outputs)"
        + (
            "; train_mfu_moe's measured step holds its own EP-2 all-to-all, counted again here"
            if tc.ep > 1
            else ""
        )
    )
    return notes


def _combine(
    cfg: RunConfig,
    decode_s: float,
    prefill_s: float,
    rollout_s: float,
    train_s: float,
    publish_s: float,
    apply_s: float,
    tail_s: float,
) -> StepTimes:
    infer = rollout_s + apply_s
    trainer = train_s + publish_s
    step_async = max(infer, trainer)
    step_sync = max(rollout_s, tail_s) + apply_s + trainer
    sides = {"decode": decode_s, "prefill": prefill_s, "apply": apply_s}
    bound = "train" if trainer >= infer else max(sides, key=lambda k: sides[k])
    return StepTimes(
        rollout_s=rollout_s,
        decode_s=decode_s,
        prefill_s=prefill_s,
        train_s=train_s,
        publish_blocked_s=publish_s,
        apply_s=apply_s,
        tail_s=tail_s,
        step_async_s=step_async,
        step_sync_s=step_sync,
        trainer_wait_s=step_async - trainer,
        inference_wait_s=step_async - infer,
        bound_by=bound,  # type: ignore[arg-type]
    )


def tail_generated(cfg: RunConfig) -> float:
    """Tokens the longest rollout generates: tail_factor x the mean, but no more than its share of
    a context-length rollout."""
    w = cfg.plan
    cap = cfg.model.max_seq_len * w.generated_tokens / w.rollout_tokens
    return min(w.generated_tokens * w.tail_factor, cap)


def step_times_cpu(cfg: RunConfig, rates: Rates, cores: int | None = None) -> StepTimes:
    """The debug config on CPU: the measured step costs of the debug model. A step's rollouts
    decode in lockstep (every sequence of the batch in one engine step), one engine step per
    generated token of a turn, turn after turn; a wave lasts as long as its longest rollout (a
    multi-turn one generates several times the mean), so the step's rollouts take at least that.
    Unlike GPUs, the sides do not run on hardware of their own: decode, the trainer, the
    orchestrator and the sandbox share the machine's `cores` (default: this machine's), so a step
    takes at least their CPU-seconds over the cores ("bound by cpu")."""
    w = cfg.plan
    rollouts = cfg.orchestrator.batch_size * cfg.orchestrator.group_size
    waves = math.ceil(rollouts / (cfg.decode.engine.max_batch_size * cfg.decode.replicas))
    steps = max(waves * w.generated_tokens, tail_generated(cfg))
    decode_s = steps * rates.cpu_decode_step_s.value
    train_s = rollouts * w.rollout_tokens * rates.cpu_train_s_per_token.value
    t = _combine(cfg, decode_s, 0.0, decode_s, train_s, 0.0, 0.0, decode_s)
    env_s = rollouts * (rates.cpu_orchestrator_s_per_rollout.value + rates.cpu_sandbox_s_per_rollout.value)
    shared = (decode_s + train_s + env_s) / (cores or os.cpu_count() or 1)
    if shared <= t.step_async_s:
        return t
    return t.model_copy(
        update={
            "step_async_s": shared,
            "trainer_wait_s": shared - train_s,
            "inference_wait_s": shared - decode_s,
            "bound_by": "cpu",
        }
    )


def device_for(cfg: RunConfig, rates: Rates) -> Device:
    base = DEVICES[cfg.plan.gpu]
    bw = getattr(rates, f"copy_bytes_per_s_{cfg.plan.gpu}").value
    return Device(base.name, base.hbm_bytes, base.bf16_flops, bw)


def build_plan(cfg: RunConfig, rates: Rates, split: Split | None = None, balance: bool = True) -> Plan:
    split = split or Split(
        trainer_nodes=cfg.slurm.trainer.nodes,
        decode_nodes=cfg.slurm.decode.nodes,
        prefill_nodes=cfg.slurm.prefill.nodes,
    )
    rollouts = cfg.orchestrator.batch_size * cfg.orchestrator.group_size
    w = cfg.plan
    on_cpu = cfg.slurm.launcher == "local" and cfg.decode.engine.device == "cpu"
    dev = device_for(cfg, rates)
    used = {}
    assumptions = {
        "rollout_tokens": f"{w.rollout_tokens:g} tokens per rollout on average (plan.rollout_tokens)",
        "generated_tokens": f"{w.generated_tokens:g} generated per rollout (plan.generated_tokens)",
    }
    if on_cpu:
        times = step_times_cpu(cfg, rates)
        for k in (
            "cpu_decode_step_s",
            "cpu_train_s_per_token",
            "cpu_orchestrator_s_per_rollout",
            "cpu_sandbox_s_per_rollout",
        ):
            used[k] = getattr(rates, k).cite()
        mem = memory(cfg, split, Device("CPU", 24e9, 1.0, 1.0))
        device = "CPU (the debug model's measured step costs)"
        balanced = balanced_times = None
    else:
        times = step_times_gpu(cfg, split, dev, rates)
        mfu = "train_mfu_moe" if cfg.model.is_moe else "train_mfu_dense"
        bw = f"copy_bytes_per_s_{cfg.plan.gpu}"
        for k in (bw, "decode_hbm_fraction", "prefill_mfu", mfu, "publish_bytes_per_s", "apply_bytes_per_s"):
            rate = getattr(rates, k)
            used[k] = rate.cite() if rate else "NOT MEASURED: no apply time is counted"
        mem = memory(cfg, split, dev)
        device = (
            f"{dev.name}: {dev.hbm_bytes / 1e9:.0f} GB, {dev.bf16_flops / 1e12:.0f} TFLOP/s bf16 (datasheet), "
            f"{dev.hbm_bytes_per_s / 1e12:.2f} TB/s copy (measured)"
        )
        assumptions |= all_to_all_notes(cfg, dev, rates, used)
        assumptions |= {
            "tail_factor": f"the longest rollout generates {w.tail_factor:g}x the mean (plan.tail_factor)",
            "prefill_miss": f"{w.prefill_miss:g} of prompt tokens are prefilled (the rest hit the prefix cache; plan.prefill_miss)",
        }
        # Only a Slurm cluster has nodes to move between the sides.
        slurm = cfg.slurm.launcher == "slurm"
        balanced, balanced_times = (
            balance_split(cfg, rates, dev, split) if balance and slurm else (None, None)
        )
    weights = None if on_cpu else weights_traffic(cfg, split)
    return Plan(
        model=cfg.run.name,
        device=device,
        split=split,
        rollouts_per_step=rollouts,
        tokens_per_step=rollouts * w.rollout_tokens,
        generated_per_step=rollouts * w.generated_tokens,
        memory=mem,
        times=times,
        weights=weights,
        balanced=balanced,
        balanced_times=balanced_times,
        off_policy_steps=cfg.orchestrator.max_off_policy_steps,
        searched=balance and not on_cpu and cfg.slurm.launcher == "slurm",
        rates_used=used,
        assumptions=assumptions,
    )


def balance_split(
    cfg: RunConfig, rates: Rates, dev: Device, split: Split
) -> tuple[Split | None, StepTimes | None]:
    """The split of the same GPU nodes with the shortest asynchronous step among those whose
    trainer and decode memory fit."""
    total = split.trainer_nodes + split.decode_nodes + split.prefill_nodes
    best: tuple[float, Split, StepTimes] | None = None
    for t in range(1, total):
        for d in range(1, total - t + 1):
            s = Split(trainer_nodes=t, decode_nodes=d, prefill_nodes=total - t - d)
            mem = memory(cfg, s, dev)
            if not (mem.trainer_fits and mem.inference_fits):
                continue
            times = step_times_gpu(cfg, s, dev, rates)
            if best is None or times.step_async_s < best[0]:
                best = (times.step_async_s, s, times)
    return (best[1], best[2]) if best else (None, None)


# ---------------------------------------------------------------------- output


def render(plan: Plan, budget_s: float | None = None) -> str:
    t, mm, s = plan.times, plan.memory, plan.split
    lines = [
        f"capacity plan: {plan.model} on {plan.device}",
        f"  split: {s.trainer_nodes} trainer / {s.decode_nodes} decode / {s.prefill_nodes} prefill nodes",
        f"  step: {plan.rollouts_per_step} rollouts, {plan.tokens_per_step:,.0f} tokens "
        f"({plan.generated_per_step:,.0f} generated)",
        "memory per GPU:",
        f"  trainer   {mm.trainer_total_gb:8.1f} GB (state {mm.trainer_state_gb:.1f}, activations "
        f"{mm.trainer_activations_gb:.1f}) of {mm.device_gb:.0f}: {'fits' if mm.trainer_fits else 'DOES NOT FIT'}",
        f"  inference {mm.inference_total_gb:8.1f} GB (weights {mm.inference_weights_gb:.1f}, KV "
        f"{mm.inference_kv_gb:.1f}"
        + (f", Mamba-2 states {mm.inference_state_gb:.1f}" if mm.inference_state_gb else "")
        + f") of {mm.device_gb:.0f}: {'fits' if mm.inference_fits else 'DOES NOT FIT'}; "
        f"KV room per engine {mm.kv_tokens_capacity:,} tokens",
        "step time (s):",
        f"  rollout {t.rollout_s:8.1f}  (decode {t.decode_s:.1f}, prefill {t.prefill_s:.1f}; longest rollout "
        f"{t.tail_s:.1f})",
        f"  train   {t.train_s:8.1f}  publish (blocking) {t.publish_blocked_s:.2f}, apply {t.apply_s:.2f}",
        f"  asynchronous step {t.step_async_s:.1f} s (bound by {t.bound_by}); trainer waits "
        f"{t.trainer_wait_s:.1f} s, inference waits {t.inference_wait_s:.1f} s",
        f"  synchronous step {t.step_sync_s:.1f} s",
    ]
    if t.all_to_all_decode_s or t.all_to_all_prefill_s or t.all_to_all_train_s:
        lines.insert(
            -2,
            f"  expert-parallel all-to-all (in the times above): decode {t.all_to_all_decode_s:.2f}, "
            f"prefill {t.all_to_all_prefill_s:.2f}, train {t.all_to_all_train_s:.2f}",
        )
    if (wt := plan.weights) is not None:
        lines += [
            "weights per step (shared filesystem):",
            f"  a version {wt.version_gb:,.1f} GB: {wt.trainer_rank_gb:.2f} GB written by each trainer GPU, "
            f"{wt.inference_rank_gb:.2f} GB read by each inference GPU ({wt.engines} engines read it)",
            f"  {wt.write_gb:,.0f} GB written + {wt.read_gb:,.0f} GB read in {wt.budget_s:.0f} s needs "
            f"{wt.fs_gb_per_s:,.0f} GB/s in all ({wt.trainer_node_gb_per_s:.1f} GB/s a trainer node writing, "
            f"{wt.inference_node_gb_per_s:.1f} GB/s an inference node reading)",
        ]
    if budget_s is not None:
        verdict = "under" if t.step_async_s <= budget_s else "OVER"
        lines.append(f"  target {budget_s:.0f} s: the asynchronous step is {verdict} it")
    bound = plan.off_policy_steps + 1
    if t.step_async_s > 0 and t.tail_s > bound * t.step_async_s:
        lines.append(
            f"  the longest rollout spans {t.tail_s / t.step_async_s:.1f} steps, over the staleness bound of "
            f"{bound} (orchestrator.max_off_policy_steps + 1): such rollouts are dropped unless the bound grows"
        )
    if plan.balanced is None and plan.searched:
        lines.append("no split of these nodes fits both trainer and inference memory")
    if plan.balanced and plan.balanced_times:
        b = plan.balanced
        lines.append(
            f"balanced split of the same nodes: {b.trainer_nodes} trainer / {b.decode_nodes} decode / "
            f"{b.prefill_nodes} prefill -> {plan.balanced_times.step_async_s:.1f} s "
            f"(bound by {plan.balanced_times.bound_by})"
        )
    lines.append("measured rates used:")
    lines += [f"  {k}: {v}" for k, v in plan.rates_used.items()]
    lines.append("assumptions:")
    lines += [f"  {k}: {v}" for k, v in plan.assumptions.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make plan", description=__doc__.splitlines()[0])
    ap.add_argument("model", help="run config name or path (configs/<name>.toml)")
    ap.add_argument("--nodes", type=int, default=None, help="GPU nodes in all; split as the config's ratio")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. --orchestrator.batch_size=64")
    args, extra = ap.parse_known_args(argv)
    try:
        cfg = load_config(args.model, args.overrides + extra)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    split = None
    if args.nodes is not None:
        split = scale_split(cfg, args.nodes)
    plan = build_plan(cfg, load_rates(), split)
    print(plan.model_dump_json(indent=2) if args.json else render(plan, cfg.plan.step_target_s))
    return 0


def scale_split(cfg: RunConfig, nodes: int) -> Split:
    """The config's trainer/decode/prefill ratio over `nodes` GPU nodes (at least one trainer and
    one decode node)."""
    s = cfg.slurm
    total = s.trainer.nodes + s.decode.nodes + s.prefill.nodes
    if nodes < 2:
        raise SystemExit("NODES must be at least 2 (one trainer and one decode node)")
    t = max(1, round(nodes * s.trainer.nodes / total))
    p = round(nodes * s.prefill.nodes / total)
    d = max(1, nodes - t - p)
    p = nodes - t - d
    return Split(trainer_nodes=t, decode_nodes=d, prefill_nodes=max(0, p))


if __name__ == "__main__":
    raise SystemExit(main())
