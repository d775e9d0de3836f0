"""DeepSeek-V3-style MoE in the trainer: torchtitan's DeepSeek-V3 model configured from ModelConfig.

arch "deepseek_v3" (DeepSeek-V3, Kimi-K2) trains on torchtitan 0.2.2's DeepSeekV3Model: MLA
attention, `first_k_dense` dense layers, then MoE layers whose router is torchtitan's
TokenChoiceTopKRouter (made a trainer.replay.ReplayRouter) computing HF DeepseekV3MoE's function:

    scores  = sigmoid(gate(x)) (float32)             score_func = router_score
    choice  = scores + e_score_correction_bias       selection only: a persistent float32 buffer
    groups  : the topk_group groups with the best top-2 sums (num_expert_groups / num_limited_groups)
    weights = scores[ids] / sum (norm_topk_prob) * routed_scaling_factor
    out     = sum_k weights_k expert_k(x) + shared_experts(x)

The correction bias is a buffer, not a parameter: it has no gradient in DeepSeek (it is set by
the aux-loss-free balancing rule during pre-training), and relay does not update it, so the
published weights keep describing the engine's routing. Weights convert to/from HF DeepSeek-V3
names through torchtitan's DeepSeekV3StateDictAdapter (`DeepSeekV3Adapter` adds tied embeddings).

Not covered: glm_moe_dsa (its DSA indexer is not in the trainer), YaRN RoPE (refused, as the engine
refuses it), deepseek_v3 without MLA (no HF model has that layout).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs
from torchtitan.models.deepseek_v3.model.model import DeepSeekV3Model
from torchtitan.models.deepseek_v3.model.state_dict_adapter import DeepSeekV3StateDictAdapter
from torchtitan.models.moe import MoEArgs

from services.common.config import ModelConfig


def deepseek_moe_args(m: ModelConfig) -> MoEArgs:
    """torchtitan MoE settings computing HF DeepseekV3MoE's function."""
    if m.n_group > 1 and m.n_routed_experts // m.n_group < 2:
        # HF and torchtitan score a group by its top-2 experts.
        raise ValueError("model.n_group: group-limited routing needs >= 2 experts per group")
    return MoEArgs(
        num_experts=m.n_routed_experts,
        num_shared_experts=m.n_shared_experts,
        score_func=m.router_score,
        route_norm=m.norm_topk_prob,
        route_scale=m.routed_scaling_factor,
        gate_bias=False,
        # HF weights each expert's OUTPUT by its gate weight (the SwiGLU is not linear).
        score_before_experts=False,
        top_k=m.n_experts_per_tok,
        num_expert_groups=m.n_group if m.n_group > 1 else None,
        num_limited_groups=m.topk_group if m.n_group > 1 else None,
        # For-loop experts: in the parameters' dtype on any device (grouped GEMM casts to bf16).
        use_grouped_mm=False,
        # None: torchtitan would otherwise own (and update) expert_bias; add_expert_bias registers
        # the checkpoint's e_score_correction_bias instead, which nothing updates.
        load_balance_coeff=None,
    )


def deepseek_args(m: ModelConfig) -> DeepSeekV3ModelArgs:
    if not (m.is_moe and m.is_mla):
        raise ValueError(
            "model.arch: the trainer's deepseek_v3 needs MLA (kv_lora_rank > 0) and MoE (n_routed_experts > 0)"
        )
    if m.rope_scaling is not None:
        raise ValueError("model.rope_scaling: not supported for deepseek_v3 in the trainer")
    args = DeepSeekV3ModelArgs(
        max_seq_len=m.max_seq_len,
        vocab_size=m.vocab_size,
        dim=m.dim,
        inter_dim=m.hidden_dim,
        moe_inter_dim=m.moe_hidden_dim,
        n_layers=m.n_layers,
        n_dense_layers=m.first_k_dense,
        n_heads=m.n_heads,
        norm_eps=m.norm_eps,
        moe_args=deepseek_moe_args(m),
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        # SDPA: FlexAttention has no CPU backward (trainer.attention wraps it for packing).
        attn_type="sdpa",
        attn_mask_type="causal",
        # original_seq_len = max_seq_len: no YaRN (precompute_freqs_cis and the softmax mscale
        # apply it only beyond original_seq_len); plain interleaved RoPE as HF rope_interleave.
        original_seq_len=m.max_seq_len,
        rope_theta=m.rope_theta,
        rope_factor=1.0,
    )
    # Set by torchtitan's update_from_config (a JobConfig we do not have): the plain all-to-all MoE.
    args.moe_impl = "standard"  # type: ignore[attr-defined]
    return args


class RelayDeepSeekV3Model(DeepSeekV3Model):
    """torchtitan's DeepSeekV3Model with HF's final-norm epsilon (torchtitan's final nn.RMSNorm
    uses torch's default eps, HF DeepSeek-V3 uses rms_norm_eps)."""

    def __init__(self, args: DeepSeekV3ModelArgs) -> None:
        super().__init__(args)
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)


def build_deepseek_v3(m: ModelConfig) -> RelayDeepSeekV3Model:
    return RelayDeepSeekV3Model(deepseek_args(m))


def add_expert_bias(model: nn.Module, m: ModelConfig) -> None:
    """Give every MoE block the checkpoint's `e_score_correction_bias` as its `expert_bias`:
    torchtitan's MoE passes it to the router, which adds it for selection only. A persistent
    float32 buffer (state-dict name `layers.<i>.moe.expert_bias`), zeros until loaded."""
    if not m.expert_bias:
        return
    for block in model.layers.values():  # type: ignore[union-attr]
        if not getattr(block, "moe_enabled", False):
            continue
        moe = block.moe
        ref = moe.router.gate.weight
        del moe.expert_bias  # a plain None attribute when load_balance_coeff is None
        moe.register_buffer(
            "expert_bias", torch.zeros(m.n_routed_experts, dtype=torch.float32, device=ref.device)
        )


class DeepSeekV3Adapter(DeepSeekV3StateDictAdapter):
    """torchtitan's DeepSeek-V3 <-> HF names, plus tied embeddings (no lm_head.weight written)."""

    def __init__(self, m: ModelConfig) -> None:
        super().__init__(deepseek_args(m), None)
        self.tied = m.tie_embeddings

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.tied:
            state_dict = {k: v for k, v in state_dict.items() if k != "output.weight"}
        return super().to_hf(state_dict)
