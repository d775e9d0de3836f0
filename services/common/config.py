"""Run configuration: TOML files under configs/ plus dotted command-line overrides.

A run file (configs/<name>.toml) names a model architecture (configs/models/<arch>.toml) and
sets every service's knobs. `--orchestrator.batch_size=64` style overrides are parsed as TOML
values, applied on top, and the whole tree is validated by pydantic with `extra="forbid"`, so a
typo fails at start with the dotted key that was wrong and why.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "configs"


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key and the reason."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RopeScaling(Strict):
    """Llama-3.1 RoPE frequency scaling (HF rope_type "llama3"): wavelengths longer than
    original_max_position_embeddings / low_freq_factor are divided by `factor`, shorter than
    .../high_freq_factor are kept, and the band between is interpolated smoothly."""

    rope_type: Literal["llama3"] = "llama3"
    factor: float = Field(8.0, gt=0)
    low_freq_factor: float = Field(1.0, gt=0)
    high_freq_factor: float = Field(4.0, gt=0)
    original_max_position_embeddings: int = Field(8192, gt=0)


class YarnScaling(Strict):
    """YaRN RoPE extension as DeepSeek-V3 / Kimi-K2 / GLM-5 configure it (HF rope_type "yarn"):
    frequencies between the beta_fast and beta_slow rotation counts of the original context are
    blended from extrapolated to interpolated by `factor`, and MLA's softmax scale is multiplied by
    (0.1 * mscale_all_dim * ln(factor) + 1)^2. MLA models only; mscale must equal mscale_all_dim
    (the cos/sin factor HF derives from their ratio is then 1, as torchtitan assumes)."""

    rope_type: Literal["yarn"]
    factor: float = Field(gt=1)
    original_max_position_embeddings: int = Field(gt=0)
    beta_fast: float = Field(32.0, gt=0)
    beta_slow: float = Field(1.0, gt=0)
    mscale: float = Field(1.0, gt=0)
    mscale_all_dim: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _same_mscale(self) -> YarnScaling:
        if self.mscale != self.mscale_all_dim:
            raise ValueError("rope_scaling: yarn with mscale != mscale_all_dim is not supported")
        return self


class ModelConfig(Strict):
    """A decoder-only transformer. Field names follow HF config.json semantics.

    `qwen3` is the Qwen3/Llama-style dense decoder every service runs today. `glm_moe_dsa` (GLM-5)
    describes a DeepSeek-V3.2-style model: MLA attention (low-rank q/kv, decoupled RoPE dims), a
    DSA top-k sparse-attention indexer, and MoE feed-forward layers after the first `first_k_dense`
    dense ones. The MoE/MLA/DSA fields default to 0 ("not used"), so dense configs are unchanged;
    they exist so large runs are described, validated and sized (`param_counts`) by the launcher.
    """

    # qwen3: dense Qwen3 (QK-norm); llama3: dense Llama-3 (no QK-norm); qwen3_moe: Qwen3-MoE;
    # deepseek_v3: MLA + MoE with sigmoid/group-limited routing (DeepSeek-V3, Kimi-K2);
    # glm_moe_dsa: GLM-5 (deepseek_v3 plus the DSA indexer); nemotron_h: NVIDIA's hybrid
    # Mamba-2 / attention / MoE stack (Nemotron-H, Nemotron-3), one mixer per layer.
    arch: Literal["qwen3", "llama3", "qwen3_moe", "deepseek_v3", "glm_moe_dsa", "nemotron_h"] = "qwen3"
    vocab_size: int = Field(64, gt=0)
    dim: int = Field(64, gt=0)
    n_layers: int = Field(2, gt=0)
    n_heads: int = Field(4, gt=0)
    n_kv_heads: int = Field(4, gt=0)
    head_dim: int = Field(16, gt=0)
    hidden_dim: int = Field(256, gt=0)  # FFN width of dense layers
    max_seq_len: int = Field(256, gt=0)
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | YarnScaling | None = None  # None: plain RoPE
    norm_eps: float = 1e-6
    qk_norm: bool = True
    tie_embeddings: bool = True
    # "char": the built-in debug tokenizer; "hf": the checkpoint's own tokenizer.json.
    tokenizer: Literal["char", "hf"] = "char"
    # A chat template (jinja) for the char tokenizer, written into every published weights
    # directory's tokenizer_config.json, so chat clients (verifiers environments) can talk to it.
    chat_template: str | None = None
    # Residual stream in float32 on both sides (engine and trainer; sublayer outputs and norm
    # outputs stay in the compute dtype): a bf16 stream turns a sub-ulp kernel difference in a
    # sublayer output into a whole-ulp difference of the residual (Router Replay's KL floor,
    # docs/replay.md "bf16 numerics"). Carried in config.json as relay_fp32_residual when off.
    fp32_residual: bool = True
    # --- Mixture of Experts (n_routed_experts = 0: every layer is dense)
    n_routed_experts: int = Field(0, ge=0)
    n_shared_experts: int = Field(0, ge=0)
    n_experts_per_tok: int = Field(0, ge=0)  # top-k
    moe_hidden_dim: int = Field(0, ge=0)  # FFN width of one expert
    first_k_dense: int = Field(0, ge=0)  # leading dense layers before the MoE ones
    routed_scaling_factor: float = Field(1.0, gt=0)
    router_score: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = True  # renormalise the top-k weights to sum to 1
    # DeepSeek-V3 group-limited routing: experts split in n_group groups, tokens pick topk_group
    # groups first (n_group = 1: plain top-k).
    n_group: int = Field(1, ge=1)
    topk_group: int = Field(1, ge=1)
    # e_score_correction_bias: a per-expert bias added to the scores for *selection* only
    expert_bias: bool = False
    # --- Multi-head latent attention (kv_lora_rank = 0: ordinary GQA with head_dim)
    q_lora_rank: int = Field(0, ge=0)
    kv_lora_rank: int = Field(0, ge=0)
    qk_nope_head_dim: int = Field(0, ge=0)
    qk_rope_head_dim: int = Field(0, ge=0)
    v_head_dim: int = Field(0, ge=0)
    # --- DeepSeek sparse attention indexer (index_topk = 0: dense attention)
    index_topk: int = Field(0, ge=0)
    index_n_heads: int = Field(0, ge=0)
    index_head_dim: int = Field(0, ge=0)
    # Multi-token-prediction layers shipped with the checkpoint (not counted in param_counts).
    n_mtp_layers: int = Field(0, ge=0)
    # --- hybrid stack (arch nemotron_h; HF NemotronH names in brackets). One mixer per layer, by
    # hybrid_pattern [hybrid_override_pattern]: M = Mamba-2, * = attention (no RoPE), - = MLP,
    # E = MoE; every MLP and expert is up/down with a squared-ReLU (hidden_dim: the MLP's width).
    hybrid_pattern: str = ""
    mamba_n_heads: int = Field(0, ge=0)  # [mamba_num_heads]
    mamba_head_dim: int = Field(0, ge=0)  # [mamba_head_dim]
    ssm_state_size: int = Field(0, ge=0)  # [ssm_state_size]
    mamba_n_groups: int = Field(1, ge=1)  # [n_groups]: B/C groups, also the gated norm's groups
    mamba_conv_kernel: int = Field(4, ge=2)  # [conv_kernel]
    mamba_chunk_size: int = Field(128, gt=0)  # [chunk_size]: the chunked scan's block
    # [time_step_limit]: dt clamped to [min, max] after the softplus (max None: no upper bound)
    mamba_dt_min: float = Field(0.0, ge=0)
    mamba_dt_max: float | None = Field(None, gt=0)
    # [moe_shared_expert_intermediate_size]; 0: moe_hidden_dim * n_shared_experts
    shared_expert_hidden_dim: int = Field(0, ge=0)

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_hybrid(self) -> bool:
        return self.arch == "nemotron_h"

    @property
    def shared_width(self) -> int:
        """The shared experts' FFN width (one SwiGLU, or one squared-ReLU MLP for nemotron_h)."""
        return self.shared_expert_hidden_dim or self.moe_hidden_dim * self.n_shared_experts

    def moe_layers(self) -> list[int]:
        """Indices of the MoE layers, in the order of a RoutedExperts array's layer axis."""
        if not self.is_moe:
            return []
        if self.is_hybrid:
            return [i for i, c in enumerate(self.hybrid_pattern) if c == "E"]
        return list(range(self.first_k_dense, self.n_layers))

    @model_validator(mode="before")
    @classmethod
    def _qk_norm_default_from_arch(cls, data: Any) -> Any:
        # Llama-3 has no QK-norm: an arch = "llama3" config that does not say otherwise gets
        # qk_norm = false (the field default, true, is Qwen3's); saying true is an error (below).
        if isinstance(data, dict) and data.get("arch") == "llama3" and "qk_norm" not in data:
            return {**data, "qk_norm": False}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        if self.arch == "llama3" and self.qk_norm:
            raise ValueError(
                "qk_norm: arch llama3 (Llama-3) has no QK-norm; drop qk_norm (or set it false), "
                "or use arch qwen3 for a QK-normed model"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.is_moe:
            if not 0 < self.n_experts_per_tok <= self.n_routed_experts:
                raise ValueError(
                    f"n_experts_per_tok ({self.n_experts_per_tok}) must be in 1..n_routed_experts ({self.n_routed_experts})"
                )
            if self.moe_hidden_dim <= 0:
                raise ValueError("an MoE model needs moe_hidden_dim > 0")
            if self.first_k_dense >= self.n_layers:
                raise ValueError(
                    f"first_k_dense ({self.first_k_dense}) must be below n_layers ({self.n_layers})"
                )
        elif self.n_shared_experts or self.n_experts_per_tok or self.first_k_dense:
            raise ValueError("n_shared_experts/n_experts_per_tok/first_k_dense need n_routed_experts > 0")
        if self.is_mla:
            if min(self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim) <= 0:
                raise ValueError(
                    "MLA (kv_lora_rank > 0) needs qk_nope_head_dim, qk_rope_head_dim, v_head_dim > 0"
                )
            if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
                raise ValueError("with MLA, head_dim must equal qk_nope_head_dim + qk_rope_head_dim")
        elif self.q_lora_rank or self.qk_rope_head_dim or self.qk_nope_head_dim or self.v_head_dim:
            raise ValueError("q_lora_rank/qk_*_head_dim/v_head_dim need kv_lora_rank > 0 (MLA)")
        if self.index_topk and (self.index_n_heads <= 0 or self.index_head_dim <= 0):
            raise ValueError(
                "the sparse-attention indexer (index_topk > 0) needs index_n_heads, index_head_dim > 0"
            )
        if self.arch == "glm_moe_dsa" and not (self.is_moe and self.is_mla and self.index_topk):
            raise ValueError(
                "arch glm_moe_dsa needs MoE (n_routed_experts), MLA (kv_lora_rank) and DSA (index_topk)"
            )
        if isinstance(self.rope_scaling, YarnScaling) and not self.is_mla:
            raise ValueError("rope_scaling: yarn applies to MLA models (deepseek_v3, glm_moe_dsa)")
        if isinstance(self.rope_scaling, RopeScaling) and self.is_mla:
            raise ValueError("rope_scaling: llama3 scaling does not apply to MLA models (use yarn)")
        if self.arch in ("qwen3", "llama3", "qwen3_moe") and (self.is_mla or self.index_topk):
            raise ValueError(f"arch {self.arch} has no MLA/DSA attention: use deepseek_v3 or glm_moe_dsa")
        if self.arch in ("qwen3", "llama3") and self.is_moe:
            raise ValueError(f"arch {self.arch} is dense: use qwen3_moe or deepseek_v3 for MoE")
        if self.is_hybrid:
            self._check_hybrid()
        elif self.hybrid_pattern or self.mamba_n_heads or self.shared_expert_hidden_dim:
            raise ValueError("hybrid_pattern/mamba_*/shared_expert_hidden_dim need arch nemotron_h")
        if self.is_moe and (self.n_routed_experts % self.n_group or self.topk_group > self.n_group):
            raise ValueError(
                f"n_group ({self.n_group}) must divide n_routed_experts and be >= topk_group ({self.topk_group})"
            )
        return self

    def _check_hybrid(self) -> None:
        p = self.hybrid_pattern
        if not p or set(p) - set("M*-E"):
            raise ValueError(
                f"hybrid_pattern {p!r}: one of M (Mamba-2), * (attention), - (MLP), E (MoE) per layer"
            )
        if len(p) != self.n_layers:
            raise ValueError(f"hybrid_pattern has {len(p)} layers, n_layers is {self.n_layers}")
        if ("E" in p) != self.is_moe:
            raise ValueError("hybrid_pattern has MoE layers (E) exactly when n_routed_experts > 0")
        if self.is_moe and self.n_shared_experts != 1:
            raise ValueError("nemotron_h's MoE layers have one shared expert (n_shared_experts = 1)")
        if "M" in p:
            if min(self.mamba_n_heads, self.mamba_head_dim, self.ssm_state_size) <= 0:
                raise ValueError("Mamba-2 layers need mamba_n_heads, mamba_head_dim, ssm_state_size > 0")
            if self.mamba_n_heads % self.mamba_n_groups:
                raise ValueError(
                    f"mamba_n_groups ({self.mamba_n_groups}) must divide mamba_n_heads ({self.mamba_n_heads})"
                )
        if self.first_k_dense or self.is_mla or self.index_topk or self.qk_norm:
            raise ValueError(
                "nemotron_h has no first_k_dense, MLA, DSA or QK-norm (its layers are hybrid_pattern)"
            )
        if self.rope_scaling is not None:
            raise ValueError("nemotron_h's attention has no RoPE: model.rope_scaling does not apply")
        if self.tie_embeddings:
            # HF's NemotronHForCausalLM never ties lm_head to the embedding (_tied_weights_keys {}).
            raise ValueError("nemotron_h has an untied lm_head: set tie_embeddings = false")

    def param_counts(self) -> dict[str, int]:
        """Parameters (total and active per token) from the shapes, norms included; MTP excluded."""
        if self.is_hybrid:
            return self._hybrid_param_counts()
        d, h = self.dim, self.n_heads
        if self.is_mla:
            q = (
                d * h * self.head_dim
                if not self.q_lora_rank
                else (d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * self.head_dim)
            )
            kv = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            kv += self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
            attn = q + kv + h * self.v_head_dim * d
        else:
            attn = d * h * self.head_dim + 2 * d * self.n_kv_heads * self.head_dim + h * self.head_dim * d
            attn += 2 * self.head_dim if self.qk_norm else 0
        if self.index_topk:
            qin = self.q_lora_rank or d
            attn += (
                qin * self.index_n_heads * self.index_head_dim
                + d * self.index_head_dim
                + d * self.index_n_heads
            )
        dense_ffn = 3 * d * self.hidden_dim
        expert = 3 * d * self.moe_hidden_dim
        n_moe = self.n_layers - self.first_k_dense if self.is_moe else 0
        n_dense = self.n_layers - n_moe
        moe_total = (
            self.n_routed_experts * expert + self.n_shared_experts * expert + d * self.n_routed_experts
        )
        moe_active = (self.n_experts_per_tok + self.n_shared_experts) * expert + d * self.n_routed_experts
        norms = 2 * d
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2) + d
        total = self.n_layers * (attn + norms) + n_dense * dense_ffn + n_moe * moe_total + emb
        active = self.n_layers * (attn + norms) + n_dense * dense_ffn + n_moe * moe_active + emb
        return {"total": total, "active": active, "embedding": emb}

    def _hybrid_param_counts(self) -> dict[str, int]:
        d = self.dim
        inner = self.mamba_n_heads * self.mamba_head_dim
        conv = inner + 2 * self.mamba_n_groups * self.ssm_state_size
        mamba = d * (inner + conv + self.mamba_n_heads) + conv * (self.mamba_conv_kernel + 1)
        mamba += 3 * self.mamba_n_heads + inner + inner * d  # dt_bias, A_log, D, gated norm, out_proj
        attn = d * self.n_heads * self.head_dim * 2 + 2 * d * self.n_kv_heads * self.head_dim
        expert = 2 * d * self.moe_hidden_dim
        shared = 2 * d * self.shared_width if self.n_shared_experts else 0
        total_of = {"M": mamba, "*": attn, "-": 2 * d * self.hidden_dim, "E": 0}
        active_of = dict(total_of)
        total_of["E"] = self.n_routed_experts * (expert + d) + shared
        active_of["E"] = self.n_experts_per_tok * expert + self.n_routed_experts * d + shared
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2) + d
        total = sum(total_of[c] + d for c in self.hybrid_pattern) + emb
        active = sum(active_of[c] + d for c in self.hybrid_pattern) + emb
        return {"total": total, "active": active, "embedding": emb}


