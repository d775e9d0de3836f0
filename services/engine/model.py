"""A Qwen3/Llama-style decoder in plain PyTorch, with HF parameter names, for inference.

It computes the same function as the trainer's torchtitan Qwen3Model (same RoPE cache, same
rotate_half convention, same RMSNorm and attention scale), so log-probs computed here match the
trainer's up to float rounding. Module names follow HF (`model.layers.0.self_attn.q_proj`), so an
HF state dict loads with `load_state_dict` and nothing to rename.

The forward pass works on a *flat* batch of tokens (all sequences of a step concatenated), which
keeps the linear layers free of padding; only attention needs per-sequence structure, which it
gets from `ForwardBatch` and the KV cache (see batch.py and kv_cache.py).

MoE models (qwen3_moe, deepseek_v3, glm_moe_dsa) replace the MLP of layers first_k_dense.. by
moe.MoE, which also records each token's expert ids in the cache's routing store; MLA models
replace the attention by mla.MLAttention. The dense path is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ops.lm_head import float32_logits
from ops.pdl import scope as pdl_scope
from ops.rope import llama3_scale_freqs
from services.common.config import ModelConfig, RopeScaling
from services.engine.batch import ForwardBatch
from services.engine.kv_cache import KVCache
from services.engine.mla import MLAttention
from services.engine.moe import PER_EXPERT, ExpertWeights, MoE, Router
from services.engine.weight_copy import copy_weight

if TYPE_CHECKING:
    from services.engine.kernels.megakernel import DecodeMegakernel


def rope_cache(
    head_dim: int, max_seq_len: int, base: float, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [max_seq_len, head_dim], computed exactly like torchtitan's
    precompute_rope_cache (float32, frequencies duplicated for the rotate_half layout).
    `scaling`: Llama-3.1 frequency scaling, as HF's rope_type "llama3" (ops/rope.py)."""
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    if scaling is not None:
        freqs = llama3_scale_freqs(freqs, scaling)
    t = torch.arange(max_seq_len, dtype=freqs.dtype)
    angles = torch.outer(t, freqs).float()
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim] already gathered at each token's position."""
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    return x * cos + rotate_half(x) * sin


def norm_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
    """Qwen3's per-head q/k RMSNorm (when the model has it) and RoPE in float32, rounded once to
    x's dtype: what the GPU path's fused kernel computes (kernels/qk_rope.py) and what the trainer
    computes (trainer/model.py, RelayAttention), so the CPU path is the same function as the GPU
    one and both round where the trainer does. x: [T, heads, head_dim]; cos/sin as apply_rope (the
    rope tables are cast with the model, so in bf16 they hold bf16 values, as HF's cos/sin do)."""
    y = x.float()
    if norm is not None:
        y = F.rms_norm(y, (y.shape[-1],), norm.weight.float(), norm.eps)
    return apply_rope(y, cos, sin).to(x.dtype)


