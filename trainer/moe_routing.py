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

GLM-5 (glm_moe_dsa) is this model plus the DSA indexer: trainer/glm5.py. Not covered: YaRN RoPE
(refused, as the engine refuses it), deepseek_v3 without MLA (no HF model has that layout).

The routed experts of every trainer MoE (qwen3_moe and deepseek_v3) are `RoutedExperts` (below):
torchtitan's per-expert loop, or torch._grouped_mm GEMMs per `trainer.moe_grouped_mm`, and token
counts per expert without a host sync (`count_per_expert`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs
from torchtitan.models.deepseek_v3.model.model import DeepSeekV3Model
from torchtitan.models.deepseek_v3.model.state_dict_adapter import DeepSeekV3StateDictAdapter
from torchtitan.models.moe import MoEArgs
from torchtitan.models.moe import moe as tt_moe
from torchtitan.models.moe.moe import GroupedExperts
from torchtitan.models.moe.utils import indices_padding_wrapper

from services.common.config import ModelConfig, YarnScaling


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
        # Built as the per-expert loop; trainer.moe_grouped_mm switches it (RoutedExperts, below).
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
    yarn = m.rope_scaling if isinstance(m.rope_scaling, YarnScaling) else None
    if m.rope_scaling is not None and yarn is None:
        raise ValueError("model.rope_scaling: only yarn applies to deepseek_v3 / glm_moe_dsa")
    # torchtitan applies YaRN (frequencies and the softmax mscale) only when its RoPE table is
    # longer than original_seq_len; HF applies it at every length: a yarn model's table is at
    # least one past the original context, so both always compute the extended RoPE.
    rope: dict[str, Any] = {"original_seq_len": m.max_seq_len, "rope_factor": 1.0}
    table = m.max_seq_len
    if yarn is not None:
        rope = {
            "original_seq_len": yarn.original_max_position_embeddings,
            "rope_factor": yarn.factor,
            "beta_fast": yarn.beta_fast,
            "beta_slow": yarn.beta_slow,
            "mscale": yarn.mscale_all_dim,
        }
        table = max(m.max_seq_len, yarn.original_max_position_embeddings + 1)
    args = DeepSeekV3ModelArgs(
        max_seq_len=table,
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
        # Interleaved RoPE as HF rope_interleave; without yarn original_seq_len = max_seq_len, so
        # precompute_freqs_cis and the softmax mscale leave it plain.
        rope_theta=m.rope_theta,
        **rope,
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


# HF's q_a_layernorm / kv_a_layernorm are built with the RMSNorm default eps, not rms_norm_eps
# (torchtitan gives them norm_eps; the engine's LATENT_NORM_EPS).
LATENT_NORM_EPS = 1e-6


def build_deepseek_v3(m: ModelConfig) -> RelayDeepSeekV3Model:
    model = RelayDeepSeekV3Model(deepseek_args(m))
    latent_norm_eps(model)
    return model


def latent_norm_eps(model: nn.Module) -> None:
    for block in model.layers.values():  # type: ignore[union-attr]
        for norm in (getattr(block.attention, "q_norm", None), block.attention.kv_norm):
            if norm is not None:
                norm.eps = LATENT_NORM_EPS


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


# ------------------------------------------------------------------ routed experts (both archs)


def count_per_expert(ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Tokens per expert, int64 [n_experts], for expert ids of any shape (int64).

    Not torch.bincount: on CUDA it reads the ids' min and max back to the host to size its output,
    a device sync in every MoE layer's router and reorderer, forward and SAC recompute alike (the
    host then waits instead of queueing the next kernels). Not torchtitan's histc: no CPU kernel
    for integer ids. A scatter-add of ones into a fixed-size vector has neither problem, is exact
    in int64 and traces under torch.compile(fullgraph=True) (static output shape)."""
    flat = ids.reshape(-1)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


def grouped_mm_enabled(setting: str, device: torch.device, dtype: str) -> bool:
    """trainer.moe_grouped_mm -> whether the routed experts run torch._grouped_mm.

    "auto": on for bf16 on CUDA (the fast path: one GEMM per projection for all local experts, no
    per-layer host sync for the loop's split sizes); off otherwise, where the float32 loop is the
    reference (torch._grouped_mm also runs on CPU, in float32 and bf16, through torch's fallback:
    "on" uses it there, which is how the tests compare the two paths)."""
    if setting == "auto":
        return device.type == "cuda" and dtype == "bfloat16"
    return setting == "on"


def set_grouped_mm(model: nn.Module, on: bool) -> int:
    """Switch every MoE block's routed experts to the grouped GEMMs (or back to the loop). Returns
    the number of MoE blocks switched (0 for a dense model)."""
    n = 0
    for block in model.layers.values():  # type: ignore[union-attr]
        if getattr(block, "moe_enabled", False):
            block.moe.experts.use_grouped_mm = on
            n += 1
    return n


def _grouped_mm_native(
    w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """torchtitan's _run_experts_grouped_mm in the inputs' own dtype (torchtitan's always casts to
    bf16): the loop's math, one grouped GEMM per projection. Rows past the last group are left as
    the GEMM leaves them (torchtitan's padding paths drop them)."""
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
    h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)


class RoutedExperts(GroupedExperts):
    """torchtitan's GroupedExperts (same parameters w1/w2/w3 [experts, ...], same names) whose grouped
    path keeps float32 in float32.

    - loop (`use_grouped_mm = False`): torchtitan's per-expert loop, in the parameters' dtype; one
      host sync per call (its split sizes are a Python list).
    - grouped, bf16 (FSDP2 bf16 params, or autocast): torchtitan's `_run_experts_grouped_mm`, looked
      up at call time so that trainer.compile's compiled version (torchtitan's apply_compile
      replaces the module function) is the one that runs.
    - grouped, float32: the same GEMMs in float32 (torch._grouped_mm's fallback on CPU), so the two
      paths can be compared to float32 rounding.

    Token order and counts come from the reorderer (and, with EP, from torchtitan's dispatch), which
    are fed by the router's ids: with Router Replay the recorded ids drive these GEMMs exactly as
    they drive the loop. Without EP on CUDA, torchtitan pads every expert's rows to its grouped-GEMM
    alignment first (its indices_padding_wrapper); with EP its dispatch already did; on CPU the
    fallback needs no alignment."""

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return self.run(*self.local_weights(), x, num_tokens_per_expert)

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """w1, w2, w3 as plain tensors (an EP shard's local experts under DTensor)."""
        return tuple(w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))  # type: ignore[return-value]

    def run(
        self, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """This module's function with the given (local) weights: the loop or the grouped GEMMs."""
        if not self.use_grouped_mm:
            return tt_moe._run_experts_for_loop(w1, w2, w3, x, counts)
        mesh_dims = self.w1.device_mesh.mesh_dim_names if isinstance(self.w1, DTensor) else None
        ep = "ep" in (mesh_dims or ())
        dev, out_dtype = x.device.type, x.dtype
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else w1.dtype
        if dtype == torch.bfloat16:
            fn = tt_moe._run_experts_grouped_mm
        else:
            fn = _grouped_mm_native
            x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
        if not ep and dev == "cuda":
            fn = indices_padding_wrapper(fn)
        return fn(w1, w2, w3, x, counts).to(out_dtype)


def routed_experts_like(old: GroupedExperts) -> RoutedExperts:
    """A RoutedExperts holding `old`'s parameters (same tensors, so same names and values)."""
    w1 = old.w1
    with torch.device("meta"):  # its own placeholders are replaced at once: allocate nothing
        new = RoutedExperts(
            dim=w1.shape[2], hidden_dim=w1.shape[1], num_experts=old.num_experts, use_grouped_mm=False
        )
    new.w1, new.w2, new.w3 = old.w1, old.w2, old.w3
    new.use_grouped_mm = old.use_grouped_mm
    return new