class KeepWeights(Strict):
    """Which weights/step_N directories a run keeps (the trainer deletes the rest after each
    publish): the newest `last`, every `every`-th step (0: none; step_0 is one), and always the
    versions a live service serves and what a restart needs (services/common/weights_dir.retain)."""

    last: int = Field(3, ge=1)
    every: int = Field(100, ge=0)


class RunSection(Strict):
    name: str = "debug"
    # Empty: runs/<name>-<timestamp>, with runs/latest pointing at it.
    dir: str = ""
    seed: int = 0
    max_steps: int = Field(120, gt=0)
    # Stop early once every task's 10-step mean reward has reached its target.
    stop_on_targets: bool = False
    # Wall-clock budget: once spent, the trainer is asked to stop as on targets (it checkpoints,
    # the run ends with its summary and exit 0). timeout_s is the hard limit (exit 124).
    time_budget_s: float | None = Field(None, gt=0)
    timeout_s: float = Field(900.0, gt=0)
    keep_weights: KeepWeights = KeepWeights()


class RedisSection(Strict):
    # Empty: the launcher starts a bundled server on a free port.
    url: str = ""
    prefix: str = "relay"
    heartbeat_s: float = Field(1.0, gt=0)
    ttl_s: float = Field(5.0, gt=0)


