"""The causal LM every family builds on (models/<family>.py gives its decoder layer), in plain
PyTorch, with HF parameter names, for inference.

It computes the same function as the trainer's torchtitan Qwen3Model (same RoPE cache, same
rotate_half convention, same RMSNorm and attention scale), so log-probs computed here match the
trainer's up to float rounding. Module names follow HF (`model.layers.0.self_attn.q_proj`), so an
HF state dict loads with `load_state_dict` and nothing to rename.

The forward pass works on a *flat* batch of tokens (all sequences of a step concatenated), which
keeps the linear layers free of padding; only attention needs per-sequence structure, which it
gets from `ForwardBatch` and the KV cache (see batch.py and kv_cache.py).

MoE models (qwen3_moe, deepseek_v3, glm_moe_dsa) replace the MLP of layers first_k_dense.. by
layers/moe.MoE, which also records each token's expert ids in the cache's routing store; MLA
models replace the attention by layers/mla.MLAttention. The dense path is unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ops.pdl import scope as pdl_scope
from services.common.config import ModelConfig
from services.engine.batch import ForwardBatch
from services.engine.kv_cache import KVCache
from services.engine.layers.attention import Attention
from services.engine.layers.embed_head import head_logits
from services.engine.layers.mlp import MLP
from services.engine.layers.moe import PER_EXPERT, ExpertWeights, Router
from services.engine.layers.norm import RMSNorm
from services.engine.layers.rope import rope_cache
from services.engine.models.decoder import DecoderLayer
from services.engine.models.deepseek_v3 import DeepseekV3DecoderLayer
from services.engine.models.glm5 import GlmMoeDsaDecoderLayer
from services.engine.models.qwen3 import Qwen3DecoderLayer
from services.engine.models.qwen3_moe import Qwen3MoeDecoderLayer
from services.engine.weight_copy import copy_weight

if TYPE_CHECKING:
    from services.engine.kernels.megakernel import DecodeMegakernel

# Each architecture's decoder layer (ModelConfig.arch).
DECODER_LAYERS: dict[str, type[DecoderLayer]] = {
    "qwen3": Qwen3DecoderLayer,
    "llama3": Qwen3DecoderLayer,
    "qwen3_moe": Qwen3MoeDecoderLayer,
    "deepseek_v3": DeepseekV3DecoderLayer,
    "glm_moe_dsa": GlmMoeDsaDecoderLayer,
}


def decoder_layer(m: ModelConfig) -> type[DecoderLayer]:
    if m.arch not in DECODER_LAYERS:
        raise ValueError(f"arch: the engine does not serve {m.arch!r} (it serves {sorted(DECODER_LAYERS)})")
    return DECODER_LAYERS[m.arch]


class DecoderStack(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, m: ModelConfig, bias: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(m.vocab_size, m.dim)
        layer = decoder_layer(m)
        self.layers = nn.ModuleList(layer(m, i, bias) for i in range(m.n_layers))
        self.norm = RMSNorm(m.dim, m.norm_eps)


class CausalLM(nn.Module):
    """Qwen3ForCausalLM / LlamaForCausalLM / Qwen3MoeForCausalLM / DeepseekV3ForCausalLM /
    GlmMoeDsaForCausalLM (MoE: layers/moe.py, MLA and DSA: layers/mla.py). `forward` returns final hidden
    states for the flat batch; `logits` projects only the rows the caller needs (one per sequence
    when sampling)."""

    def __init__(self, m: ModelConfig, max_seq_len: int, attention_bias: bool = False):
        super().__init__()
        self.config = m
        self.build_stack(m, attention_bias)
        self.lm_head = None if m.tie_embeddings else nn.Linear(m.dim, m.vocab_size, bias=False)
        self.max_seq_len = max_seq_len
        cos, sin = self._rope()
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # Set by the engine on the GPU path: paged batches run the fused residual-add + RMSNorm and
        # SiLU-mul kernels (ops/fused_norm.py, 3 kernels fewer per layer); the CPU path keeps
        # the torch ops bit for bit.
        self.fused_elementwise = False
        # Set by the engine: EngineConfig.pdl as resolved for its device (ops/pdl.py); the
        # Triton kernels of each forward launch with Programmatic Dependent Launch if True.
        self.pdl = False
        # Set by the engine from EngineConfig.logits_fp32 (see logits()).
        self.logits_fp32 = True
        # ModelConfig.fp32_residual (the checkpoint's config.json, as the trainer's): the hidden
        # state between layers is float32 (the embedding upcast once, every residual add in
        # float32, each RMSNorm reading it and writing the model-dtype input of the next GEMM).
        self.fp32_residual = m.fp32_residual
        # Set by the engine (EngineConfig.megakernel): kernels.megakernel.DecodeMegakernel, which
        # runs every layer of a one-token decode batch in one launch.
        self.megakernel: DecodeMegakernel | None = None

    def build_stack(self, m: ModelConfig, attention_bias: bool) -> None:
        """The decoder under its HF prefix (`model.`); a family with another layout overrides it."""
        self.model = DecoderStack(m, attention_bias)

    def _rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.config
        # MLA rotates only the qk_rope_head_dim part of each head.
        rope_dim = m.qk_rope_head_dim if m.is_mla else m.head_dim
        return rope_cache(rope_dim, self.max_seq_len, m.rope_theta, m.rope_scaling)

    def reset_rope(self) -> None:
        """Recompute the rope tables (not part of any checkpoint) in the buffers' device and dtype,
        as construction + `.to()` leave them: for a model built on the meta device and
        materialised with `to_empty` (build_fp8_model)."""
        cos, sin = (t.to(self.rope_cos.device, torch.float32).to(self.rope_cos.dtype) for t in self._rope())
        self.rope_cos, self.rope_sin = cos, sin

    def fuse_projections(self) -> list[str]:
        """GPU path: q/k/v and gate/up of every dense attention/MLP become one GEMM each (fuse_rows;
        used on paged batches), in bf16 and in FP8. Call after .to() and after any fp8 conversion.
        Returns the fused modules' names."""
        done = []
        for name, mod in self.named_modules():
            if isinstance(mod, Attention | MLP) and mod.fuse():
                done.append(name)
        return done

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        # The PDL setting reaches the kernel launchers through a context variable (ops/pdl.py),
        # so two engines in one process keep their own.
        with pdl_scope(self.pdl):
            return self._forward(batch, kv)

    def _forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        h = self.model.embed_tokens(batch.input_ids)
        if self.fp32_residual:
            h = h.float()  # sublayer outputs stay in the model dtype; `h + out` promotes
        paged = batch.paged
        if self.megakernel is not None and paged is not None and paged.prefill is None and h.shape[0] == 1:
            dec = paged.decode
            assert dec is not None
            h = self.megakernel.run(h, batch.positions, batch.slot_mapping, dec.ctx_lens, dec.block_tables[0])
            return self.model.norm(h)
        # (after the megakernel's branch: it reads the tables at the position itself)
        cos, sin = self.rope_cos[batch.positions], self.rope_sin[batch.positions]
        if self.fused_elementwise and paged is not None:
            from ops.fused_norm import add_rms_norm

            delta: torch.Tensor | None = None
            for layer in self.model.layers:
                h, delta = layer.forward_fused(h, delta, cos, sin, batch, kv)
            norm = self.model.norm
            return norm(h) if delta is None else add_rms_norm(h, delta, norm.weight, norm.eps)[1]
        for layer in self.model.layers:
            h = layer(h, cos, sin, batch, kv)
        return self.model.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, dim] -> [rows, vocab]. With `logits_fp32` (EngineConfig.logits_fp32, default on)
        float32: the model-dtype GEMM's float32 accumulator, not rounded to bf16, exactly as the
        trainer's head computes it (ops/lm_head.py); else in the model dtype."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return head_logits(hidden, weight, self.logits_fp32)

    @torch.no_grad()
    def load_hf_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy an HF state dict into the existing parameters (in place: no reallocation, so a
        weight update between steps costs one copy per tensor and the module graph is unchanged).
        Raises ValueError naming missing/unexpected/mis-shaped tensors."""
        params = dict(self.named_parameters())
        state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
        if self.lm_head is None:
            # Tied checkpoints may still carry a (redundant) lm_head copy.
            state.pop("lm_head.weight", None)
        state, per_expert = _split_experts(_drop_mtp_layers(state, self.config), self)
        missing = sorted(set(params) - set(state))
        unexpected = sorted(set(state) - set(params))
        if missing or unexpected:
            raise ValueError(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name, p in params.items():
            src = state[name]
            if src is p:
                continue  # fused experts given per expert: filled below
            if src.shape != p.shape:
                raise ValueError(f"{name}: shape {tuple(src.shape)} != expected {tuple(p.shape)}")
            copy_weight(p, src)
        for experts, tensors in per_expert:
            experts.load_per_expert(tensors)
        for mod in self.modules():
            if isinstance(mod, Router):  # the gate in the model dtype's values (Router.round_weight_)
                mod.round_weight_()


def _drop_mtp_layers(state: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """DeepSeek-style checkpoints ship their multi-token-prediction layers as model.layers.<n_layers
    + i>; the engine does not run them (HF ignores them too)."""
    if not m.n_mtp_layers:
        return state
    mtp = tuple(f"model.layers.{i}." for i in range(m.n_layers, m.n_layers + m.n_mtp_layers))
    return {k: v for k, v in state.items() if not k.startswith(mtp)}


def _split_experts(
    state: dict[str, torch.Tensor], model: nn.Module
) -> tuple[dict[str, torch.Tensor], list[tuple[ExpertWeights, dict[tuple[int, str], torch.Tensor]]]]:
    """Take per-expert tensors (mlp.experts.<e>.{gate,up,down}_proj.weight) out of `state`, by
    module. A module whose experts are all there counts as providing its fused parameters; a
    partial set leaves those missing (an error). Fused tensors (transformers' in-memory names)
    pass as is."""
    modules = dict(model.named_modules())
    found: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    rest: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        hit = PER_EXPERT.match(k)
        if hit is None or not isinstance(modules.get(hit[1]), ExpertWeights):
            rest[k] = v  # unknown names stay, so the mismatch check reports them
        else:
            found.setdefault(hit[1], {})[(int(hit[2]), hit[3])] = v
    loads: list[tuple[ExpertWeights, dict[tuple[int, str], torch.Tensor]]] = []
    for prefix, items in found.items():
        experts = modules[prefix]
        assert isinstance(experts, ExpertWeights)
        want = {(e, proj) for e in range(experts.n_experts) for proj in experts.PROJS}
        if set(items) != want:
            missing = sorted(want - set(items))[:3]
            raise ValueError(f"{prefix}: per-expert tensors incomplete (missing {missing}, of {len(want)})")
        for name in experts.FUSED:
            if f"{prefix}.{name}" in rest:
                raise ValueError(f"{prefix}: both fused and per-expert tensors given")
            # Stand-ins of the right shape: the fused parameters are filled after.
            rest[f"{prefix}.{name}"] = getattr(experts, name)
        loads.append((experts, items))
    return rest, loads
