"""One rank's shard of the engine's decoder (services/engine/models/causal_lm.CausalLM).

A rank's model is the single-rank CausalLM built for the rank's own shapes (`local_config`: its
attention heads and KV heads, its slice of the FFN width) with the modules that communicate put in:
the vocabulary-parallel embedding, row-parallel o_proj and down_proj (one all-reduce each), and the
MoE layers' expert-parallel (ep > 1) or tensor-parallel (ep = 1) versions. Module names and HF
parameter names are the single-rank ones, so `load_hf_state` loads the rank's slice of a
checkpoint (read through `slice_spec`, per-expert names made local by `local_state`) with the same
checks, and the attention code, the KV cache
(`KVCache.for_model(local_config(...))`: the rank's KV heads) and the routing store are unchanged.

MLA models (deepseek_v3, glm_moe_dsa) split their heads the same way (q_b_proj / q_proj and
kv_b_proj by heads, o_proj by its input): the low-rank down-projections, the cached latent and
GLM-5's DSA indexer are every head's, so every rank of a tp group keeps them whole.

nemotron_h splits its Mamba-2 layers by heads with their B/C groups (in_proj's z/x/dt rows of the
rank's heads and B/C rows of its groups, conv1d's channels likewise, out_proj by its input: one
all-reduce per layer, as attention's o_proj); each rank's state slots hold its heads' states
(`local_config`: mamba_n_heads / tp, mamba_n_groups / tp), under the slot numbers rank 0's
scheduler gives every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from ops.fp8.dispatch import prepare_cuda_kernel
from services.common.config import ModelConfig, ParallelConfig
from services.common.weights_dir import SCALE_SUFFIX
from services.common.weights_slice import SliceSpec
from services.engine.layers.moe import PER_EXPERT, MoE
from services.engine.models.causal_lm import CausalLM
from services.engine.models.registry import engine_model
from services.engine.parallel.experts import ExpertParallelMoE, TensorParallelMoE
from services.engine.parallel.fp8 import convert_parallel_model
from services.engine.parallel.group import EngineGroups
from services.engine.parallel.linear import RowParallelLinear, split_range
from services.engine.parallel.vocab import ShardedLogits, VocabParallelEmbedding

SPLIT_ARCHS = ("qwen3", "llama3", "qwen3_moe", "deepseek_v3", "glm_moe_dsa", "nemotron_h")


def check_supported(m: ModelConfig, par: ParallelConfig) -> None:
    if par.ranks > 1 and m.arch not in SPLIT_ARCHS:
        raise ValueError(f"the engine splits {', '.join(SPLIT_ARCHS)} over ranks; not arch {m.arch}")
    if m.is_hybrid:
        par.check(m, "parallel")  # its Mamba-2 heads split with whole B/C groups


def local_config(m: ModelConfig, par: ParallelConfig) -> ModelConfig:
    """The shapes one rank of a tp group builds: its heads, KV heads and FFN width (the routed
    experts' width too when they are tensor-parallel). The vocabulary and the experts' count stay
    global: the embedding, the head and the expert-parallel experts are built by their own layers."""
    tp = par.tp
    if tp == 1:
        return m
    update: dict[str, object] = {
        "n_heads": m.n_heads // tp,
        "n_kv_heads": max(1, m.n_kv_heads // tp),
        "hidden_dim": m.hidden_dim // tp if m.hidden_dim % tp == 0 else m.hidden_dim,
    }
    if m.is_moe and par.ep == 1:
        update["moe_hidden_dim"] = m.moe_hidden_dim // tp
    if m.is_hybrid and "M" in m.hybrid_pattern:
        update["mamba_n_heads"] = m.mamba_n_heads // tp
        update["mamba_n_groups"] = m.mamba_n_groups // tp
    return m.model_copy(update=update)


def build_parallel_model(
    m: ModelConfig,
    par: ParallelConfig,
    groups: EngineGroups,
    max_seq_len: int,
    attention_bias: bool,
    device: torch.device,
    dtype: torch.dtype,
    fp8: bool = False,
) -> CausalLM:
    """The rank's CausalLM, built on the meta device and materialised once on `device` (no
    full-size tensor is ever allocated); weights uninitialised until `load_hf_state`. `fp8`: its
    linears and experts FP8 from the start (parallel/fp8.py; loaded by layers/fp8.load_hf_state)."""
    check_supported(m, par)
    local = local_config(m, par)
    tp = groups.tp
    with torch.device("meta"):
        model = engine_model(local, max_seq_len, attention_bias)
        if model.lm_head is not None:
            model.lm_head = nn.Linear(m.dim, m.vocab_size // tp.size, bias=False)
        if m.is_hybrid:
            _split_hybrid(model, m, local, par, groups)
        else:
            model.model.embed_tokens = VocabParallelEmbedding(m.vocab_size, m.dim, tp)
            for layer in model.model.layers:
                attn = layer.self_attn
                layer.mlp = _split_ffn(layer.mlp, m, local, par, groups)
                o = attn.o_proj  # (MLA's reads heads x v_head_dim)
                attn.o_proj = RowParallelLinear(o.in_features, m.dim, tp, bias=o.bias is not None)
        model = model.to(dtype)
        if fp8:
            convert_parallel_model(model)  # after the cast: it would turn fp8 buffers into dtype
    model = model.to_empty(device=device)
    model.reset_rope()
    if fp8:
        prepare_cuda_kernel(device)
    return model


def _split_ffn(
    mlp: nn.Module, m: ModelConfig, local: ModelConfig, par: ParallelConfig, groups: EngineGroups
) -> nn.Module:
    """A dense MLP with its down_proj row-parallel, or an MoE layer's expert- or tensor-parallel
    version."""
    if isinstance(mlp, MoE):
        index = mlp.moe_index
        return ExpertParallelMoE(m, index, groups) if par.ep > 1 else TensorParallelMoE(m, index, groups.tp)
    mlp.down_proj = RowParallelLinear(local.hidden_dim, m.dim, groups.tp)
    return mlp


def _split_hybrid(
    model: CausalLM, m: ModelConfig, local: ModelConfig, par: ParallelConfig, groups: EngineGroups
) -> None:
    """nemotron_h's layers (module docstring): each mixer's last projection row-parallel."""
    tp = groups.tp
    stack = model.backbone
    stack.embeddings = VocabParallelEmbedding(m.vocab_size, m.dim, tp)
    for layer in stack.layers:
        mixer = layer.mixer
        if layer.kind == "M":
            mixer.out_proj = RowParallelLinear(mixer.inner, m.dim, tp)
        elif layer.kind == "*":
            o = mixer.o_proj
            mixer.o_proj = RowParallelLinear(o.in_features, m.dim, tp, bias=o.bias is not None)
        else:
            layer.mixer = _split_ffn(mixer, m, local, par, groups)


def slice_spec(m: ModelConfig, par: ParallelConfig, groups: EngineGroups) -> SliceSpec:
    """Which part of each checkpoint tensor this rank reads (services/common/weights_slice.py)."""
    ep = groups.ep
    mamba = mamba_runs(m)
    return SliceSpec(groups.tp.rank, groups.tp.size, ep.rank, ep.size, kv_heads=m.n_kv_heads, mamba=mamba)


def mamba_runs(m: ModelConfig) -> tuple[int, int, int] | tuple[()]:
    """SliceSpec.mamba of the model: (x rows, B rows, heads) of a Mamba-2 layer, or () without one."""
    if m.is_hybrid and "M" in m.hybrid_pattern:
        return (m.mamba_n_heads * m.mamba_head_dim, m.mamba_n_groups * m.ssm_state_size, m.mamba_n_heads)
    return ()


def local_state(
    state: dict[str, torch.Tensor], m: ModelConfig, groups: EngineGroups
) -> dict[str, torch.Tensor]:
    """A rank's slices (read with `slice_spec`) under the names its model loads: per-expert
    tensors (and their FP8 scales) renumbered from the rank's first expert (the model's experts
    are indexed locally)."""
    if groups.ep.size == 1 or not m.is_moe:
        return state
    first, _ = split_range(m.n_routed_experts, groups.ep.size, groups.ep.rank)
    out = {}
    for name, t in state.items():
        # An FP8 checkpoint's block scales (X.weight_scale_inv) follow their weight's name.
        weight = name.removesuffix(SCALE_SUFFIX)
        hit = PER_EXPERT.match(weight)
        local = weight if hit is None else f"{hit[1]}.{int(hit[2]) - first}.{hit[3]}.weight"
        out[local + name[len(weight) :]] = t
    return out


def sharded_logits(model: CausalLM, hidden: torch.Tensor, groups: EngineGroups, vocab: int) -> ShardedLogits:
    """The rank's slice of the logits of `hidden`'s rows (CausalLM.logits on the rank's head rows)."""
    start, _ = split_range(vocab, groups.tp.size, groups.tp.rank)
    return ShardedLogits(model.logits(hidden), start, vocab, groups.tp)