class ServiceSection(Strict):
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)  # 0: pick a free port
    replicas: int = Field(1, ge=1)
    # The largest body the service's data routes take (prompts, commands, files): a larger one is
    # a 413 before it is read. Control routes (pause, weights, sessions) take at most 64 KiB.
    max_request_bytes: int = Field(16 << 20, gt=0)


class EngineConfig(Strict):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_batch_size: int = Field(256, gt=0)
    max_seq_len: int = Field(256, gt=0)
    torch_threads: int = Field(1, ge=1)
    # Paged KV cache: tokens per page, and the pool's size. num_kv_blocks wins over
    # kv_cache_bytes; with neither, the pool holds max_batch_size sequences of max_seq_len.
    block_size: int = Field(16, gt=0)
    num_kv_blocks: int | None = Field(None, gt=0)
    kv_cache_bytes: int | None = Field(None, gt=0)
    # Tokens fed per step (prefill chunks + decodes): long prompts are split across steps.
    max_num_batched_tokens: int = Field(8192, gt=0)
    # Reuse KV pages of identical prompt prefixes (same tokens, same weight version).
    enable_prefix_caching: bool = True
    # Requests still unfinished this long after arrival end with finish_reason "abort".
    request_timeout_s: float | None = Field(None, gt=0)
    # Attention: "torch" gathers pages and runs SDPA (the CPU path); "triton" runs the paged
    # kernels (services/engine/kernels/) on the page pool; "auto" is triton on CUDA, else torch.
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    # With the triton backend on CUDA: capture decode-only steps as CUDA graphs for batch sizes up
    # to min(max_batch_size, cuda_graph_max_batch_size) (services/engine/cuda_graphs.py).
    cuda_graphs: bool = True
    cuda_graph_max_batch_size: int = Field(512, gt=0)
    # With cuda_graphs: steps that carry prefill tokens (mixed steps) replay a graph too, one per
    # power-of-two token count up to max_num_batched_tokens, for steps of at most
    # cuda_graph_max_prefill_spans prompt chunks (cuda_graphs.MixedGraphs); others run eagerly.
    cuda_graph_mixed: bool = True
    cuda_graph_max_prefill_spans: int = Field(16, gt=0)
    # With cuda_graphs and fused_kernels: a decode graph also computes the logits and samples every
    # row with the fused sampler (cuda_graphs.DecodeGraphs, docs/engine.md "The decode step on the
    # device"), so a decode step is one input copy, one replay and one result copy; steps with
    # top-k/top-p/min-p rows or top-n log-probs sample the graph's logits outside it.
    graph_sampling: bool = True
    # Programmatic Dependent Launch for the engine's Triton kernels (forward and fused sampler):
    # each may launch while the one before it still runs and prefetch its weights before waiting
    # (ops/pdl.py, docs/engine.md). Only where usable: off on CPU, under
    # TRITON_INTERPRET and on GPUs below compute capability 9 (Hopper), whatever this says.
    pdl: bool = True
    # CUDA only: fused residual-add + RMSNorm and SiLU-mul kernels, q/k/v and gate/up as one GEMM
    # each, and the one-pass sampler (services/engine/kernels/{fused_norm,sampling}.py). On by
    # default: the fused kernels equal the unfused path on an H200, and there W1 reaches 56% of the
    # memory roofline with them against 46% without. No effect on CPU. The fused
    # sampler draws a different random stream than the CPU path.
    fused_kernels: bool = True
    # CUDA (Hopper) with fused_kernels: a batch-1 decode step runs every layer in one persistent
    # kernel (services/engine/kernels/megakernel.py, docs/engine.md "The batch-1 persistent
    # kernel"); dense GQA models with the float32 residual stream only. Its programs must all be
    # resident at once (one per SM): the engine leaves it off under MPS with an SM limit, and a
    # launch that deadlocks anyway traps instead of hanging. On the H200: Qwen3-0.6B's batch-1
    # graph 0.760 vs 0.864 ms.
    megakernel: bool = True
    # "fp8": attention/MLP linears hold E4M3 weights with 128x128 scales, quantised from the
    # bf16/fp32 checkpoint at load and at every weight update; activations 1x128 per call.
    # lm_head, router and norms stay in `dtype` (services/engine/layers/fp8.py, docs/fp8.md).
    quantization: Literal["none", "fp8"] = "none"
    # Overlap scheduling (docs/engine.md): step N+1 is scheduled and launched before step N's
    # sampled tokens reach the host (they feed N+1 on the device); N's bookkeeping runs while N+1
    # computes. Same tokens as off. "auto": on with CUDA, where W1 reaches 64% of the roofline with
    # it against 51% without (H200); off on CPU, where the forward is synchronous
    # and nothing overlaps. true / false force it (the CPU tests force it on).
    overlap_schedule: Literal["auto"] | bool = "auto"
    # LM-head logits as the bf16 GEMM's float32 output, not rounded to bf16 (services/common/
    # lm_head.py): the trainer's head does the same (trainer.logits_fp32); docs/replay.md "bf16 numerics".
    logits_fp32: bool = True
    # CUDA: the most this process's caching allocator may hold (weights, KV pool, CUDA graph pools,
    # activations), for decode sharing its GPU with the trainer (trainer.cuda_memory_gib); past it
    # an allocation fails as out of memory. None: the whole device (services/common/gpu_memory.py).
    cuda_memory_gib: float | None = Field(None, gt=0)
    # Staged weight applies (services/engine/weight_staging.py, docs/engine.md "Weight updates"):
    # a new version is written into a staging copy of the weights on a background thread (on
    # CUDA, its own stream) while steps run on the old ones; between two steps the loop only
    # copies it into the live buffers, device to device. Costs one more copy of the weights
    # (parameters and persistent buffers: FP8 weights and scales) in device memory. Single-rank
    # engines; a multi-rank engine (decode.parallel) applies updates on its loop as without it.
    stage_weights: bool = False


