"""Mixture-of-Experts feed-forward for the engine: router, grouped expert GEMMs, shared experts.

One module covers the routing variants of Qwen3-MoE, GLM-4.5/GLM-5, DeepSeek-V3, Kimi-K2 and
Nemotron-H (whose routed and shared experts are squared-ReLU MLPs: Relu2ExpertWeights, relu2_mlp.py):

    scores  = softmax(logits) | sigmoid(logits)           (router_score)
    choice  = scores + e_score_correction_bias            (expert_bias; selection only)
    groups  : keep the topk_group groups whose top-2 choice scores sum highest (n_group > 1)
    ids     = top-k of choice                             (n_experts_per_tok)
    weights = scores[ids] (/ their sum if norm_topk_prob) * routed_scaling_factor
    out     = sum_k weights_k * expert_{ids_k}(x) + shared_experts(x)

which is HF's Qwen3MoeSparseMoeBlock / DeepseekV3MoE function. The router runs in float32 whatever
the engine dtype (HF keeps DeepSeek's gate in float32 too): top-k over bf16 logits flips near-ties,
and the ids are what Router Replay hands to the trainer.

Expert weights are held fused, as transformers >= 5 holds them in memory: `experts.gate_up_proj`
[E, 2*I, D] (gate rows then up rows) and `experts.down_proj` [E, D, I]. Checkpoints with per-expert
names (`mlp.experts.<e>.{gate,up,down}_proj.weight`, what save_pretrained and the trainer write)
are copied into those slices by `ExpertWeights.load` (see CausalLM.load_hf_state).

Expert compute (`ExpertWeights.forward`, three kernels computing the same function):
  * "grouped": tokens sorted by expert, `torch._grouped_mm` (one CUTLASS kernel for all experts, no
    host sync, CUDA-graph capturable). Used on CUDA with bf16: torch's fast path needs bf16 on
    sm90/sm100; for other dtypes its fallback reads the offsets on the host.
  * "gather": each (token, expert) pair multiplies its expert's weights gathered per pair (bmm).
    No host sync either, so CUDA-graph safe; it reads one weight copy per pair, fine for the
    float32/small models it serves (CUDA with a dtype other than bf16).
  * "loop": tokens sorted by expert, a matmul per expert that got tokens (CPU).
"""

from __future__ import annotations

import re
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from services.common.config import ModelConfig
from services.engine.layers.relu2_mlp import Relu2MLP
from services.engine.weight_copy import copy_pieces, copy_weight

Kernel = Literal["grouped", "gather", "loop"]

