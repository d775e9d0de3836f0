"""Nemotron-H / Nemotron-3 (arch nemotron_h) in the trainer: NVIDIA's hybrid Mamba-2 / attention /
MoE stack with HF transformers' NemotronH semantics (NemotronHForCausalLM), built the way the
trainer's torchtitan models are (tok_embeddings, layers "0".."L-1", norm, output; init_weights;
forward(tokens, positions)), so packing, the chunked head, Router Replay, activation checkpointing,
FSDP2 and EP apply unchanged.

Every layer is `x + mixer(RMSNorm(x))` with ONE mixer chosen by `model.hybrid_pattern`:

  M  Mamba2Mixer   in_proj -> [z | xBC | dt]; causal depthwise conv1d + SiLU on xBC -> x, B, C;
                   dt = clamp(softplus(dt + dt_bias)); SSD scan with A = -exp(A_log) and the D
                   skip (ops/mamba2.py: the chunked scan, autograd its backward); gated
                   group RMSNorm(y * silu(z)); out_proj
  *  Attention     GQA with no positional encoding (Nemotron-H's attention layers have no RoPE)
  -  Relu2MLP      down(relu(up(x))^2)
  E  MoE           torchtitan's MoE (ReplayRouter: sigmoid scores, correction bias for selection,
                   group limit, renormalised top-k scaled by routed_scaling_factor) whose routed
                   and shared experts are squared-ReLU MLPs (Relu2Experts, Relu2MLP)

Packed micro-batches: attention is document-masked as for every model (trainer/attention.py);
the Mamba-2 layers run each sample of the row separately (its start: position 0), so neither the
state nor the convolution crosses samples.

Checkpoint names: `NemotronHAdapter` (HF `backbone.*` as the Hub checkpoints name them, or
transformers' in-memory `model.*`; experts per expert or fused).
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torchtitan.models.attention import ScaledDotProductAttentionWrapper
from torchtitan.models.moe import MoE

from ops.mamba2 import causal_conv1d, gated_rms_norm, split_xbc, ssd_chunked, time_step
from services.common.config import ModelConfig
from trainer.moe_routing import add_expert_bias, deepseek_moe_args


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


class GatedRMSNorm(nn.Module):
    """HF NemotronHRMSNormGated: RMSNorm of y * silu(z) over groups of `group` channels, float32,
    the weight multiplied after the cast back (HF `weight * hs.to(input_dtype)`)."""

    def __init__(self, dim: int, group: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group, self.eps = group, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(y, z, self.weight, self.group, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def segments(positions: torch.Tensor | None, t: int) -> list[tuple[int, int]] | None:
    """The samples of a packed row as (start, end) from its positions (0 starts a sample); None
    for unpacked rows (positions None, or one sample)."""
    if positions is None or positions.shape[0] != 1:
        return None
    starts = torch.nonzero(positions[0] == 0).flatten().tolist()  # a host read: the row's layout
    if starts[:1] != [0] or len(starts) == 1:
        return None
    ends = [*starts[1:], t]
    return list(zip(starts, ends, strict=True))


class Mamba2Mixer(nn.Module):
    """HF NemotronHMamba2Mixer (same parameter names), training form."""

    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.state = m.mamba_n_heads, m.mamba_head_dim, m.ssm_state_size
        self.groups, self.chunk = m.mamba_n_groups, m.mamba_chunk_size
        self.dt_min, self.dt_max = m.mamba_dt_min, m.mamba_dt_max
        self.inner = m.mamba_n_heads * m.mamba_head_dim
        self.conv_dim = self.inner + 2 * self.groups * self.state
        self.in_proj = nn.Linear(m.dim, self.inner + self.conv_dim + self.n_heads, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, m.mamba_conv_kernel, groups=self.conv_dim, bias=True
        )
        self.dt_bias = nn.Parameter(torch.ones(self.n_heads))
        self.A_log = nn.Parameter(torch.zeros(self.n_heads))
        self.D = nn.Parameter(torch.ones(self.n_heads))
        self.norm = GatedRMSNorm(self.inner, self.inner // self.groups, m.norm_eps)
        self.out_proj = nn.Linear(self.inner, m.dim, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        segs = segments(positions, x.shape[1])
        if segs is None:
            return self._mix(x)
        return torch.cat([self._mix(x[:, a:b]) for a, b in segs], dim=1)

    def split_projection(self, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """in_proj's output -> (z, xBC, dt)."""
        return proj.split([self.inner, self.conv_dim, self.n_heads], dim=-1)

    def split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolved xBC [..., conv_dim] -> x [..., H, P], B and C [..., G, N]."""
        return split_xbc(xbc, self.n_heads, self.head_dim, self.groups, self.state)

    def time_step(self, dt: torch.Tensor) -> torch.Tensor:
        """Raw dt [..., H] -> softplus(dt + dt_bias) clamped to the config's limits (HF's order)."""
        return time_step(dt, self.dt_bias, self.dt_min, self.dt_max)

    def _mix(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        z, xbc, dt = self.split_projection(self.in_proj(x))
        w = self.conv1d.weight[:, 0]
        xbc = F.silu(causal_conv1d(xbc, w, self.conv1d.bias))
        xs, bm, cm = self.split_xbc(xbc)
        y, _ = ssd_chunked(xs, self.time_step(dt), -torch.exp(self.A_log.float()), bm, cm, self.chunk, self.D)
        y = self.norm(y.reshape(b, t, self.inner), z)
        return self.out_proj(y.to(x.dtype))

    def init_weights(self, init_std: float, n_layers: int) -> None:
        nn.init.trunc_normal_(self.in_proj.weight, std=0.02)
        self.conv1d.reset_parameters()
        with torch.no_grad():
            self.A_log.copy_(torch.log(torch.arange(1, self.n_heads + 1, dtype=torch.float32)))
            self.D.fill_(1.0)
            # dt log-uniform in [1e-3, 1e-1] at init (HF's time_step_min/max), dt_bias its softplus inverse
            dt = torch.exp(torch.rand(self.n_heads) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            dt = dt.clamp(min=1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.norm.reset_parameters()
        nn.init.trunc_normal_(self.out_proj.weight, std=init_std / math.sqrt(n_layers))


class Attention(nn.Module):
    """HF NemotronHAttention: causal GQA, no positional encoding; torchtitan-style names (wq, wk,
    wv, wo) and an `inner_attention` that trainer/attention.py makes document-masked."""

    attn_type = "sdpa"

    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = m.n_heads, m.n_kv_heads, m.head_dim
        self.wq = nn.Linear(m.dim, m.n_heads * m.head_dim, bias=False)
        self.wk = nn.Linear(m.dim, m.n_kv_heads * m.head_dim, bias=False)
        self.wv = nn.Linear(m.dim, m.n_kv_heads * m.head_dim, bias=False)
        self.wo = nn.Linear(m.n_heads * m.head_dim, m.dim, bias=False)
        self.scaling = m.head_dim**-0.5
        self.enable_gqa = m.n_kv_heads < m.n_heads
        self.inner_attention: nn.Module = ScaledDotProductAttentionWrapper()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, t, _ = x.shape
        q = self.wq(x).view(bs, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bs, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bs, t, -1, self.head_dim).transpose(1, 2)
        out = self.inner_attention(q, k, v, scale=self.scaling, enable_gqa=self.enable_gqa)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, t, -1))

    def init_weights(self, init_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(lin.weight, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, std=init_std)


class Relu2MLP(nn.Module):
    """HF NemotronHMLP (and the MoE's shared expert): down(relu(up(x))^2), torchtitan-style names
    w1 (up) and w2 (down)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(relu2(self.w1(x)))

    def init_weights(self, init_std: float = 0.02) -> None:
        nn.init.trunc_normal_(self.w1.weight, std=0.02)
        nn.init.trunc_normal_(self.w2.weight, std=init_std)


class Relu2Experts(nn.Module):
    """HF NemotronHExperts: per expert down(relu(up(x))^2), w1 = up [E, I, D], w2 = down [E, D, I].
    Called as torchtitan's GroupedExperts (tokens sorted by expert, counts per expert): the
    per-expert loop or one torch._grouped_mm per projection (trainer.moe_grouped_mm); with EP the
    local experts' shards (DTensor -> local)."""

    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.use_grouped_mm = False

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return self.run(*self.local_weights(), x, num_tokens_per_expert)

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """w1, w2 as plain tensors (an EP shard's local experts under DTensor)."""
        return tuple(w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2))  # type: ignore[return-value]

    def run(
        self, w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor, num_tokens_per_expert: torch.Tensor
    ) -> torch.Tensor:
        """This module's function with the given (local) weights: the loop or the grouped GEMMs."""
        if self.use_grouped_mm:
            offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
            dt = (
                w1.dtype
                if not torch.is_autocast_enabled(x.device.type)
                else torch.get_autocast_dtype(x.device.type)
            )
            xg, w1g, w2g = x.to(dt), w1.to(dt), w2.to(dt)
            # CUDA autocast runs square (a pow) in float32: back to the GEMM's dtype, which
            # rounds to what a bf16 square gives (the engine's bits).
            h = relu2(torch._grouped_mm(xg, w1g.transpose(-2, -1), offs=offsets)).to(dt)
            return torch._grouped_mm(h, w2g.transpose(-2, -1), offs=offsets).to(x.dtype)
        counts = num_tokens_per_expert.tolist()  # a host sync: the loop's split sizes
        n = sum(counts)
        outs = [
            relu2(xe @ w1[e].transpose(-2, -1)) @ w2[e].transpose(-2, -1)
            for e, xe in enumerate(torch.split(x[:n], counts, dim=0))
        ]
        out = torch.cat(outs, dim=0)
        # Rows past the counted ones (EP's alignment padding) come back as zeros, as torchtitan's loop.
        return torch.vstack((out, out.new_zeros((x.shape[0] - n, out.shape[-1]))))

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1, std=0.02)
        nn.init.trunc_normal_(self.w2, std=init_std)