class ParallelConfig(Strict):
    """How one engine (a decode or prefill service) spreads over its GPUs: ranks = tp x dp_attention
    processes, one per GPU (docs/parallel.md).

    tp: attention and dense layers tensor-parallel over tp ranks (heads, FFN width and vocabulary
    split; KV heads split, or replicated when the model has fewer KV heads than tp).
    dp_attention: that many groups of tp ranks, each holding its own requests' KV and running
    attention on them (MoE models, with ep = ranks: every MoE layer sends tokens to their experts'
    ranks and back, all-to-all).
    ep: 1 (experts tensor-parallel with the rest, over tp) or the whole engine (experts split over
    all ranks)."""

    tp: int = Field(1, ge=1)
    dp_attention: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)

    @property
    def ranks(self) -> int:
        return self.tp * self.dp_attention

    @model_validator(mode="after")
    def _degrees(self) -> ParallelConfig:
        if self.ep not in (1, self.ranks):
            raise ValueError(
                f"ep ({self.ep}) must be 1 or the engine's ranks, tp x dp_attention = {self.ranks}"
            )
        if self.dp_attention > 1 and self.ep != self.ranks:
            raise ValueError(
                f"dp_attention ({self.dp_attention}) > 1 needs ep = tp x dp_attention = {self.ranks}"
                " (data-parallel attention serves MoE layers by expert parallelism)"
            )
        return self

    def check(self, m: ModelConfig, key: str) -> None:
        """Raise ValueError naming `key`.<field> when the model's shape cannot be split this way."""
        tp, what = self.tp, f"{key}.tp ({self.tp})"
        if m.is_hybrid and "M" in m.hybrid_pattern and m.mamba_n_groups % tp:
            # A Mamba-2 layer splits its heads with their B/C groups: each rank's heads read only
            # its own groups, and the gated norm's groups fall whole on one rank.
            raise ValueError(
                f"{what} must divide model.mamba_n_groups ({m.mamba_n_groups}): each rank holds whole"
                " B/C groups of its Mamba-2 heads"
            )
        if m.n_heads % tp:
            raise ValueError(f"{what} must divide model.n_heads ({m.n_heads})")
        if not m.is_mla and m.n_kv_heads % tp and tp % m.n_kv_heads:
            raise ValueError(
                f"{what} must divide model.n_kv_heads ({m.n_kv_heads}), or be a multiple of it"
                " (each KV head then replicated on tp / n_kv_heads ranks)"
            )
        if m.vocab_size % tp:
            raise ValueError(f"{what} must divide model.vocab_size ({m.vocab_size}): vocab-parallel head")
        dense = "-" in m.hybrid_pattern if m.is_hybrid else (not m.is_moe or m.first_k_dense)
        if dense and m.hidden_dim % tp:
            raise ValueError(f"{what} must divide model.hidden_dim ({m.hidden_dim})")
        if m.is_moe and m.shared_width % tp:
            raise ValueError(f"{what} must divide the shared experts' width ({m.shared_width})")
        if self.ep > 1:
            if not m.is_moe:
                raise ValueError(f"{key}.ep ({self.ep}) > 1 needs an MoE model (model.n_routed_experts)")
            if m.n_routed_experts % self.ep:
                raise ValueError(
                    f"{key}.ep ({self.ep}) must divide model.n_routed_experts ({m.n_routed_experts})"
                )
        elif m.is_moe and m.moe_hidden_dim % tp:
            raise ValueError(
                f"{what} must divide model.moe_hidden_dim ({m.moe_hidden_dim}) (experts tensor-parallel"
                " with ep = 1)"
            )


def _check_groups_batch(par: ParallelConfig, engine: EngineConfig, key: str, engine_key: str) -> None:
    """An engine's max_batch_size is shared out over its attention groups: each needs one."""
    if par.dp_attention > engine.max_batch_size:
        raise ValueError(
            f"{key}.dp_attention ({par.dp_attention}) exceeds {engine_key}.max_batch_size"
            f" ({engine.max_batch_size}): each attention group runs max_batch_size / dp_attention"
            " sequences, at least one"
        )


class DecodeSection(ServiceSection):
    engine: EngineConfig = EngineConfig()
    parallel: ParallelConfig = ParallelConfig()


class MooncakeSection(Strict):
    """The pooled bottom tier of the KV store: a real `mooncake_master` (started by the launcher)
    and one store client per gateway, over TCP (docs/kv.md). Needs the `kv` extra."""

    enabled: bool = False
    # Where the master listens; the launcher picks free ports for 0 and writes them to config.json.
    master_host: str = "127.0.0.1"
    rpc_port: int = Field(0, ge=0, le=65535)
    metadata_port: int = Field(0, ge=0, le=65535)  # the master's HTTP metadata server
    metrics_port: int = Field(0, ge=0, le=65535)
    # Memory each gateway contributes to the pool, and its client-side transfer buffer.
    segment_bytes: int = Field(256 << 20, gt=0)
    buffer_bytes: int = Field(64 << 20, gt=0)
    # This gateway's byte budget in the pool (LRU over the pages it put).
    budget_bytes: int = Field(192 << 20, ge=0)


class KVPullSection(Strict):
    """Decode's choice between pulling a prompt's missing prefix from the KV store and recomputing
    it (services/kvstore/pull_policy.py). A pull happens only when its expected time (latency +
    bytes / pull bandwidth + bytes / import bandwidth) is below the expected recompute time (tokens /
    prefill throughput). The priors are replaced by EWMAs of measured pulls and of the engine's own
    prefill steps; they are conservative (a slow pull, a fast prefill) so an unmeasured GPU replica
    recomputes rather than stalls on a pull."""

    # auto: the cost model; always: pull whatever the store has;
    # never: recompute every missing prefix (the store still receives pages).
    mode: Literal["auto", "always", "never"] = "auto"
    prior_pull_bytes_per_s: float = Field(200e6, gt=0)  # gateway -> decode host memory
    prior_pull_latency_s: float = Field(0.01, ge=0)  # one request's fixed cost
    prior_import_bytes_per_s: float = Field(2e9, gt=0)  # host bytes -> the engine's KV pool
    prior_prefill_tokens_per_s: float = Field(20000.0, gt=0)
    # Weight of a new measurement in the EWMAs.
    ewma_alpha: float = Field(0.3, gt=0, le=1)
    # While recompute keeps winning, pull at most probe_pages pages once every probe_interval_s so
    # the pull bandwidth is measured again (the gateway or the network may have got faster).
    probe_interval_s: float = Field(30.0, gt=0)
    probe_pages: int = Field(4, ge=0)
    # Host -> KV pool bandwidth of a near-tier page (pinned, one DMA; ~20-50 GB/s on an H200),
    # replaced by the EWMA of measured near imports.
    prior_near_bytes_per_s: float = Field(2e10, gt=0)


class KVNearSection(Strict):
    """The near KV tier (services/kvstore/near_cache.py): an LRU of KV pages in pinned host memory
    inside each decode / prefill process, in front of the gateway (write-through on put, filled by
    remote gets). A near page imports with one host -> device copy (~20-50 GB/s on an H200) where a
    gateway pull moves ~1-2 GB/s, so pulled prefixes can beat recomputing. 0 bytes: off."""

    bytes: int | None = Field(None, ge=0)  # None: default_cuda_bytes / default_cpu_bytes by device
    default_cuda_bytes: int = Field(4 << 30, ge=0)
    default_cpu_bytes: int = Field(64 << 20, ge=0)
    # > 0: a prefill's near tier is in /dev/shm segments and its answers hand the prompt's pages
    # to a same-host decode (services/kvstore/handoff.py), slots held this long or until acked.
    # 0: private memory, gateway only. Default on: another host, or a full /dev/shm, falls back.
    shared_lease_s: float = Field(30.0, ge=0)


class KVStoreSection(ServiceSection):
    """The KV store gateway (services/kvstore): content-addressed KV pages in tiers RAM -> disk ->
    Mooncake. Disabled by default: the debug run neither starts nor uses it."""

    enabled: bool = False
    # Empty: services find the gateway through the registry (kind "kvstore").
    url: str = ""
    ram_bytes: int = Field(1 << 30, ge=0)
    disk_bytes: int = Field(0, ge=0)  # 0: no disk tier
    disk_dir: str = ""  # empty: RUN_DIR/kvstore/disk
    max_request_bytes: int = Field(512 << 20, gt=0)  # one batched put/get body
    # Client side (decode, prefill): per-call timeout, and how long a failed gateway is skipped.
    timeout_s: float = Field(10.0, gt=0)
    retry_after_s: float = Field(5.0, ge=0)
    mooncake: MooncakeSection = MooncakeSection()
    pull: KVPullSection = KVPullSection()
    near: KVNearSection = KVNearSection()