# Per-expert HF names: model.layers.<L>.mlp.experts.<E>.<proj>.weight (nemotron_h: backbone.layers.
# <L>.mixer.experts.<E>.<proj>.weight)
PER_EXPERT = re.compile(r"^(.*\.(?:mlp|mixer)\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def route(
    logits: torch.Tensor,
    m: ModelConfig,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float32 -> (weights [T, k] float32, ids [T, k] int64), ids in descending
    order of their selection score."""
    scores = logits.softmax(dim=-1) if m.router_score == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias
    if m.n_group > 1:
        t, e = choice.shape
        grouped = choice.view(t, m.n_group, e // m.n_group)
        # DeepSeek-V3's group score: the sum of the group's two best experts (its best alone when
        # a group holds a single expert).
        group_scores = grouped.topk(min(2, e // m.n_group), dim=-1).values.sum(dim=-1)
        keep = group_scores.topk(m.topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = grouped.masked_fill(~mask[:, :, None], float("-inf")).view(t, e)
    ids = choice.topk(m.n_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, ids)
    if m.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * m.routed_scaling_factor, ids


class Router(nn.Module):
    """HF `mlp.gate`: weight [E, D] and, with expert_bias, `e_score_correction_bias` [E]."""

    def __init__(self, m: ModelConfig):
        super().__init__()
        self.m = m
        self.weight = nn.Parameter(torch.zeros(m.n_routed_experts, m.dim))
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(m.n_routed_experts)) if m.expert_bias else None
        )

    # The dtype the rest of the model computes in (set by the cast that made it so, see _apply).
    value_dtype: torch.dtype = torch.float32

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # Stay float32 when the model is cast to bf16 (see the module docstring); device moves apply.
        super()._apply(fn, recurse)
        if self.weight.dtype != torch.float32:  # a dtype cast (a device move keeps float32)
            self.value_dtype = self.weight.dtype
        for p in self.parameters(recurse=False):
            p.data = p.data.float()
        return self

    @torch.no_grad()
    def round_weight_(self) -> None:
        """Give the gate weight the values of the model's dtype (float32 storage). Called after
        every load: the bf16 trainer's router multiplies the same bf16 activations by its bf16
        (FSDP's cast, or autocast's) copy of the weight in float32 (trainer/replay.py), and HF
        holds the gate in the checkpoint's dtype; a float32 master copy here would give router
        weights ~1e-4 apart from the trainer's, a bias Router Replay cannot remove. The bias
        (selection only) stays float32, as HF keeps it."""
        if self.value_dtype != torch.float32:
            self.weight.copy_(self.weight.to(self.value_dtype))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)
        return route(logits, self.m, self.e_score_correction_bias)


class ExpertWeights(nn.Module):
    """HF `mlp.experts`, fused: gate_up_proj [E, 2I, D], down_proj [E, D, I]."""

    # The per-expert projections of a checkpoint, and the fused parameters they fill.
    PROJS: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
    FUSED: tuple[str, ...] = ("gate_up_proj", "down_proj")
    # Each fused parameter and the projections whose rows fill each expert's part of it, in order.
    LAYOUT: dict[str, tuple[str, ...]] = {
        "gate_up_proj": ("gate_proj", "up_proj"),
        "down_proj": ("down_proj",),
    }

    def __init__(self, m: ModelConfig):
        super().__init__()
        e, d, i = m.n_routed_experts, m.dim, m.moe_hidden_dim
        self.n_experts, self.inter = e, i
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.zeros(e, d, i))

    def expert_slice(self, index: int, proj: str) -> torch.Tensor:
        """The part of a fused parameter one per-expert HF tensor fills."""
        i = self.inter
        if proj == "down_proj":
            return self.down_proj[index]
        return self.gate_up_proj[index, :i] if proj == "gate_proj" else self.gate_up_proj[index, i:]

    @torch.no_grad()
    def load_expert(self, index: int, proj: str, w: torch.Tensor) -> None:
        """Copy one per-expert HF tensor into its slice (no [E, ...] temporary)."""
        dst = self.expert_slice(index, proj)
        if w.shape != dst.shape:
            raise ValueError(f"expert {index} {proj}: shape {tuple(w.shape)} != expected {tuple(dst.shape)}")
        copy_weight(dst, w)

    @torch.no_grad()
    def load_per_expert(self, tensors: dict[tuple[int, str], torch.Tensor]) -> None:
        """Every expert's HF tensors ((index, proj) -> weight) into the fused parameters: one copy
        per parameter (gate_up_proj's bytes are gate_0, up_0, gate_1, ... end to end), not one per
        expert. Shapes are checked before anything is written."""
        for (e, proj), w in tensors.items():
            want = self.expert_slice(e, proj).shape
            if w.shape != want:
                raise ValueError(f"expert {e} {proj}: shape {tuple(w.shape)} != expected {tuple(want)}")
        for fused, projs in self.LAYOUT.items():
            pieces = [tensors[(e, p)] for e in range(self.n_experts) for p in projs]
            copy_pieces(getattr(self, fused), pieces)

    @property
    def w_in(self) -> torch.Tensor:
        """The first GEMM's weights [E, rows, D] (its output goes to `activate`)."""
        return self.gate_up_proj

    @staticmethod
    def activate(h: torch.Tensor) -> torch.Tensor:
        """SwiGLU: silu(gate) * up of the first GEMM's [..., 2I] output."""
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up

    def kernel_for(self, x: torch.Tensor) -> Kernel:
        if not x.is_cuda:
            return "loop"
        # _grouped_mm's CUDA kernel wants 16-byte aligned rows: dims that are multiples of 8.
        aligned = x.shape[1] % 8 == 0 and self.inter % 8 == 0
        return "grouped" if x.dtype == torch.bfloat16 and aligned else "gather"

    def forward(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, kernel: Kernel | None = None
    ) -> torch.Tensor:
        """x [T, D], ids/weights [T, k] -> sum_k weights * expert_ids(x): [T, D].

        `kernel` forces one (tests compare them); None picks by device and dtype (kernel_for)."""
        t, k = ids.shape
        kernel = kernel or self.kernel_for(x)
        if kernel == "gather":
            xk = x[:, None, :].expand(t, k, x.shape[1]).reshape(t * k, 1, x.shape[1])
            flat = ids.reshape(-1)
            h = self.activate(torch.bmm(xk, self.w_in[flat].transpose(1, 2)))
            y = torch.bmm(h, self.down_proj[flat].transpose(1, 2)).view(t, k, -1)
            return self.combine(y, weights)
        flat = ids.reshape(-1)
        # Sort the T*k (token, expert) assignments by expert: each expert's rows are contiguous.
        order = flat.argsort(stable=True)
        token = order // k
        xs = x[token]
        # scatter_add, not bincount: bincount sizes its output from the data (a host sync), which
        # a CUDA-graph capture of the decode step cannot contain.
        counts = torch.zeros(self.n_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat)
        )
        if kernel == "grouped":
            offs = counts.cumsum(0).to(torch.int32)
            h = self.activate(torch._grouped_mm(xs, self.w_in.transpose(-2, -1), offs=offs))
            ys = torch._grouped_mm(h, self.down_proj.transpose(-2, -1), offs=offs)
        else:
            ys = torch.empty_like(xs)
            start = 0
            for e, n in enumerate(counts.tolist()):  # a host sync: CPU only
                if n:
                    h = self.activate(F.linear(xs[start : start + n], self.w_in[e]))
                    ys[start : start + n] = F.linear(h, self.down_proj[e])
                    start += n
        # Back to (token, slot) order for the weighted sum below.
        return self.combine(torch.empty_like(ys).index_copy_(0, order, ys).view(t, k, -1), weights)

    @staticmethod
    def combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """y [T, k, D] (expert outputs, slot order of ids), weights [T, k] float32 -> [T, D].

        Each expert's OUTPUT is weighted (HF; the SwiGLU is not linear, so the order matters) by
        its routing weight rounded to the model dtype (HF rounds them too), and the weighted sum
        runs in float32 with one rounding at the end, as the trainer's torchtitan MoE computes it
        (a bmm of the scores with the float32 outputs; trainer/replay.py rounds its scores the
        same way). Weighting and summing in bf16 (k + 1 roundings, HF's index_add order) was a
        rounding difference from the trainer that Router Replay cannot remove."""
        w = weights.to(y.dtype).float()
        return torch.bmm(w[:, None, :], y.float()).squeeze(1).to(y.dtype)


class Relu2ExpertWeights(ExpertWeights):
    """HF NemotronH `mixer.experts`: squared-ReLU experts down(relu(up(x))^2), fused as transformers
    holds them: up_proj [E, I, D], down_proj [E, D, I]."""

    PROJS = ("up_proj", "down_proj")
    FUSED = ("up_proj", "down_proj")
    LAYOUT = {"up_proj": ("up_proj",), "down_proj": ("down_proj",)}

    def __init__(self, m: ModelConfig):
        nn.Module.__init__(self)
        e, d, i = m.n_routed_experts, m.dim, m.moe_hidden_dim
        self.n_experts, self.inter = e, i
        self.up_proj = nn.Parameter(torch.zeros(e, i, d))
        self.down_proj = nn.Parameter(torch.zeros(e, d, i))

    @property
    def w_in(self) -> torch.Tensor:
        return self.up_proj

    @staticmethod
    def activate(h: torch.Tensor) -> torch.Tensor:
        return torch.square(F.relu(h))

    def expert_slice(self, index: int, proj: str) -> torch.Tensor:
        return self.up_proj[index] if proj == "up_proj" else self.down_proj[index]


class SharedExperts(nn.Module):
    """HF `mlp.shared_experts`: one SwiGLU of width moe_hidden_dim * n_shared_experts."""

    def __init__(self, m: ModelConfig):
        super().__init__()
        width = m.moe_hidden_dim * m.n_shared_experts
        self.gate_proj = nn.Linear(m.dim, width, bias=False)
        self.up_proj = nn.Linear(m.dim, width, bias=False)
        self.down_proj = nn.Linear(width, m.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """HF `mlp` of an MoE layer. `moe_index` is the layer's row in the routing store (the layer
    axis of a RoutedExperts array): MoE layers in order, dense ones skipped."""

    def __init__(self, m: ModelConfig, moe_index: int):
        super().__init__()
        self.moe_index = moe_index
        self.gate = Router(m)
        self.experts = Relu2ExpertWeights(m) if m.is_hybrid else ExpertWeights(m)
        self.shared_experts: nn.Module | None = None
        if m.n_shared_experts:
            self.shared_experts = Relu2MLP(m.dim, m.shared_width) if m.is_hybrid else SharedExperts(m)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (output [T, D], expert ids [T, k])."""
        weights, ids = self.gate(x)
        out = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out, ids


def moe_layer_ids(m: ModelConfig) -> list[int]:
    """Indices of the MoE layers, in the order of the routing arrays' layer axis."""
    return m.moe_layers()