@dataclass(frozen=True)
class FusedRows:
    """Linears that read the same input (q/k/v, gate/up) as one GEMM: `weight` (and `bias`) are the
    concatenated rows, and each linear's own tensors are views of their row block, so HF names,
    state_dict and in-place weight loads keep working. `fp8` is set when the linears are FP8: the
    fused Fp8Linear (not a registered submodule, so weight loads still see only the HF names)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    fp8: nn.Module | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            return self.fp8(x)
        from services.engine.kernels.gemv import decode_linear

        return decode_linear(x, self.weight, self.bias)


def fuse_rows(linears: list[nn.Module]) -> FusedRows | None:
    """Fuse linears that read the same input into one GEMM (FusedRows). Call after the last .to()
    (which would re-allocate the views apart) and after any fp8 conversion. None when they cannot
    be fused: mixed kinds, or FP8 parts whose 128-row scale blocks would straddle two of them."""
    if all(type(lin) is nn.Linear for lin in linears):
        with torch.no_grad():
            weight = torch.cat([lin.weight for lin in linears])  # type: ignore[misc]
            biases = [lin.bias for lin in linears]
            bias = None
            if all(b is not None for b in biases):
                bias = torch.cat(biases)  # type: ignore[arg-type]
            elif any(b is not None for b in biases):
                return None
            row = 0
            for lin in linears:
                n = lin.weight.shape[0]  # type: ignore[union-attr]
                lin.weight = nn.Parameter(weight[row : row + n], requires_grad=False)
                if bias is not None:
                    lin.bias = nn.Parameter(bias[row : row + n], requires_grad=False)
                row += n
        return FusedRows(weight, bias)
    from services.engine.fp8_linear import fuse_fp8_rows

    fused = fuse_fp8_rows(linears)
    if fused is None:
        return None
    return FusedRows(fused.weight_fp8, fused.bias, fp8=fused)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype:
            # The float32 residual stream (ModelConfig.fp32_residual) of a lower-precision model:
            # normalise and weight in float32, round once to the model dtype (the next GEMM's
            # input), as ops/fused_norm.py add_rms_norm and the trainer's RelayRMSNorm do.
            y = F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps)
            return y.to(self.weight.dtype)
        # Same kernel as torch.nn.RMSNorm, which torchtitan uses.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, m: ModelConfig, layer_idx: int, bias: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = m.n_heads, m.n_kv_heads, m.head_dim
        self.scale = m.head_dim**-0.5
        self.q_proj = nn.Linear(m.dim, m.n_heads * m.head_dim, bias=bias)
        self.k_proj = nn.Linear(m.dim, m.n_kv_heads * m.head_dim, bias=bias)
        self.v_proj = nn.Linear(m.dim, m.n_kv_heads * m.head_dim, bias=bias)
        self.o_proj = nn.Linear(m.n_heads * m.head_dim, m.dim, bias=False)
        # Qwen3 normalises each head's q and k before RoPE; Llama/Qwen2 do not.
        self.q_norm = RMSNorm(m.head_dim, m.norm_eps) if m.qk_norm else None
        self.k_norm = RMSNorm(m.head_dim, m.norm_eps) if m.qk_norm else None
        # Set by fuse(): one [q + k + v, dim] GEMM whose weight's row blocks ARE q/k/v_proj's.
        self.qkv: FusedRows | None = None

    def fuse(self) -> bool:
        """One GEMM instead of three (fuse_rows); False when nothing could be fused."""
        self.qkv = fuse_rows([self.q_proj, self.k_proj, self.v_proj])
        return self.qkv is not None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, kv: KVCache
    ) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv is not None and batch.paged is not None:
            nq, nkv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
            q, k, v = self.qkv(x).split([nq, nkv, nkv], dim=-1)  # strided views
            q = q.view(t, self.n_heads, self.head_dim)
            k = k.view(t, self.n_kv_heads, self.head_dim)
            v = v.view(t, self.n_kv_heads, self.head_dim)
        else:
            q = self.q_proj(x).view(t, self.n_heads, self.head_dim)
            k = self.k_proj(x).view(t, self.n_kv_heads, self.head_dim)
            v = self.v_proj(x).view(t, self.n_kv_heads, self.head_dim)
        if batch.paged is not None:
            # GPU path (attention_backend "triton", services/engine/kernels/): one kernel
            # normalises and rotates q/k and stores k/v in the page pool, then attention reads the
            # pool directly (no gathered copy). Imported here so the CPU path never loads Triton.
            from services.engine.kernels.paged_attention import attend
            from services.engine.kernels.qk_rope import qk_rope_store

            kc, vc = kv.k[self.layer_idx], kv.v[self.layer_idx]
            qn, kn = self.q_norm, self.k_norm
            q = qk_rope_store(
                q, k, v, cos, sin, None if qn is None else qn.weight, None if kn is None else kn.weight,
                0.0 if qn is None else qn.eps, kc, vc, batch.slot_mapping,
            )  # fmt: skip
            out = attend(q, kc, vc, batch.paged, self.scale, kv.block_size).view(t, -1)
            if type(self.o_proj) is nn.Linear:  # not an fp8-converted layer
                from services.engine.kernels.gemv import decode_linear

                return decode_linear(out, self.o_proj.weight, self.o_proj.bias)
            return self.o_proj(out)
        q, k = norm_rope(q, cos, sin, self.q_norm), norm_rope(k, cos, sin, self.k_norm)

        # New keys/values go into the cache first, so every query reads its whole context
        # (earlier steps' tokens and this step's) from one place.
        kv.store(self.layer_idx, batch.slot_mapping, k, v)
        out = torch.empty_like(q)
        for g in batch.groups:
            kc, vc = kv.load(self.layer_idx, g.block_tables)  # [B, ctx, n_kv, D], gathered by page
            qg = q[g.q_index]  # [B, Lq, H, D], padding rows read some real token and are dropped
            o = F.scaled_dot_product_attention(
                qg.transpose(1, 2),
                kc.transpose(1, 2),
                vc.transpose(1, 2),
                attn_mask=g.mask,
                scale=self.scale,
                enable_gqa=self.n_heads != self.n_kv_heads,
            )
            out[g.out_index] = o.transpose(1, 2)[g.q_valid]
        return self.o_proj(out.view(t, -1))


class MLP(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(m.dim, m.hidden_dim, bias=False)
        self.up_proj = nn.Linear(m.dim, m.hidden_dim, bias=False)
        self.down_proj = nn.Linear(m.hidden_dim, m.dim, bias=False)
        self.gate_up: FusedRows | None = None  # set by fuse()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def fuse(self) -> bool:
        """gate/up as one GEMM (fuse_rows); False when they could not be fused."""
        self.gate_up = fuse_rows([self.gate_proj, self.up_proj])
        return self.gate_up is not None

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """GPU path: SiLU and the product in one Triton kernel (ops/fused_norm.py)."""
        from ops.fused_norm import silu_mul
        from services.engine.kernels.gemv import decode_linear

        if self.gate_up is None:  # not fused: their own GEMMs
            return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # strided views: silu_mul reads strides
        act = silu_mul(gate, up)
        if type(self.down_proj) is nn.Linear:
            return decode_linear(act, self.down_proj.weight, self.down_proj.bias)
        return self.down_proj(act)


class DecoderLayer(nn.Module):
    def __init__(self, m: ModelConfig, layer_idx: int, bias: bool):
        super().__init__()
        self.self_attn: Attention | MLAttention = (
            MLAttention(m, layer_idx, bias) if m.is_mla else Attention(m, layer_idx, bias)
        )
        # MoE layers follow the first_k_dense dense ones (moe.py); their routing goes to the cache.
        moe = m.is_moe and layer_idx >= m.first_k_dense
        self.mlp: MLP | MoE = MoE(m, layer_idx - m.first_k_dense) if moe else MLP(m)
        self.input_layernorm = RMSNorm(m.dim, m.norm_eps)
        self.post_attention_layernorm = RMSNorm(m.dim, m.norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, kv: KVCache
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, kv)
        if not isinstance(self.mlp, MoE):
            return x + self.mlp(self.post_attention_layernorm(x))
        out, ids = self.mlp(self.post_attention_layernorm(x))
        kv.store_routing(self.mlp.moe_index, batch.slot_mapping, ids)
        return x + out

    def forward_fused(
        self,
        h: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        kv: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As forward, with the residual adds fused into the following RMSNorms (Triton): takes the
        residual stream h and the previous layer's not yet added MLP output `delta`, and returns
        the stream after attention and this layer's MLP output (added by the next norm)."""
        from ops.fused_norm import add_rms_norm

        ln, post = self.input_layernorm, self.post_attention_layernorm
        if delta is None:
            y = ln(h)
        else:
            h, y = add_rms_norm(h, delta, ln.weight, ln.eps)
        h, y = add_rms_norm(h, self.self_attn(y, cos, sin, batch, kv), post.weight, post.eps)
        if isinstance(self.mlp, MoE):
            out, ids = self.mlp(y)
            kv.store_routing(self.mlp.moe_index, batch.slot_mapping, ids)
            return h, out
        return h, self.mlp.forward_fused(y)