MIXERS = {"M": "mamba", "*": "attention", "-": "feed_forward", "E": "moe"}


class HybridBlock(nn.Module):
    """One layer: x + mixer(norm(x)); the mixer's attribute name says its kind (MIXERS)."""

    def __init__(self, kind: str, m: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.kind = kind
        self.norm = nn.RMSNorm(m.dim, eps=m.norm_eps)
        self.moe_enabled = kind == "E"
        if kind == "M":
            self.mamba = Mamba2Mixer(m)
        elif kind == "*":
            self.attention = Attention(m)
        elif kind == "-":
            self.feed_forward = Relu2MLP(m.dim, m.hidden_dim)
        else:
            moe = MoE(deepseek_moe_args(m), dim=m.dim, hidden_dim=m.moe_hidden_dim)
            moe.experts = Relu2Experts(m.dim, m.moe_hidden_dim, m.n_routed_experts)  # type: ignore[assignment]
            moe.shared_experts = Relu2MLP(m.dim, m.shared_width) if m.n_shared_experts else None  # type: ignore[assignment]
            self.moe = moe
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm(x)
        if self.kind == "M":
            return x + self.mamba(h, positions)
        if self.kind == "*":
            return x + self.attention(h)
        if self.kind == "-":
            return x + self.feed_forward(h)
        return x + self.moe(h)

    def init_weights(self, n_layers: int, buffer_device: torch.device | None) -> None:
        self.norm.reset_parameters()
        std = self.weight_init_std
        if self.kind == "M":
            self.mamba.init_weights(std, n_layers)
        elif self.kind == "*":
            self.attention.init_weights(std)
        elif self.kind == "-":
            self.feed_forward.init_weights(std)
        else:
            moe = self.moe
            nn.init.trunc_normal_(moe.router.gate.weight, std=std)
            moe.experts.init_weights(std)
            if moe.shared_experts is not None:
                moe.shared_experts.init_weights(std)
            if getattr(moe, "expert_bias", None) is not None:
                moe.expert_bias.zero_()
            dev = buffer_device or moe.tokens_per_expert.device
            moe.tokens_per_expert = torch.zeros(moe.tokens_per_expert.shape, dtype=torch.float32, device=dev)


class NemotronHModel(nn.Module):
    """The hybrid decoder (module docstring)."""

    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        self.model_args = m
        self.tok_embeddings = nn.Embedding(m.vocab_size, m.dim)
        self.layers = nn.ModuleDict({str(i): HybridBlock(c, m, i) for i, c in enumerate(m.hybrid_pattern)})
        self.norm = nn.RMSNorm(m.dim, eps=m.norm_eps)
        self.output = nn.Linear(m.dim, m.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> Any:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h, positions)
        return self.output(self.norm(h))

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        nn.init.normal_(self.tok_embeddings.weight)
        for block in self.layers.values():
            block.init_weights(len(self.layers), buffer_device)  # type: ignore[operator]
        self.norm.reset_parameters()
        std = self.model_args.dim**-0.5
        nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)


