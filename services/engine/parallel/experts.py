"""MoE layers over several ranks: expert parallel (experts split over the engine, tokens sent to
their experts' ranks and back with `all_to_all_single`) and tensor-parallel experts (every expert's
width split over a tp group).

Both compute services/engine/layers/moe.py's function, and both return every token's routed expert ids
(the router runs on each token before any communication), which the engine records for Router
Replay exactly as the single-rank MoE does.

Expert parallel, one layer (`ExpertParallelMoE`):
  1. route: the router (replicated on every rank) gives each token its k experts and weights;
  2. split: a tp group's ranks hold the same tokens; rank j of the group dispatches the j-th
     contiguous part of them (data-parallel attention with tp = 1: a rank's own tokens);
  3. dispatch: the (token, slot) pairs sorted by the rank owning their expert, their counts
     exchanged, then the token rows and their local expert ids, one all-to-all each;
  4. experts: each rank runs its experts on what it received;
  5. combine: the outputs go back (the reverse all-to-all), and each rank weights and sums its
     tokens' k outputs (moe.ExpertWeights.combine: float32 sum, one rounding), adds the shared
     experts and all-gathers its tp group's parts.
A token row travels once per slot (no per-rank deduplication yet) and the all-to-all sizes are
read on the host (no CUDA-graph capture of this layer).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.common.config import ModelConfig
from services.engine.layers.fp8 import Fp8Experts
from services.engine.layers.moe import ExpertWeights, MoE, Relu2ExpertWeights, Router
from services.engine.parallel.group import EngineGroups, RankGroup
from services.engine.parallel.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    shard_indices,
    split_range,
)


def expert_outputs(
    w_in: torch.Tensor,
    down: torch.Tensor,
    x: torch.Tensor,
    experts: torch.Tensor,
    activate: Callable[[torch.Tensor], torch.Tensor] = ExpertWeights.activate,
) -> torch.Tensor:
    """x [R, D] rows, each for one expert (`experts` [R], indices into w_in [E, rows, D] /
    down [E, D, I]) -> [R, D]: each row through its expert (not weighted); `activate` between
    the GEMMs (SwiGLU by default; moe.Relu2ExpertWeights' squared ReLU for nemotron_h)."""
    order = experts.argsort(stable=True)
    xs = x[order]
    counts = torch.bincount(experts, minlength=w_in.shape[0])
    if x.is_cuda and x.dtype == torch.bfloat16 and x.shape[1] % 8 == 0 and down.shape[-1] % 8 == 0:
        offs = counts.cumsum(0).to(torch.int32)
        h = activate(torch._grouped_mm(xs, w_in.transpose(-2, -1), offs=offs))
        ys = torch._grouped_mm(h, down.transpose(-2, -1), offs=offs)
    else:
        ys = torch.empty((xs.shape[0], down.shape[1]), dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                ys[start : start + n] = F.linear(activate(F.linear(xs[start : start + n], w_in[e])), down[e])
                start += n
    return torch.empty_like(ys).index_copy_(0, order, ys)


def run_experts(experts: nn.Module, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """expert_outputs for a layer's experts as the rank holds them: bf16/float32
    (moe.ExpertWeights) or FP8 (Fp8Experts, whose grouped GEMMs quantise each row's activations
    1x128 on their own: a row's output does not depend on the other rows of the call)."""
    if isinstance(experts, Fp8Experts):
        ones = torch.ones((x.shape[0], 1), dtype=torch.float32, device=x.device)
        return experts(x, ids[:, None], ones)
    assert isinstance(experts, ExpertWeights)
    return expert_outputs(experts.w_in, experts.down_proj, x, ids, experts.activate)


def combine_slots(experts: nn.Module, y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y [T, k, D] expert outputs, weights [T, k] -> [T, D] by the rule of the single-rank layer
    of the same kind: moe.ExpertWeights.combine (float32 sum, one rounding), or Fp8Experts' (each
    output weighted in the activations' dtype and summed there; in slot order, where Fp8Experts
    adds a token's terms in expert order: the same sum for k = 2, a last-bit difference at most
    for larger k)."""
    if not isinstance(experts, Fp8Experts):
        return ExpertWeights.combine(y, weights)
    out = y[:, 0] * weights[:, :1].to(y.dtype)
    for j in range(1, y.shape[1]):
        out = out + y[:, j] * weights[:, j : j + 1].to(y.dtype)
    return out


class SharedExpertsTP(nn.Module):
    """moe.SharedExperts with its width split over the tp group (column gate/up, row down)."""

    def __init__(self, m: ModelConfig, tp: RankGroup) -> None:
        super().__init__()
        width = m.shared_width
        self.cols = shard_indices(width, tp.size, tp.rank)
        local = len(self.cols)
        self.gate_proj = ColumnParallelLinear(m.dim, local)
        self.up_proj = ColumnParallelLinear(m.dim, local)
        self.down_proj = RowParallelLinear(local, m.dim, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def load_full(self, state: dict[str, torch.Tensor]) -> None:
        """state: the HF `shared_experts.{gate,up,down}_proj.weight` tensors (full)."""
        self.gate_proj.load_full(state["gate_proj.weight"], self.cols)
        self.up_proj.load_full(state["up_proj.weight"], self.cols)
        self.down_proj.load_full(state["down_proj.weight"], self.cols)


class SharedRelu2TP(nn.Module):
    """nemotron_h's shared expert (relu2_mlp.Relu2MLP) with its width split over the tp group."""

    def __init__(self, m: ModelConfig, tp: RankGroup) -> None:
        super().__init__()
        local = len(shard_indices(m.shared_width, tp.size, tp.rank))
        self.up_proj = ColumnParallelLinear(m.dim, local)
        self.down_proj = RowParallelLinear(local, m.dim, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.square(F.relu(self.up_proj(x))))


def shared_tp(m: ModelConfig, tp: RankGroup) -> nn.Module | None:
    """An MoE layer's shared experts split over the tp group (None without any)."""
    if not m.n_shared_experts:
        return None
    return SharedRelu2TP(m, tp) if m.is_hybrid else SharedExpertsTP(m, tp)


def local_experts(m: ModelConfig, n_experts: int, width: int) -> ExpertWeights:
    """moe.ExpertWeights (nemotron_h: Relu2ExpertWeights) holding `n_experts` experts of `width`
    (HF names and per-expert loads unchanged, indices local to the rank)."""
    local = m.model_copy(update={"n_routed_experts": n_experts, "moe_hidden_dim": width})
    return Relu2ExpertWeights(local) if m.is_hybrid else ExpertWeights(local)


class ExpertParallelMoE(MoE):
    """An MoE layer whose routed experts are split over `groups.ep` (n_routed_experts / ep each):
    `experts` holds this rank's, indices local. A moe.MoE (the decoder layer records its ids) with
    HF names (`gate`, `experts`, `shared_experts`), built without moe.MoE's full set of experts."""

    def __init__(self, m: ModelConfig, moe_index: int, groups: EngineGroups) -> None:
        nn.Module.__init__(self)
        self.moe_index, self.groups = moe_index, groups
        ep = groups.ep
        self.first, last = split_range(m.n_routed_experts, ep.size, ep.rank)
        self.n_local = last - self.first
        self.gate = Router(m)
        self.experts = local_experts(m, self.n_local, m.moe_hidden_dim)
        self.shared_experts = shared_tp(m, groups.tp)

    @torch.no_grad()
    def load_full(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """The full fused [E, 2I, D] / [E, D, I] expert tensors: copy this rank's experts."""
        sl = slice(self.first, self.first + self.n_local)
        self.experts.gate_up_proj.copy_(gate_up[sl].to(self.experts.gate_up_proj))
        self.experts.down_proj.copy_(down[sl].to(self.experts.down_proj))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] (the same T tokens on every rank of a tp group) -> (out [T, D], ids [T, k])."""
        weights, ids = self.gate(x)
        tp = self.groups.tp
        bounds = [split_even(x.shape[0], tp.size, r) for r in range(tp.size)]
        lo, hi = bounds[tp.rank]
        y = self._dispatch(x[lo:hi], ids[lo:hi])
        out = combine_slots(self.experts, y, weights[lo:hi])
        if tp.size > 1:
            out = gather_parts(tp, out, [h - low for low, h in bounds])
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out, ids

    def _dispatch(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [t, D] with ids [t, k] -> [t, k, D]: each (token, slot)'s expert output."""
        ep = self.groups.ep
        t, k = ids.shape
        flat = ids.reshape(-1)
        dest = flat // self.n_local
        order = dest.argsort(stable=True)
        send = torch.bincount(dest, minlength=ep.size)
        recv = ep.exchange_counts(send)
        send_l, recv_l = send.tolist(), recv.tolist()
        rows = ep.all_to_all(x[order // k], send_l, recv_l)
        local = ep.all_to_all((flat - dest * self.n_local)[order], send_l, recv_l)
        out = run_experts(self.experts, rows, local)
        back = ep.all_to_all(out, recv_l, send_l)
        return torch.empty_like(back).index_copy_(0, order, back).view(t, k, x.shape[1])


class TensorParallelMoE(MoE):
    """An MoE layer whose every expert's width is split over the tp group (ep = 1): each rank runs
    all experts on its slice of the width; the weighted partial outputs are summed in float32 over
    the group and rounded once, as the single-rank combine rounds its float32 sum. A moe.MoE with
    HF names, as ExpertParallelMoE."""

    def __init__(self, m: ModelConfig, moe_index: int, tp: RankGroup) -> None:
        nn.Module.__init__(self)
        self.moe_index, self.tp = moe_index, tp
        self.cols = shard_indices(m.moe_hidden_dim, tp.size, tp.rank)
        self.inter = m.moe_hidden_dim
        self.gate = Router(m)
        self.experts = local_experts(m, m.n_routed_experts, len(self.cols))
        self.shared_experts = shared_tp(m, tp)

    @torch.no_grad()
    def load_full(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        rows = torch.cat([self.cols, self.cols + self.inter])  # gate rows, then up rows
        self.experts.gate_up_proj.copy_(gate_up[:, rows].to(self.experts.gate_up_proj))
        self.experts.down_proj.copy_(down[:, :, self.cols].to(self.experts.down_proj))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = self.gate(x)
        t, k = ids.shape
        rows = x[:, None, :].expand(t, k, x.shape[1]).reshape(t * k, -1)
        y = run_experts(self.experts, rows, ids.reshape(-1))
        y = y.view(t, k, x.shape[1])
        w = weights.to(y.dtype).float()
        out = self.tp.all_reduce(torch.bmm(w[:, None, :], y.float()).squeeze(1)).to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out, ids


def split_even(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` when n items are cut in `parts` contiguous parts whose sizes
    differ by at most one (torch.tensor_split's rule)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def gather_parts(group: RankGroup, part: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Each rank's `part` ([sizes[rank], ...]) concatenated in rank order on every rank."""
    pad = max(sizes)
    if pad == 0:  # an idle attention group: the same on all its ranks, nothing to exchange
        return part
    buf = part.new_zeros((pad, *part.shape[1:]))
    buf[: part.shape[0]] = part
    got = group.all_gather(buf)
    return torch.cat([got[r, : sizes[r]] for r in range(group.size)])