class DecoderStack(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, m: ModelConfig, bias: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(m.vocab_size, m.dim)
        self.layers = nn.ModuleList(DecoderLayer(m, i, bias) for i in range(m.n_layers))
        self.norm = RMSNorm(m.dim, m.norm_eps)


class CausalLM(nn.Module):
    """Qwen3ForCausalLM / LlamaForCausalLM / Qwen3MoeForCausalLM / DeepseekV3ForCausalLM /
    GlmMoeDsaForCausalLM (MoE: moe.py, MLA and DSA: mla.py). `forward` returns final hidden
    states for the flat batch; `logits` projects only the rows the caller needs (one per sequence
    when sampling)."""

    def __init__(self, m: ModelConfig, max_seq_len: int, attention_bias: bool = False):
        super().__init__()
        self.config = m
        self.model = DecoderStack(m, attention_bias)
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
        if self.logits_fp32:
            return float32_logits(hidden, weight)
        return F.linear(hidden, weight)

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
        for experts, index, proj, w in per_expert:
            experts.load_expert(index, proj, w)
        for mod in self.modules():
            if isinstance(mod, Router):  # the gate in the model dtype's values (Router.round_weight_)
                mod.round_weight_()


def build_fp8_model(
    m: ModelConfig, max_seq_len: int, attention_bias: bool, device: torch.device, dtype: torch.dtype
) -> CausalLM:
    """An engine model whose attention/MLP linears and experts are FP8 from the start: built on the
    meta device, converted to the FP8 layout there, then materialised on `device` (the rope tables
    recomputed). Its high-precision linear and expert weights never exist, so a model whose bf16
    weights do not fit the device (GLM-5, Kimi-K2: ~2x their FP8 bytes) can be served. The
    weights are not loaded: fp8_linear.load_hf_state fills it (quantising high-precision tensors,
    copying an FP8 checkpoint's pairs). Same layout, dtypes and names as
    CausalLM(...).to(device, dtype) + fp8_linear.convert_model."""
    from ops.fp8.dispatch import prepare_cuda_kernel
    from services.engine import fp8_linear

    with torch.device("meta"):
        model = CausalLM(m, max_seq_len, attention_bias).to(dtype)
    fp8_linear.convert_model(model, empty=True)
    model.to_empty(device=device)
    model.reset_rope()
    prepare_cuda_kernel(device)
    return model


def _drop_mtp_layers(state: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """DeepSeek-style checkpoints ship their multi-token-prediction layers as model.layers.<n_layers
    + i>; the engine does not run them (HF ignores them too)."""
    if not m.n_mtp_layers:
        return state
    mtp = tuple(f"model.layers.{i}." for i in range(m.n_layers, m.n_layers + m.n_mtp_layers))
    return {k: v for k, v in state.items() if not k.startswith(mtp)}


def _split_experts(
    state: dict[str, torch.Tensor], model: nn.Module
) -> tuple[dict[str, torch.Tensor], list[tuple[ExpertWeights, int, str, torch.Tensor]]]:
    """Take per-expert tensors (mlp.experts.<e>.{gate,up,down}_proj.weight) out of `state`. A module
    whose experts are all there counts as providing its fused gate_up_proj/down_proj; a partial
    set leaves those missing (an error). Fused tensors (transformers' in-memory names) pass as is."""
    modules = dict(model.named_modules())
    found: dict[str, list[tuple[int, str, torch.Tensor]]] = {}
    rest: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        hit = PER_EXPERT.match(k)
        if hit is None or not isinstance(modules.get(hit[1]), ExpertWeights):
            rest[k] = v  # unknown names stay, so the mismatch check reports them
        else:
            found.setdefault(hit[1], []).append((int(hit[2]), hit[3], v))
    loads: list[tuple[ExpertWeights, int, str, torch.Tensor]] = []
    for prefix, items in found.items():
        experts = modules[prefix]
        assert isinstance(experts, ExpertWeights)
        have = {(e, proj) for e, proj, _ in items}
        want = {(e, proj) for e in range(experts.n_experts) for proj in ("gate_proj", "up_proj", "down_proj")}
        if have != want:
            missing = sorted(want - have)[:3]
            raise ValueError(f"{prefix}: per-expert tensors incomplete (missing {missing}, of {len(want)})")
        for name in ("gate_up_proj", "down_proj"):
            if f"{prefix}.{name}" in rest:
                raise ValueError(f"{prefix}: both fused and per-expert tensors given")
            # Stand-ins of the right shape: the fused parameters are filled slice by slice after.
            rest[f"{prefix}.{name}"] = getattr(experts, name)
        loads.extend((experts, e, proj, w) for e, proj, w in items)
    return rest, loads
