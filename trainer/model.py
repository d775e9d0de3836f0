"""The trainer's model: torchtitan's Qwen3 definition, and conversion to/from the HF weights contract."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torchtitan.models.moe import MoEArgs
from torchtitan.models.moe.moe import TokenReorderer
from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
from torchtitan.models.qwen3.model.model import (
    Attention,
    FeedForward,
    Qwen3Model,
    reshape_for_broadcast,
    rotate_half,
)
from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

from ops.fp8.checkpoint import check_checkpoint, dequantize_state
from services.common.config import ModelConfig, RopeScaling
from services.common.modeldir import hf_config, model_config_from_hf
from services.common.tokenizer import build_char_tokenizer, eos_id, save_tokenizer
from services.common.weights_dir import read_model_dir, write_model_dir
from trainer.glm5 import GlmMoeDsaAdapter, build_glm5
from trainer.moe_routing import (
    DeepSeekV3Adapter,
    RelayDeepSeekV3Model,
    add_expert_bias,
    build_deepseek_v3,
    count_per_expert,
    deepseek_moe_args,
    routed_experts_like,
)
from trainer.nemotron import NemotronHAdapter, NemotronHModel, build_nemotron

# Built on torchtitan's DeepSeek-V3 (MLA + DeepSeek MoE); glm_moe_dsa adds the DSA indexer.
MLA_ARCHS = ("deepseek_v3", "glm_moe_dsa")
# Architectures with their own blocks (not torchtitan's Qwen3, whose modules build_model re-classes
# for the engine's rounding): MLA models and the nemotron_h hybrid stack.
OWN_ARCHS = (*MLA_ARCHS, "nemotron_h")


def moe_args(m: ModelConfig) -> MoEArgs:
    """torchtitan MoE settings computing HF Qwen3-MoE's function (Qwen3MoeSparseMoeBlock), or
    DeepSeek-V3's (deepseek_moe_args)."""
    if m.arch in MLA_ARCHS:
        return deepseek_moe_args(m)
    if m.arch != "qwen3_moe":
        raise ValueError(
            f"the trainer builds MoE only for arch qwen3_moe, deepseek_v3 and glm_moe_dsa (got {m.arch!r})"
        )
    # What HF Qwen3-MoE (and so the published config.json, services/common/modeldir.py) can say.
    if m.n_shared_experts or m.expert_bias or m.n_group != 1 or m.routed_scaling_factor != 1.0:
        raise ValueError(
            "qwen3_moe has no shared experts, expert-score bias, group-limited routing or routed scaling"
        )
    if m.router_score != "softmax":
        raise ValueError("qwen3_moe routes by softmax scores (model.router_score)")
    return MoEArgs(
        num_experts=m.n_routed_experts,
        num_shared_experts=0,
        score_func=m.router_score,
        route_norm=m.norm_topk_prob,
        route_scale=m.routed_scaling_factor,
        gate_bias=False,
        # HF weights each expert's OUTPUT by its score (the SwiGLU is not linear, so order matters).
        score_before_experts=False,
        top_k=m.n_experts_per_tok,
        num_expert_groups=None,
        num_limited_groups=None,
        # Built as the for-loop path (the parameters' dtype on any device); trainer.moe_grouped_mm
        # switches to grouped GEMMs at parallelize (trainer/moe_routing.py RoutedExperts).
        use_grouped_mm=False,
        # No auxiliary-loss-free balancing bias: it is not part of Qwen3-MoE and, being a
        # persistent buffer, would change the routing the published weights describe.
        load_balance_coeff=None,
    )


# --- RoPE scaling and Llama-3 (keep this block together) ------------------------------------
#
# arch "llama3" trains on torchtitan's Qwen3 with qk_norm = false (ModelConfig makes that the
# llama3 default and refuses qk_norm = true): Llama-3's decoder is Qwen3's minus QK-norm (same
# HF parameter names, RMSNorm, SwiGLU, rotate_half RoPE), so no second model definition is
# needed; tests/test_hf_models_e2e.py checks trainer and engine log-probs agree on one.
# torchtitan's args have no field for Llama-3.1 rope scaling, hence the two subclasses below.