def build_nemotron(m: ModelConfig) -> NemotronHModel:
    """The model with its MoE blocks' correction-bias buffer (`expert_bias`, HF
    e_score_correction_bias); trainer.model makes the routers ReplayRouters."""
    if not m.is_hybrid:
        raise ValueError(f"model.arch {m.arch!r}: build_nemotron builds nemotron_h")
    model = NemotronHModel(m)
    add_expert_bias(model, m)
    return model


# ------------------------------------------------------------------ HF names (the one map)

_BLOCK_NAMES: dict[str, list[tuple[str, str]]] = {
    "M": [
        (f"mixer.{n}", f"mamba.{n}")
        for n in (
            "in_proj.weight",
            "conv1d.weight",
            "conv1d.bias",
            "dt_bias",
            "A_log",
            "D",
            "norm.weight",
            "out_proj.weight",
        )
    ],
    "*": [
        (f"mixer.{h}_proj.weight", f"attention.w{t}.weight")
        for h, t in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "o"))
    ],
    "-": [
        ("mixer.up_proj.weight", "feed_forward.w1.weight"),
        ("mixer.down_proj.weight", "feed_forward.w2.weight"),
    ],
    "E": [
        ("mixer.gate.weight", "moe.router.gate.weight"),
        ("mixer.gate.e_score_correction_bias", "moe.expert_bias"),
        ("mixer.shared_experts.up_proj.weight", "moe.shared_experts.w1.weight"),
        ("mixer.shared_experts.down_proj.weight", "moe.shared_experts.w2.weight"),
    ],
}
_EXPERT = re.compile(r"^layers\.(\d+)\.mixer\.experts\.(\d+)\.(up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^layers\.(\d+)\.mixer\.experts\.(up_proj|down_proj)$")


