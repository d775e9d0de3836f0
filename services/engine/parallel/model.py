"""One rank's shard of the engine's decoder (services/engine/model.CausalLM).

A rank's model is the single-rank CausalLM built for the rank's own shapes (`local_config`: its
attention heads and KV heads, its slice of the FFN width) with the modules that communicate put in:
the vocabulary-parallel embedding, row-parallel o_proj and down_proj (one all-reduce each), and the
MoE layers' expert-parallel (ep > 1) or tensor-parallel (ep = 1) versions. Module names and HF
parameter names are the single-rank ones, so `load_hf_state` loads the rank's slice of a
checkpoint (`shard_state`) with the same checks, and the attention code, the KV cache
(`KVCache.for_model(local_config(...))`: the rank's KV heads) and the routing store are unchanged.

Tensor parallel covers the GQA families (qwen3, llama3, qwen3_moe); MLA models (deepseek_v3,
glm_moe_dsa) are not split yet.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from services.common.config import ModelConfig, ParallelConfig
from services.engine.model import CausalLM
from services.engine.moe import MoE
from services.engine.parallel.experts import ExpertParallelMoE, TensorParallelMoE
from services.engine.parallel.group import EngineGroups
from services.engine.parallel.linear import RowParallelLinear, kv_head_range, split_range
from services.engine.parallel.vocab import ShardedLogits, VocabParallelEmbedding

SPLIT_ARCHS = ("qwen3", "llama3", "qwen3_moe")

_ATTN = re.compile(r"\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)$")
_MLP = re.compile(r"\.mlp\.(shared_experts\.)?(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")


def check_supported(m: ModelConfig, par: ParallelConfig) -> None:
    if par.ranks > 1 and m.arch not in SPLIT_ARCHS:
        raise ValueError(f"the engine splits {', '.join(SPLIT_ARCHS)} over ranks; not arch {m.arch}")
    if par.dp_attention > 1:
        raise ValueError("the engine runs dp_attention = 1 (data-parallel attention scheduling is not built)")


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
    return m.model_copy(update=update)


def build_parallel_model(
    m: ModelConfig,
    par: ParallelConfig,
    groups: EngineGroups,
    max_seq_len: int,
    attention_bias: bool,
    device: torch.device,
    dtype: torch.dtype,
) -> CausalLM:
    """The rank's CausalLM, built on the meta device and materialised once on `device` (no
    full-size tensor is ever allocated); weights uninitialised until `load_hf_state`."""
    check_supported(m, par)
    local = local_config(m, par)
    tp = groups.tp
    with torch.device("meta"):
        model = CausalLM(local, max_seq_len, attention_bias)
        model.model.embed_tokens = VocabParallelEmbedding(m.vocab_size, m.dim, tp)
        if model.lm_head is not None:
            model.lm_head = nn.Linear(m.dim, m.vocab_size // tp.size, bias=False)
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.o_proj = RowParallelLinear(local.n_heads * m.head_dim, m.dim, tp)
            mlp = layer.mlp
            if isinstance(mlp, MoE):
                index = mlp.moe_index
                layer.mlp = (
                    ExpertParallelMoE(m, index, groups) if par.ep > 1 else TensorParallelMoE(m, index, tp)
                )
            else:
                mlp.down_proj = RowParallelLinear(local.hidden_dim, m.dim, tp)
    model = model.to(dtype).to_empty(device=device)
    model.reset_rope()
    return model


def shard_state(
    state: dict[str, torch.Tensor], m: ModelConfig, par: ParallelConfig, groups: EngineGroups
) -> dict[str, torch.Tensor]:
    """The rank's slice of a full HF state dict, under the single-rank names (per-expert tensors
    of other ranks' experts dropped, this rank's renumbered from 0). Slices are views where they
    are contiguous; load_hf_state copies them into the rank's parameters."""
    tp, ep = groups.tp, groups.ep
    first, last = split_range(m.n_routed_experts, ep.size, ep.rank) if m.is_moe else (0, 0)
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        hit = _EXPERT.match(name)
        if hit is not None and par.ep > 1:
            e = int(hit[2])
            if first <= e < last:
                out[f"{hit[1]}.{e - first}.{hit[3]}.weight"] = t
            continue
        out[name] = _slice(name, t, m, tp.size, tp.rank, par.ep > 1, (first, last))
    return out


def _slice(
    name: str, t: torch.Tensor, m: ModelConfig, tp: int, rank: int, ep: bool, experts: tuple[int, int]
) -> torch.Tensor:
    fused = _FUSED.search(name)
    if fused is not None and ep:
        return t[experts[0] : experts[1]]
    if tp == 1:
        return t
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return t.narrow(0, *_span(split_range(m.vocab_size, tp, rank)))
    attn = _ATTN.search(name)
    if attn is not None:
        proj, hd = attn[1], m.head_dim
        if proj in ("k_proj", "v_proj"):
            heads = kv_head_range(m.n_kv_heads, tp, rank)
        else:
            heads = split_range(m.n_heads, tp, rank)
        rows = (heads[0] * hd, heads[1] * hd)
        if proj == "o_proj":
            return t.narrow(1, *_span(rows)) if attn[2] == "weight" else t
        return t.narrow(0, *_span(rows))
    mlp = _MLP.search(name)
    if mlp is not None:
        width = m.shared_width if mlp[1] else m.hidden_dim
        part = _span(split_range(width, tp, rank))
        return t.narrow(1, *part) if mlp[2] == "down_proj" else t.narrow(0, *part)
    hit = _EXPERT.match(name)
    if hit is not None:  # tensor-parallel experts: each expert's width split
        part = _span(split_range(m.moe_hidden_dim, tp, rank))
        return t.narrow(1, *part) if hit[3] == "down_proj" else t.narrow(0, *part)
    if fused is not None:
        s, e = split_range(m.moe_hidden_dim, tp, rank)
        if fused[1] == "down_proj":
            return t[:, :, s:e]
        return torch.cat([t[:, s:e], t[:, m.moe_hidden_dim + s : m.moe_hidden_dim + e]], dim=1)
    return t  # norms, the router, q/k norms: on every rank


def _span(r: tuple[int, int]) -> tuple[int, int]:
    """(start, end) -> (start, length), narrow's arguments."""
    return r[0], r[1] - r[0]


def sharded_logits(model: CausalLM, hidden: torch.Tensor, groups: EngineGroups, vocab: int) -> ShardedLogits:
    """The rank's slice of the logits of `hidden`'s rows (CausalLM.logits on the rank's head rows)."""
    start, _ = split_range(vocab, groups.tp.size, groups.tp.rank)
    return ShardedLogits(model.logits(hidden), start, vocab, groups.tp)