class PrefillSection(ServiceSection):
    """Prefill services (services/prefill): compute a long prompt's KV pages, publish them to the
    KV store, return the first token; decode continues from there. 0 replicas: none started."""

    replicas: int = Field(0, ge=0)
    # None: decode's engine config (pages must have decode's layout to be reusable there).
    engine: EngineConfig | None = None
    # None: decode's parallel layout.
    parallel: ParallelConfig | None = None
    # Routing (in decode): prompts with at least this many tokens not already cached go to a
    # prefill service; shorter ones are prefilled locally.
    min_new_tokens: int = Field(1024, gt=0)
    timeout_s: float = Field(120.0, gt=0)


class SandboxSection(ServiceSection):
    session_ttl_s: float = Field(300.0, gt=0)
    max_sessions: int = Field(4096, gt=0)
    # Extra modules that register environments (plugins), imported at start.
    plugins: list[str] = []
    # --- isolated execution (services/sandbox/isolation.py; needs bubblewrap)
    # Session directories live under workdir_root ("": a fresh dir under the system temp dir,
    # removed at exit). Its parents must be traversable by other users (o+x).
    workdir_root: str = ""
    # Each session runs as its own host uid from [uid_base, uid_base + max_sessions * replicas).
    uid_base: int = Field(200_000, ge=1000)
    max_concurrent_execs: int = Field(16, gt=0)  # past this, exec/file calls get 429
    # Session starts (POST /v1/sessions, /v1/sessions/batch: a copy-on-write view and the env's
    # reset, milliseconds) run on threads of their own, this many at once, so they never queue
    # behind steps that hold the request threadpool (Starlette's 40 threads) for a whole test
    # suite. 0: starts share that threadpool.
    session_start_threads: int = Field(8, ge=0)
    # ... and past this many in one session: one session cannot take every slot.
    max_execs_per_session: int = Field(4, gt=0)
    # Per session, all its commands together (cgroups v2 or v1, services/sandbox/cgroups.py;
    # "off" or no usable cgroups: only the per-process exec_* rlimits). 0 turns one off.
    cgroups: Literal["auto", "off"] = "auto"
    session_memory_mb: int = Field(4096, ge=0)
    session_max_pids: int = Field(256, ge=0)
    session_cpus: float = Field(2.0, ge=0)
    exec_timeout_s: float = Field(30.0, gt=0)  # default wall clock per command
    exec_max_timeout_s: float = Field(600.0, gt=0)  # cap on a request's timeout_s
    exec_cpu_s: int = Field(60, gt=0)
    exec_memory_mb: int = Field(1024, gt=0)  # address space
    exec_max_procs: int = Field(64, gt=0)
    exec_max_file_mb: int = Field(64, gt=0)
    exec_max_open_files: int = Field(256, gt=0)
    exec_output_bytes: int = Field(65536, gt=0)  # per stream; the rest is dropped with a marker
    exec_tmp_mb: int = Field(64, gt=0)
    file_max_bytes: int = Field(1 << 20, gt=0)  # file read/write endpoints
    # Per-session disk quota: each session directory is a filesystem of its own of that size
    # (needs root; services/sandbox/mounts.py): "disk", an ext4 image under workdir_root,
    # loop-mounted; "tmpfs", in memory. Bytes and files written into /work in total; 0: no quota.
    disk_quota_mb: int = Field(1024, ge=0)
    disk_quota_inodes: int = Field(32768, gt=0)
    disk_quota_backend: Literal["disk", "tmpfs"] = "disk"


class TaskSpec(Strict):
    env: str
    weight: float = Field(1.0, gt=0)
    # Reward the run aims for on this task; reported in the summary.
    target: float = Field(0.0, ge=0.0, le=1.0)
    # A verifiers environment: the module (or installed package) whose load_environment(**args)
    # builds it; the sandbox loads it and runs its rollouts against decode's OpenAI API under the
    # name `env` (services/sandbox/verifiers_host.py, docs/environments.md).
    verifiers: str | None = None
    args: dict[str, Any] = {}

    @model_validator(mode="after")
    def _args_need_verifiers(self) -> TaskSpec:
        if self.args and self.verifiers is None:
            raise ValueError('args: only a verifiers task (with `verifiers = "<module>"`) takes args')
        return self


class SamplingConfig(Strict):
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    max_tokens: int = Field(8, gt=0)


class OrchestratorSection(ServiceSection):
    # Rollout groups (prompts) per trainer step; each group has group_size samples.
    batch_size: int = Field(32, gt=0)
    group_size: int = Field(8, gt=1)
    max_off_policy_steps: int = Field(1, ge=0)
    # Upper bound on concurrently running groups (the staleness bound is usually tighter).
    max_inflight_groups: int = Field(64, gt=0)
    max_turns: int = Field(8, gt=0)
    request_timeout_s: float = Field(60.0, gt=0)
    # A sample's later turns go back to the decode replica that served its previous turn (its
    # context's KV pages are in that replica's prefix cache: only the new tokens are prefilled)
    # unless that replica has more than this many requests in flight above the least-loaded one;
    # None: plain least-outstanding routing.
    decode_affinity_slack: int | None = Field(8, ge=0)
    # Wall clock of one turn of one sample (its generation + its env step) and of a whole group's
    # episode; None: unbounded. A sample past either ends with finish_reason "turn_timeout" /
    # "rollout_timeout" and is scored on what it did (docs/environments.md, "Agent loop budgets").
    turn_timeout_s: float | None = Field(None, gt=0)
    rollout_timeout_s: float | None = Field(None, gt=0)
    # An observation that does not fit the context with a full next turn: "stop" ends the sample
    # (finish_reason "context"); "truncate_observation" cuts it to fit with a "[truncated N tokens]"
    # marker and ends the sample ("context_truncated") only when not even the marker fits;
    # "trim_history" closes the episode's current part (a segment of the sample, trained as it was
    # generated) and goes on from a trimmed context: the prompt, the earlier model turns with their
    # observations replaced by "[trimmed N tokens]" (the oldest turns dropped while the context is
    # over context_trim_target of the budget), the last context_keep_turns observations verbatim,
    # then the new observation (truncated if it alone is too long). The sample ends ("context")
    # only when even that does not fit (docs/environments.md, "Agent loop budgets").
    context_overflow: Literal["stop", "truncate_observation", "trim_history"] = "stop"
    context_keep_turns: int = Field(2, ge=1)
    # The share of the context budget a trimmed context aims at: room for many turns before the
    # next trim, so an episode has few parts (each costs the trainer a sequence).
    context_trim_target: float = Field(0.5, gt=0.0, le=1.0)
    # Group advantage: reward - group mean, divided by the group's reward std when true (GRPO);
    # false is Dr. GRPO's unbiased form. A group with identical rewards gets advantage 0 either way.
    advantage_std_norm: bool = False
    # "sequence": one advantage per sample (above). "token": where the env gives per-character
    # credit (Environment.credit), each model token gets its credit minus the group's mean
    # credit at the same (turn, token index), so the right and wrong parts of one answer are
    # told apart; groups without credit fall back to "sequence" (docs/loss.md, "Token credit").
    advantage: Literal["sequence", "token"] = "sequence"
    # > 0: the group baseline (per answer, and per position with token credit) counts this many
    # more samples of full reward / credit (1.0): b = (sum + k) / (n + k). A position (or group)
    # every sample got wrong then gets -k / (n + k) instead of 0, so a confidently wrong token is
    # pushed down although no sample found the right one; an all-right group still gets 0
    # (docs/loss.md, "Baseline prior"). Rewards and credit are in [0, 1] by the env contract.
    baseline_prior: float = Field(0.0, ge=0)
    # A group whose decode or sandbox is unavailable (connection refused, 5xx, no live replica) is
    # re-run with back-off (0.5 s doubling up to service_retry_max_delay_s) for up to
    # service_retry_s before it is dropped: a service restarting under its supervisor loses none.
    service_retry_s: float = Field(60.0, ge=0)
    service_retry_max_delay_s: float = Field(5.0, gt=0)
    tasks: list[TaskSpec] = [TaskSpec(env="reverse")]
    sampling: SamplingConfig = SamplingConfig()

    @model_validator(mode="after")
    def _trim_needs_sequence_advantage(self) -> OrchestratorSection:
        if self.context_overflow == "trim_history" and self.advantage == "token":
            # Token credit indexes each action in one token stream; a trimmed episode has several.
            raise ValueError(
                "context_overflow: 'trim_history' is not combinable with advantage = 'token'; "
                "use advantage = 'sequence' or another overflow policy"
            )
        return self

    @model_validator(mode="after")
    def _one_advantage_scale(self) -> OrchestratorSection:
        if self.advantage == "token" and self.advantage_std_norm:
            # Credit advantages are raw (within +-1) while the sequence fallback would be divided
            # by the group std: two scales in one sample.
            raise ValueError(
                "advantage_std_norm: not combinable with advantage = 'token' (token credit is not "
                "std-normalised); set one of them"
            )
        if self.baseline_prior > 0 and self.advantage_std_norm:
            # A group that got nothing has std 0: its shifted advantage cannot be normalised.
            raise ValueError(
                "baseline_prior: not combinable with advantage_std_norm (an all-zero group's "
                "std is 0); set one of them"
            )
        return self