class NemotronHAdapter:
    """torchtitan-style names <-> HF NemotronH names. Writes the Hub layout (`backbone.*`, one
    tensor per expert: what transformers loads and saves); reads it or transformers' in-memory
    one (`model.*`, experts fused [E, ...])."""

    def __init__(self, m: ModelConfig) -> None:
        self.m = m
        self.to_hf_map: dict[str, str] = {
            "tok_embeddings.weight": "backbone.embeddings.weight",
            "norm.weight": "backbone.norm_f.weight",
            "output.weight": "lm_head.weight",
        }
        for i, kind in enumerate(m.hybrid_pattern):
            self.to_hf_map[f"layers.{i}.norm.weight"] = f"backbone.layers.{i}.norm.weight"
            for hf, tt in _BLOCK_NAMES[kind]:
                if "shared_experts" in hf and not m.n_shared_experts:
                    continue
                if "e_score_correction_bias" in hf and not m.expert_bias:
                    continue
                self.to_hf_map[f"layers.{i}.{tt}"] = f"backbone.layers.{i}.{hf}"
        self.from_hf_map = {v: k for k, v in self.to_hf_map.items()}

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for k, v in state.items():
            if self.m.tie_embeddings and k == "output.weight":
                continue
            if k.endswith(".moe.experts.w1") or k.endswith(".moe.experts.w2"):
                layer = k.split(".")[1]
                proj = "up_proj" if k.endswith("w1") else "down_proj"
                for e in range(v.shape[0]):
                    out[f"backbone.layers.{layer}.mixer.experts.{e}.{proj}.weight"] = v[e]
                continue
            out[self.to_hf_map[k]] = v
        return out

    def from_hf(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
        for key, v in hf.items():
            k = re.sub(r"^(backbone|model)\.", "", key)
            if m := _EXPERT.match(k):
                experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = v
                continue
            if m := _FUSED.match(k):
                tt = "w1" if m.group(2) == "up_proj" else "w2"
                state[f"layers.{m.group(1)}.moe.experts.{tt}"] = v
                continue
            name = self.from_hf_map.get(f"backbone.{k}" if k != "lm_head.weight" else k)
            if name is None:
                raise KeyError(f"unexpected NemotronH weight {key!r}")
            state[name] = v
        for (layer, proj), per in experts.items():
            if sorted(per) != list(range(self.m.n_routed_experts)):
                raise KeyError(f"layer {layer} {proj}: experts {sorted(per)} of {self.m.n_routed_experts}")
            tt = "w1" if proj == "up_proj" else "w2"
            state[f"layers.{layer}.moe.experts.{tt}"] = torch.stack([per[e] for e in range(len(per))])
        return state