@dataclass
class RelayQwen3ModelArgs(Qwen3ModelArgs):
    """Qwen3ModelArgs plus Llama-3.1 RoPE frequency scaling (None: plain RoPE)."""

    rope_scaling: RopeScaling | None = None


def scaled_rope_cache(head_dim: int, max_seq_len: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """torchtitan's precompute_rope_cache layout ([max_seq_len, 2 * head_dim]: cos then sin of
    the duplicated angles) with the engine's llama3 frequency scaling applied first: the same
    float32 arithmetic as services/engine/models/causal_lm.py's rope_cache."""
    # Imported here: the engine package is only needed by rope-scaled models.
    from ops.rope import llama3_scale_freqs

    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    freqs = llama3_scale_freqs(freqs, scaling)
    t = torch.arange(max_seq_len, dtype=freqs.dtype, device=freqs.device)
    angles = torch.outer(t, freqs).float()
    emb = torch.cat([angles, angles], dim=-1)
    return torch.cat([emb.cos(), emb.sin()], dim=-1)


class RelayQwen3Model(Qwen3Model):
    """torchtitan's Qwen3Model with the rope-scaled cache when the args ask for it. Qwen3Model
    builds its (non-persistent) `rope_cache` buffer only through `_precompute_rope_cache`, in
    __init__ and in init_weights, so overriding it replaces the frequencies everywhere."""

    def _precompute_rope_cache(self) -> torch.Tensor:
        scaling = getattr(self.model_args, "rope_scaling", None)
        if scaling is None:
            return super()._precompute_rope_cache()
        a = self.model_args
        return scaled_rope_cache(a.head_dim, a.max_seq_len, a.rope_theta, scaling)


# --- end of the RoPE scaling / Llama-3 block -------------------------------------------------


def model_args(m: ModelConfig) -> Qwen3ModelArgs:
    moe = (
        {"moe_enabled": True, "moe_inter_dim": m.moe_hidden_dim, "moe_args": moe_args(m)} if m.is_moe else {}
    )
    return RelayQwen3ModelArgs(
        rope_scaling=m.rope_scaling,
        dim=m.dim,
        n_layers=m.n_layers,
        n_heads=m.n_heads,
        n_kv_heads=m.n_kv_heads,
        vocab_size=m.vocab_size,
        head_dim=m.head_dim,
        hidden_dim=m.hidden_dim,
        norm_eps=m.norm_eps,
        rope_theta=m.rope_theta,
        qk_norm=m.qk_norm,
        max_seq_len=m.max_seq_len,
        enable_weight_tying=m.tie_embeddings,
        # SDPA: FlexAttention has no CPU backward.
        attn_type="sdpa",
        attn_mask_type="causal",
        **moe,  # type: ignore[arg-type]
    )


def build_model(
    m: ModelConfig,
    seed: int | None = None,
    device: str | torch.device = "cpu",
    init_std: float | None = None,
) -> Qwen3Model | RelayDeepSeekV3Model | NemotronHModel:
    """torchtitan's init; with `init_std`, tied embeddings (untied: the output matrix) are re-drawn
    with that std (see below).

    Why: torchtitan gives the tied embedding/output matrix std dim**-0.5. At init the residual
    stream is dominated by the input token's own embedding, so after the final RMSNorm the logit
    of "repeat the last token" is sqrt(dim) times larger than the others: for the debug model
    (dim 64) that is ~8 vs ~1 and the initial entropy is ~0.3 nats instead of ~log(vocab).
    A near-deterministic initial policy gives zero-advantage groups and RL barely starts. With
    std 0.02 the same ratio holds but all logits are small, so the policy starts near uniform.
    """
    with torch.device(device):
        # deepseek_v3: torchtitan's DeepSeek-V3 (MLA + DeepSeek MoE), trainer/moe_routing.py;
        # glm_moe_dsa: the same with the DSA indexer, trainer/glm5.py.
        if m.arch == "glm_moe_dsa":
            model = build_glm5(m)
        elif m.arch == "nemotron_h":
            model = build_nemotron(m)  # the hybrid Mamba-2 / attention / MoE stack, trainer/nemotron.py
        elif m.arch == "deepseek_v3":
            model = build_deepseek_v3(m)
        else:
            model = RelayQwen3Model(model_args(m))
        _moe_blocks(model, m)
    if m.arch not in OWN_ARCHS:
        residual_stream_like_engine(model, m.fp32_residual)
        for block in model.layers.values():
            block.attention.__class__ = RelayAttention  # same parameters and names: see its docstring
            block.attention_norm.__class__ = RelayRMSNorm
            block.ffn_norm.__class__ = RelayRMSNorm
        model.norm.__class__ = RelayRMSNorm
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(device))
        if m.arch in OWN_ARCHS and m.tie_embeddings:
            model.output.weight = model.tok_embeddings.weight  # torchtitan's DeepSeek never ties
        if init_std is not None:
            # Untied: the output matrix alone sets the initial logits; the same small std starts
            # the policy near uniform (nemotron_h has no tied head).
            head = model.tok_embeddings if m.tie_embeddings else model.output
            torch.nn.init.trunc_normal_(head.weight, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std)
    return model