class TrainerSection(Strict):
    nproc: int = Field(1, ge=1)
    # "auto": CUDA when present (one GPU per process, NCCL), else CPU (gloo).
    device: Literal["auto", "cpu", "cuda"] = "cpu"
    lr: float = Field(1e-3, gt=0)
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    # Tokens whose importance ratio pi_train/pi_infer falls outside [ratio_low, ratio_high]
    # are masked out of the loss (see docs/loss.md).
    ratio_low: float = Field(0.5, gt=0)
    ratio_high: float = Field(2.0, gt=1)
    # Entropy bonus: loss -= entropy_coef * mean entropy over loss tokens (0: none, the calibrated
    # GRPO-style loss). Needs logprob_chunk_tokens = 0.
    entropy_coef: float = Field(0.0, ge=0)
    # entropy_target > 0: steer the coefficient (starting at entropy_coef) towards keeping the mean
    # loss-token entropy at or above this many nats: += entropy_coef_lr * (target - entropy) per
    # step, within [0, entropy_coef_max] (trainer/entropy.py says why).
    entropy_target: float = Field(0.0, ge=0)
    entropy_coef_lr: float = Field(0.01, gt=0)
    entropy_coef_max: float = Field(0.05, ge=0)
    checkpoint_every: int = Field(20, gt=0)
    # Checkpoint when the run ends (run.max_steps) or stops gracefully (time budget, targets,
    # `make stop`), so a restart loses nothing. false: only every checkpoint_every steps (benchmark
    # runs whose trained state is thrown away, where a large model's optimizer state takes long).
    checkpoint_on_stop: bool = True
    # CUDA: the most this trainer process's caching allocator may hold, for a trainer sharing its
    # GPU with decode (decode.engine.cuda_memory_gib). None: the whole device.
    cuda_memory_gib: float | None = Field(None, gt=0)
    init_std: float = Field(0.02, gt=0)
    torch_threads: int = Field(1, ge=1)
    # Padded tokens (rows x longest row) per forward/backward; a step is split into micro-batches.
    micro_batch_tokens: int = Field(8192, gt=0)
    # Pack samples into one row per micro-batch (no padding; block-diagonal causal attention,
    # RoPE restarting per sample); micro_batch_tokens is then the row's token budget.
    packing: bool = False
    # > 0: project to the vocabulary this many tokens at a time (no [tokens x vocab] tensor).
    logprob_chunk_tokens: int = Field(0, ge=0)
    # LM-head logits in float32 from the bf16 GEMM (as decode.engine.logits_fp32; docs/replay.md).
    logits_fp32: bool = True
    # Chunked head (logprob_chunk_tokens > 0): keep the forward's onehot - p (GEMM dtype) for the
    # backward (no logits GEMM there) when a micro-batch's tokens x vocab x itemsize fit in this
    # many GiB; 0: always recompute. Same gradients (trainer/chunked.py; docs/trainer.md).
    head_cache_gib: float = Field(12.0, ge=0)
    # MoE: route every token to the experts inference recorded for it (Sample.routed_experts)
    # instead of the trainer's own top-k; the gate still learns through its scores at those ids.
    router_replay: bool = True
    # GLM-5's DSA indexer (trainer/glm5.py): "frozen" (never updated; the RL loss cannot reach it
    # through the top-k selection) or "kl" (DeepSeek-V3.2's sparse-stage KL to the attention
    # distribution over the selected keys, on detached inputs, scaled by dsa_indexer_loss_coef /
    # the step's loss tokens). No effect on other architectures.
    dsa_indexer: Literal["frozen", "kl"] = "frozen"
    dsa_indexer_loss_coef: float = Field(1.0, gt=0)
    # [first, last]: the steps first..last (inclusive) train with the trainer's own routing even
    # with router_replay on, a segment that shows in the step metrics what replay removes from the
    # mismatch (trainer.replay.replay_at).
    router_replay_off_steps: tuple[int, int] | None = None
    # FP8 linears with the engine's recipe (1x128 activations, 128x128 weights) in the forward;
    # master weights, gradients and optimizer state stay in high precision (trainer/fp8.py).
    fp8: bool = False
    # With fp8: the backward's two GEMMs in FP8 too (grad_out 1x128 x the transposed weight tiles;
    # the weight gradient over tokens with grad_out^T and x^T quantised 1x128 along the tokens), as
    # DeepSeek-V3 trains. false: both in the activations' dtype through the dequantised operands.
    # H200: a training linear of >= ~25M weights is 1.14-1.35x bf16 with it, 0.71-0.94x without
    # (docs/fp8.md). MoE experts: the two dgrads in FP8
    # (grouped), the weight gradients bf16 from the saved inputs, no recompute; false: the
    # straight-through gradients recomputed in bf16 (H100, 30B-A3B widths: 1.05x against 0.87x bf16).
    fp8_backward: bool = True
    # With fp8: a linear with fewer weights (in x out) than this stays in the activations' dtype,
    # as torchtitan's float8 converter filters small layers. Below ~25M weights an FP8 training
    # linear costs more host time (two quantisers and a GEMM launch per call) than its GEMMs save
    # (docs/fp8.md, "Trainer"). The engine still runs such layers in FP8, so those layers lose the
    # recipe match with it. 0: every linear, the engine's rule. MoE experts are not filtered.
    fp8_min_weights: int = Field(0, ge=0)
    # --- performance path (trainer/parallel.py, docs/trainer.md)
    # bfloat16: FSDP2 mixed precision (bf16 params/compute, float32 master weights, optimizer
    # state and gradient reduction). A plain single process (no FSDP) uses torch.autocast.
    dtype: Literal["float32", "bfloat16"] = "float32"
    # FSDP2 wrapping: "auto" only when the data-parallel world is > 1 (one process, even under
    # torchrun, trains plain float32 parameters, bf16 through torch.autocast: no all-gather /
    # reduce-scatter copies); "always" under any process group, also of one rank (docs/trainer.md);
    # "master": as "auto", but one rank in bfloat16 trains bf16 parameters with float32 master
    # weights instead of autocast (trainer/master_weights.py).
    fsdp: Literal["auto", "always", "master"] = "auto"
    # torchtitan activation checkpointing per transformer block ("selective" = per-op SAC).
    activation_checkpoint: Literal["none", "selective", "full"] = "none"
    compile: bool = False  # torch.compile each transformer block
    # Attention kernel; flex/varlen (CUDA only) apply document masking without a [T, T] mask.
    attention: Literal["sdpa", "flex", "varlen"] = "sdpa"
    # Which SDPA kernel causal SDPA tries first (one-sample packs, padded rows, the dense mask):
    # "auto" = torchtitan's order (cuDNN, flash, math); the others put that backend first, the
    # rest after it as fallbacks (their speed: docs/trainer.md).
    sdpa_backend: Literal["auto", "cudnn", "flash", "efficient"] = "auto"
    # Repeat the kv heads to the q heads before SDPA (GQA models): for a backend that has no GQA
    # support and would otherwise be skipped for the next one; costs a copy and its backward.
    sdpa_expand_kv: bool = False
    # Parallel degrees: nproc = dp * tp * cp (dp is what is left); ep splits the experts over
    # ranks of dp * cp * tp and must divide it.
    tp: int = Field(1, ge=1)
    cp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    # MoE routed experts: torch._grouped_mm GEMMs ("on") or a per-expert loop ("off"); "auto" = on
    # for bf16 on CUDA, off otherwise (float32 keeps the loop as the reference; docs/trainer.md).
    moe_grouped_mm: Literal["auto", "on", "off"] = "auto"

    @model_validator(mode="after")
    def _parallel(self) -> TrainerSection:
        if self.nproc % (self.tp * self.cp):
            raise ValueError(
                f"trainer.nproc ({self.nproc}) must be a multiple of trainer.tp * trainer.cp"
                f" ({self.tp} * {self.cp}); dp = nproc / (tp * cp)"
            )
        if self.fp8 and self.tp > 1:
            # Block scales are computed on whole 128x128 weight tiles; a TP shard sees only part.
            raise ValueError("trainer.fp8 needs trainer.tp = 1")
        if self.nproc % self.ep:
            raise ValueError(f"trainer.ep ({self.ep}) must divide trainer.nproc ({self.nproc})")
        if self.attention != "sdpa" and self.device == "cpu":
            raise ValueError(f"trainer.attention {self.attention!r} needs CUDA (trainer.device cpu)")
        if self.cp > 1 and self.attention != "sdpa":
            raise ValueError("trainer.cp > 1 needs trainer.attention 'sdpa' (torchtitan's CP)")
        off = self.router_replay_off_steps
        if off is not None and not 1 <= off[0] <= off[1]:
            raise ValueError(
                f"trainer.router_replay_off_steps must be [first, last] with 1 <= first <= last, got {list(off)}"
            )
        if self.entropy_target > 0 and self.entropy_coef_max <= 0:
            raise ValueError("trainer.entropy_target > 0 needs trainer.entropy_coef_max > 0")
        if (self.entropy_coef > 0 or self.entropy_target > 0) and self.logprob_chunk_tokens:
            raise ValueError(
                "an entropy bonus (trainer.entropy_coef / entropy_target) needs trainer.logprob_chunk_tokens = 0"
            )
        return self


_SLURM_TIME = re.compile(
    r"^(?:(\d+)-(\d{1,2})(?::(\d{1,2})(?::(\d{1,2}))?)?|(\d+)(?::(\d{1,2})(?::(\d{1,2}))?)?)$"
)


def slurm_time_minutes(value: str) -> int:
    """Slurm's --time syntax (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) -> whole minutes (rounded up)."""
    m = _SLURM_TIME.match(value)
    if not m:
        raise ValueError(f"{value!r} is not a Slurm time (M, H:M:S, D-H:M:S, ...)")
    d, dh, dm, ds, a, b, c = m.groups()
    if d is not None:
        secs = int(d) * 86400 + int(dh) * 3600 + int(dm or 0) * 60 + int(ds or 0)
    elif c is not None:
        secs = int(a) * 3600 + int(b) * 60 + int(c)
    elif b is not None:
        secs = int(a) * 60 + int(b)
    else:
        secs = int(a) * 60
    return max(1, -(-secs // 60))


class SupervisorSection(Strict):
    """How every service is kept alive (local and Slurm launchers alike): sbatch/supervisor.py."""

    # Consecutive failures tolerated before the service is given up (and the run stops).
    max_restarts: int = Field(5, ge=0)
    backoff_s: float = Field(1.0, ge=0)  # first delay; doubles per consecutive failure
    backoff_max_s: float = Field(60.0, ge=0)
    # A service that ran this long before failing starts a fresh failure count.
    reset_after_s: float = Field(300.0, gt=0)
    # SIGTERM grace before SIGKILL when stopping or restarting a service.
    stop_timeout_s: float = Field(15.0, gt=0)
    # Liveness: every probe_interval_s (0: never) an HTTP service's /health (Redis: PING) must answer
    # within probe_timeout_s; probe_failures misses in a row and it is killed and restarted.
    probe_interval_s: float = Field(2.0, ge=0)
    probe_timeout_s: float = Field(5.0, gt=0)
    probe_failures: int = Field(3, gt=0)


class SlurmComponent(Strict):
    """Resources of one het-job component; every node runs one task (its services' supervisors)."""

    nodes: int = Field(1, ge=0)
    gpus_per_node: int = Field(0, ge=0)
    cpus_per_node: int = Field(2, ge=1)
    mem: str = Field("4G", pattern=r"^\d+[KMGT]?$")  # per node, Slurm syntax; "0" = the whole node
    time: str = ""  # empty: slurm.time
    partition: str = ""  # empty: slurm.partition
    constraint: str = ""

    # `--slurm.time=30` arrives as a TOML integer: minutes, as Slurm reads a bare number.
    _minutes = field_validator("time", mode="before")(lambda v: str(v) if isinstance(v, int) else v)

    @model_validator(mode="after")
    def _time(self) -> SlurmComponent:
        if self.time:
            slurm_time_minutes(self.time)
        return self


class SlurmSection(Strict):
    """How the run is launched: `local` processes, or one heterogeneous Slurm job (sbatch/slurm.py)."""

    launcher: Literal["local", "slurm"] = "local"
    partition: str = ""  # empty: the cluster's default partition
    account: str = ""
    qos: str = ""
    time: str = "04:00:00"
    job_name: str = ""  # empty: relay-<run.name>
    # submitit's folder (pickles, per-task logs); empty: RUN_DIR/slurm. Must be on a shared filesystem.
    folder: str = ""
    exclusive: bool = False
    # Shell lines run by the batch script before srun (module load, venv activation, exports).
    setup: list[str] = []
    # Fixed ports; 0: a free port picked at run time (Redis on the head, torchrun's rendezvous).
    redis_port: int = Field(0, ge=0, le=65535)
    rdzv_port: int = Field(0, ge=0, le=65535)
    # After submitting, print step lines until the job ends (Ctrl-C detaches; the job keeps running).
    follow: bool = True
    head: SlurmComponent = SlurmComponent(nodes=1, cpus_per_node=2, mem="4G")
    decode: SlurmComponent = SlurmComponent(nodes=1, cpus_per_node=2, mem="4G")
    prefill: SlurmComponent = SlurmComponent(nodes=0, cpus_per_node=2, mem="4G")
    trainer: SlurmComponent = SlurmComponent(nodes=1, cpus_per_node=2, mem="4G")
    supervisor: SupervisorSection = SupervisorSection()

    _minutes = field_validator("time", mode="before")(lambda v: str(v) if isinstance(v, int) else v)

    @model_validator(mode="before")
    @classmethod
    def _prefill_default(cls, data: Any) -> Any:
        # `--slurm.prefill.mem=8G` builds a fresh SlurmComponent, whose nodes default is 1: keep
        # prefill's own default (0 nodes) unless nodes is given.
        if isinstance(data, dict) and isinstance(data.get("prefill"), dict):
            data = {**data, "prefill": {"nodes": 0, **data["prefill"]}}
        return data

    @model_validator(mode="after")
    def _shape(self) -> SlurmSection:
        slurm_time_minutes(self.time)
        if self.head.nodes != 1:
            raise ValueError(f"slurm.head.nodes must be 1 (got {self.head.nodes})")
        for name in ("decode", "trainer"):
            if getattr(self, name).nodes < 1:
                raise ValueError(f"slurm.{name}.nodes must be at least 1")
        return self


class PlanSection(Strict):
    """Workload assumptions for the capacity plan (`make plan`, sbatch/plan.py)."""

    gpu: Literal["h100", "h200"] = "h200"
    rollout_tokens: float = Field(512.0, gt=0)  # mean tokens per rollout, prompt and tools included
    generated_tokens: float = Field(64.0, gt=0)  # mean tokens the policy generates per rollout
    tail_factor: float = Field(10.0, ge=1)  # the longest rollout's generated tokens / the mean
    prefill_miss: float = Field(1.0, ge=0, le=1)  # share of new prompt tokens not in a prefix cache
    step_target_s: float | None = Field(None, gt=0)  # the step time the plan is checked against
    # A GPU's network bandwidth to GPUs of other nodes, GB/s, as the cluster states it (one 400 Gb/s
    # NIC a GPU: 50): the rate of an expert-parallel all-to-all across nodes, until one is measured.
    nic_gb_per_s: float = Field(50.0, gt=0)

    @model_validator(mode="after")
    def _lengths(self) -> PlanSection:
        if self.generated_tokens > self.rollout_tokens:
            raise ValueError("plan.generated_tokens must not exceed plan.rollout_tokens")
        return self


# decode.engine.max_num_batched_tokens when prefill services exist and it is not set (RunConfig).
DISAGG_DECODE_STEP_TOKENS = 512


class RunConfig(Strict):
    run: RunSection = RunSection()
    model: ModelConfig = ModelConfig()
    redis: RedisSection = RedisSection()
    decode: DecodeSection = DecodeSection()
    kvstore: KVStoreSection = KVStoreSection()
    prefill: PrefillSection = PrefillSection()
    sandbox: SandboxSection = SandboxSection()
    orchestrator: OrchestratorSection = OrchestratorSection()
    trainer: TrainerSection = TrainerSection()
    slurm: SlurmSection = SlurmSection()
    plan: PlanSection = PlanSection()

    @model_validator(mode="after")
    def _decode_step_budget(self) -> RunConfig:
        # With prefill services, decode prefills only short prompts itself, and a burst of them
        # filling an 8,192-token step stretches every stream's step. Unless set, decode then feeds
        # at most DISAGG_DECODE_STEP_TOKENS a step (never fewer than a full batch of decodes):
        # interference p99 1.26-1.61x the baseline at 512, 1.75-2.16x at 2,048 (docs/kv.md).
        engine = self.decode.engine
        if (self.prefill.replicas > 0 or self.slurm.prefill.nodes > 0) and (
            "max_num_batched_tokens" not in engine.model_fields_set
        ):
            engine.max_num_batched_tokens = max(DISAGG_DECODE_STEP_TOKENS, engine.max_batch_size)
        return self

    @model_validator(mode="after")
    def _recurrent_state(self) -> RunConfig:
        # A Mamba-2 layer keeps a per-sequence state, not pages: KV pages alone cannot carry a
        # prompt from one engine to another (services/engine/state_cache.py).
        m = self.model
        if m.is_hybrid and "M" in m.hybrid_pattern:
            if self.kvstore.enabled:
                raise ValueError(
                    "kvstore.enabled: a model with Mamba-2 layers cannot move prompts as KV pages"
                )
            if self.prefill.replicas > 0 or self.slurm.prefill.nodes > 0:
                raise ValueError("prefill: a model with Mamba-2 layers prefills on its decode engines")
        return self

    @model_validator(mode="after")
    def _engine_layouts(self) -> RunConfig:
        self.decode.parallel.check(self.model, "decode.parallel")
        _check_groups_batch(self.decode.parallel, self.decode.engine, "decode.parallel", "decode.engine")
        self._check_gpus(self.decode.parallel, "decode", self.decode.replicas)
        if self.prefill.replicas > 0 or self.slurm.prefill.nodes > 0:
            key = "prefill.parallel" if self.prefill.parallel else "decode.parallel"
            self.prefill_parallel.check(self.model, key)
            ekey = "prefill.engine" if self.prefill.engine else "decode.engine"
            _check_groups_batch(self.prefill_parallel, self.prefill.engine or self.decode.engine, key, ekey)
            # One prefill service per prefill node (sbatch/slurm.py).
            self._check_gpus(self.prefill_parallel, "prefill", self.slurm.prefill.nodes, key)
            par = self.prefill_parallel
            if par.ranks > 1 and par.dp_attention > 1:
                unset = "" if self.prefill.parallel else ", from decode.parallel (prefill.parallel unset)"
                raise ValueError(
                    f"prefill.parallel.dp_attention ({par.dp_attention}{unset}): a multi-rank prefill"
                    " runs one attention group; set prefill.parallel = { tp = ..., ep = ... }"
                )
        return self

    def _check_gpus(self, par: ParallelConfig, role: str, replicas: int, key: str = "") -> None:
        """Under Slurm, an engine's ranks are exactly the GPUs its replica is given."""
        key = key or f"{role}.parallel"
        comp: SlurmComponent = getattr(self.slurm, role)
        if self.slurm.launcher != "slurm" or not replicas:
            return
        if role == "decode" and replicas < comp.nodes:  # an engine over several nodes
            if comp.nodes % replicas:
                return  # sbatch/slurm.py's layout names that error
            span = comp.nodes // replicas
            if par.ranks % span:
                raise ValueError(
                    f"{key}: tp x dp_attention = {par.ranks} rank(s) per engine cannot split evenly"
                    f" over the {span} nodes of each decode replica (slurm.decode.nodes {comp.nodes}"
                    f" / decode.replicas {replicas})"
                )
        gpus = comp.gpus_per_node * comp.nodes
        if gpus % replicas:
            return  # sbatch/slurm.py's layout names that error
        per = gpus // replicas
        if comp.gpus_per_node and par.ranks != per:
            raise ValueError(
                f"{key}: tp x dp_attention = {par.ranks} rank(s) per engine, but each {role} replica"
                f" gets {per} GPU(s) (slurm.{role}.gpus_per_node {comp.gpus_per_node} x nodes"
                f" {comp.nodes} / {replicas} replicas): one rank per GPU"
            )

    @property
    def prefill_parallel(self) -> ParallelConfig:
        return self.prefill.parallel or self.decode.parallel

    def engine_nodes(self, role: str) -> int:
        """How many nodes one engine of `role` spans: under the Slurm launcher with fewer decode
        replicas than decode nodes, slurm.decode.nodes / decode.replicas (each replica's ranks
        split evenly over its nodes); 1 otherwise (a prefill service is one per node)."""
        nodes, replicas = self.slurm.decode.nodes, self.decode.replicas
        if role != "decode" or self.slurm.launcher != "slurm" or replicas >= nodes:
            return 1
        return nodes // replicas

    def dump(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True)


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """`--a.b=3 --c.d="x"` -> {"a": {"b": 3}, "c": {"d": "x"}}; values are TOML, bare words are strings."""
    tree: dict[str, Any] = {}
    for arg in args:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"override {arg!r}: expected --section.key=value")
        key, raw = arg[2:].split("=", 1)
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {arg!r}: {part} is not a section")
        node[parts[-1]] = value
    return tree


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None


# A cross-section check (a RunConfig validator) names its own dotted key at its message's start.
_NAMED_KEY = re.compile(r"^Value error, ([a-z_]+(?:\.[a-z_]+)+\b.*)$", re.S)


def _format_validation(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        named = _NAMED_KEY.match(msg) if key == "<root>" else None
        if named:  # the input here is the whole tree: not worth printing
            lines.append(f"  {named[1]}")
            continue
        lines.append(f"  {key}: {msg} (got {e.get('input')!r})")
    return "\n".join(lines)


def _run_config_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    return path if path.suffix else CONFIG_DIR / f"{name_or_path}.toml"


def _read_run_toml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A run config, on top of its `base = "<name>"` run config when it names one (tables
    merge key by key; a list or value in the derived file replaces the base's)."""
    tree = _read_toml(path)
    base = tree.pop("base", None)
    if base is None:
        return tree
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base must be the name of another run config, got {base!r}")
    base_path = _run_config_path(base)
    if base_path.resolve() in seen or base_path.resolve() == path.resolve():
        raise ConfigError(f"{path}: base {base!r} makes a cycle")
    return _merge(_read_run_toml(base_path, (*seen, path.resolve())), tree)


def load_config(name_or_path: str, overrides: list[str] | None = None) -> RunConfig:
    """Load configs/<name>.toml (or a path) over its base config if it names one, resolve its
    model architecture, apply overrides."""
    path = _run_config_path(name_or_path)
    tree = _read_run_toml(path)
    tree = _merge(tree, parse_overrides(overrides or []))
    model = tree.get("model", {})
    if isinstance(model, dict) and "config" in model:
        arch_path = CONFIG_DIR / "models" / f"{model.pop('config')}.toml"
        tree["model"] = _merge(_read_toml(arch_path), model)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_validation(e, str(path))) from None


def load_resolved(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Services read the launcher's resolved JSON config (RUN_DIR/config.json); a resumed run
    reads it too, with its dotted overrides on top."""
    try:
        if not overrides:
            return RunConfig.model_validate_json(Path(path).read_text())
        tree = _merge(json.loads(Path(path).read_text()), parse_overrides(overrides))
        return RunConfig.model_validate(tree)
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist: not a run directory") from None
    except ValidationError as e:
        raise ConfigError(_format_validation(e, str(path))) from None