class RelayAttention(Attention):
    """torchtitan's Qwen3 attention with the per-head q/k RMSNorm and RoPE computed in float32 and
    rounded once to the compute dtype, as the engine's fused GPU kernel (and its CPU path,
    services/engine/layers/rope.py norm_rope) computes them; cos/sin hold compute-dtype values, as in HF
    and the engine. torchtitan rounds to bf16 after the norm and after each RoPE op (with FSDP's
    bf16 parameters; CUDA autocast instead runs rms_norm and RoPE in float32 with float32 cos/sin):
    that one difference alone puts the engine and the FSDP trainer as far apart as all the others
    together (docs/replay.md). Installed by build_model on every Qwen3 / Llama block
    (`__class__` swap: same parameters, names and inner_attention, which trainer/attention.py
    replaces); attention types other than sdpa (the trainer's) run torchtitan's forward."""

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        attention_masks: Any,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.attn_type != "sdpa" or isinstance(self.wq.weight, DTensor):
            # (tensor parallelism: q_norm/k_norm are DTensor modules whose hooks convert their
            # inputs; FSDP2's unsharded parameters are plain tensors and take the path below)
            return super().forward(x, rope_cache, attention_masks, positions)
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        dt = xq.dtype  # the linears' output: bf16 under autocast or FSDP, else float32
        qf, kf = xq.float(), xk.float()
        if self.q_norm is not None and self.k_norm is not None:
            # The norm weights in the compute dtype's values, as the engine holds them.
            qw, kw = self.q_norm.weight.to(dt).float(), self.k_norm.weight.to(dt).float()
            qf = torch.nn.functional.rms_norm(qf, (self.head_dim,), qw, self.q_norm.eps)
            kf = torch.nn.functional.rms_norm(kf, (self.head_dim,), kw, self.k_norm.eps)
        # cos/sin in the compute dtype's values (HF's cos.to(x.dtype); the engine's rope tables are
        # cast with the model), the rotation in float32.
        rc = reshape_for_broadcast(rope_cache, xq, positions).to(dt).float()
        cos, sin = rc[..., : self.head_dim], rc[..., self.head_dim :]
        qf, kf = qf * cos + rotate_half(qf) * sin, kf * cos + rotate_half(kf) * sin
        out = self.inner_attention(
            qf.to(dt).transpose(1, 2),
            kf.to(dt).transpose(1, 2),
            xv.transpose(1, 2),
            scale=self.scaling,
            enable_gqa=self.enable_gqa,
        )
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class RelayRMSNorm(torch.nn.RMSNorm):
    """nn.RMSNorm that, under autocast, multiplies by its weight's autocast-dtype values: what the
    engine (bf16 weights) and the FSDP trainer (bf16 parameters) multiply by. Autocast runs
    rms_norm in float32 with the float32 master weight, and every other weight reaches its op
    cast to bf16 (the same rounding as the engine's), so after training (weights no longer bf16
    values) the norms were the one place the autocast trainer differed: 1.9e-3 mean |dlogp| with
    perturbed norm weights. Output float32, rounded by the next op as before.
    Installed by build_model on Qwen3 / Llama blocks and the final norm (`__class__` swap)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dev = x.device.type
        w = self.weight
        if isinstance(w, DTensor) and not isinstance(x, DTensor):
            # Tensor parallel replicates the norms' weights (trainer.parallel) and keeps the
            # residual stream local: the local copy is the whole weight.
            w = w.to_local()
        if w is not None and not isinstance(w, DTensor) and x.dtype == torch.float32 != w.dtype:
            # ModelConfig.fp32_residual with bf16 parameters (FSDP2's mixed precision): the float32
            # stream normalised and weighted in float32, rounded once to the parameters' dtype
            # (the next GEMM's input), as the engine's RMSNorm and fused add_rms_norm compute.
            y = torch.nn.functional.rms_norm(x, self.normalized_shape, w.float(), self.eps)
            return y.to(w.dtype)
        if w is None or isinstance(w, DTensor):
            return super().forward(x)
        if not torch.is_autocast_enabled(dev):
            return torch.nn.functional.rms_norm(x, self.normalized_shape, w, self.eps)
        wv = w.to(torch.get_autocast_dtype(dev)).float()
        with torch.autocast(dev, enabled=False):
            return torch.nn.functional.rms_norm(x.float(), self.normalized_shape, wv, self.eps)


def _round_to_autocast_dtype(_mod: torch.nn.Module, _inp: Any, out: torch.Tensor) -> torch.Tensor | None:
    dev = out.device.type
    if out.dtype == torch.float32 and torch.is_autocast_enabled(dev):
        return out.to(torch.get_autocast_dtype(dev))
    return None  # float32 training, or FSDP's bf16 compute: unchanged


def _embedding_fp32(_mod: torch.nn.Module, _inp: Any, out: torch.Tensor) -> torch.Tensor | None:
    """The float32 residual stream's start: the embedding row in the compute dtype's values (the
    engine's bf16 table; autocast's float32 master rows rounded), held in float32."""
    dev = out.device.type
    if out.dtype == torch.float32 and torch.is_autocast_enabled(dev):
        return out.to(torch.get_autocast_dtype(dev)).float()
    return None if out.dtype == torch.float32 else out.float()  # FSDP's bf16 table: upcast once


def residual_stream_like_engine(model: torch.nn.Module, fp32: bool) -> None:
    """Make the residual stream round where the engine's does (services/engine/models/causal_lm.py), as
    ModelConfig.fp32_residual says. Forward hooks, so torchtitan's blocks, activation checkpointing
    and compile are untouched.

    fp32 (default): the stream is float32 under autocast AND with FSDP2's bf16 parameters: the
    embedding output in bf16 values upcast once (_embedding_fp32); sublayer outputs stay bf16
    (every MoE output rounded to the compute dtype: under autocast torchtitan sums the experts in
    float32 and casts to its float32 input's dtype, the engine rounds that sum once to bf16), and
    torchtitan's `h = x + out` then adds in float32 by type promotion; RelayRMSNorm reads the
    float32 stream and rounds once to the next GEMM's dtype. FSDP2 must not cast the blocks'
    float32 inputs to bf16 (trainer/parallel.py apply_fsdp: cast_forward_inputs off, read from
    `model.fp32_residual`).

    bf16: under autocast (float32 weights) the embedding output, every MoE output and every block's
    output are rounded to bf16, as the engine, HF's bf16 model and the FSDP2 bf16 trainer keep
    the stream; without it autocast carries a float32 stream and the engine a bf16 one, a
    rounding difference in every layer that Router Replay cannot remove.
    A no-op outside autocast."""
    # Read by trainer/parallel.py apply_fsdp (FSDP2's input cast).
    model.fp32_residual = fp32  # type: ignore[assignment]
    embed = _embedding_fp32 if fp32 else _round_to_autocast_dtype
    model.tok_embeddings.register_forward_hook(embed)  # type: ignore[union-attr]
    for block in model.layers.values():  # type: ignore[union-attr]
        if getattr(block, "moe_enabled", False):
            block.moe.register_forward_hook(_round_to_autocast_dtype)
        if not fp32:
            block.register_forward_hook(_round_to_autocast_dtype)


class CountingReorderer(TokenReorderer):
    """torchtitan's TokenReorderer with the per-expert token count from count_per_expert: its histc
    has no CPU kernel for integer expert ids, and bincount syncs with the host on CUDA (the same
    counts, as int64, on any device)."""

    def forward(  # type: ignore[override]
        self, top_scores: torch.Tensor, selected_experts_indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        flat = selected_experts_indices.reshape(-1)
        num_tokens_per_expert = count_per_expert(flat, self.num_experts)
        order = torch.argsort(flat, stable=True)
        return top_scores.reshape(-1)[order], order, num_tokens_per_expert


def _moe_blocks(model: Qwen3Model, m: ModelConfig) -> None:
    """Make torchtitan's MoE blocks compute HF Qwen3-MoE on any device (see below)."""
    if not m.is_moe:
        return
    from trainer.replay import enable_router_replay  # (replay.py imports the batch modules)

    if m.arch in MLA_ARCHS:
        add_expert_bias(model, m)  # its leading dense layers are built by torchtitan's DeepSeek
    elif not m.is_hybrid:  # (nemotron_h: its MoE layers are the pattern's, with their bias)
        _dense_leading_layers(model, m)
    for block in model.layers.values():
        if block.moe_enabled:
            block.moe.reorderer = CountingReorderer(m.n_routed_experts, m.n_experts_per_tok)
            # Loop or grouped GEMMs, chosen by trainer.moe_grouped_mm at parallelize
            # (nemotron_h's squared-ReLU experts have both paths themselves).
            if not m.is_hybrid:
                block.moe.experts = routed_experts_like(block.moe.experts)
    # The router too counts with count_per_expert; outside trainer.replay.routing(...) it is exactly
    # torchtitan's token-choice top-k router.
    enable_router_replay(model)


def _dense_leading_layers(model: Qwen3Model, m: ModelConfig) -> None:
    """torchtitan's Qwen3 makes every layer MoE; HF Qwen3-MoE keeps `mlp_only_layers` dense.
    Swap the first `first_k_dense` blocks' MoE for a dense FeedForward (HF `mlp.*_proj` names)."""
    if not m.is_moe:
        return
    for i in range(m.first_k_dense):
        block = model.layers[str(i)]
        del block.moe
        block.moe_enabled = False
        block.feed_forward = FeedForward(dim=m.dim, hidden_dim=m.hidden_dim)


def moe_layer_ids(m: ModelConfig) -> list[int]:
    """Indices of the MoE layers, in the order of a RoutedExperts array's layer axis."""
    return m.moe_layers()


def adapter(m: ModelConfig) -> Qwen3StateDictAdapter | DeepSeekV3Adapter | NemotronHAdapter:
    """The one place that maps this architecture's torchtitan names to HF's (and back)."""
    if m.arch == "nemotron_h":
        return NemotronHAdapter(m)
    if m.arch == "glm_moe_dsa":
        return GlmMoeDsaAdapter(m)
    if m.arch == "deepseek_v3":
        return DeepSeekV3Adapter(m)
    return Qwen3StateDictAdapter(model_args(m), None)


def to_hf_state(m: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    hf = adapter(m).to_hf(state)
    if m.is_moe:  # (every MoE layout writes per-expert tensors)
        # The adapter splits each [experts, ...] tensor into views of one storage; safetensors
        # refuses tensors that share memory, so every expert gets its own copy.
        hf = {k: v.clone() if ".experts." in k else v for k, v in hf.items()}
    return hf


def from_hf_state(m: ModelConfig, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = adapter(m).from_hf(hf_state)
    if m.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return state


def save_weights_dir(
    m: ModelConfig, state: dict[str, torch.Tensor], dest: Path, meta: dict[str, Any]
) -> Path:
    """Write a full (unsharded, CPU) torchtitan state dict as an HF model directory."""
    tok = build_char_tokenizer()
    if tok.get_vocab_size() > m.vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens > model vocab_size {m.vocab_size}")
    with tempfile.TemporaryDirectory() as tdir:
        save_tokenizer(tok, Path(tdir), m.chat_template)
        return write_model_dir(dest, to_hf_state(m, state), hf_config(m, eos_id(tok)), Path(tdir), meta)


def load_weights_dir(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg, hf_state = read_model_dir(path)
    m = model_config_from_hf(cfg)
    if check_checkpoint(cfg, hf_state):
        # An fp8 checkpoint (HF quantization_config "fp8"): the trainer keeps high-precision
        # master weights, so the pairs are dequantised once, in float32 (no second rounding).
        hf_state = dequantize_state(hf_state, torch.float32)
    return m, from_hf_state(m, hf_state)
