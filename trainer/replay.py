"""Router Replay: the trainer's MoE layers route tokens to the experts inference chose.

The engine records, for every token it forwards, the expert ids of every MoE layer
(`Sample.routed_experts`, services/common/routing.py). Tiny numerical differences between the
engine and the trainer flip near-tied top-k choices, and a flipped expert changes the token's
log-prob far more than rounding does, which inflates the trainer/inference mismatch the loss
must correct for. With replay on, `ReplayRouter` substitutes the recorded ids for its own
top-k, while the routing weights are still the trainer's own scores gathered AT those ids, so
the gate keeps receiving gradient (d loss / d score of each chosen expert).

Rows marked unrecorded (the sentinel: the sample's last token, padding, turns the engine did not
record) route by the trainer's own top-k. Whether replay is on or off, the router also counts,
per layer, how often its own top-k set equals the recorded one (the routing agreement metric).

Usage (train.py):
    enable_router_replay(model)                       # once, before sharding
    routes = micro_batch_routes(samples, ...)         # [B, T, moe_layers, top_k], -1 = unrecorded
    with routing(model, routes, replay=True) as rec:  # forward + backward inside
        ...
    rec.agree, rec.total, rec.replayed                # per-layer counts (float64 tensors)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torchtitan.models.moe.moe import TokenChoiceTopKRouter

from services.common import routing as wire
from services.common.config import ModelConfig, TrainerSection
from services.common.schemas import Sample
from trainer.batch import plan_micro_batches
from trainer.moe_routing import count_per_expert
from trainer.packing import plan_packs

UNRECORDED = -1  # in the trainer's int64 routing tensors


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the model computes in: autocast's, else the activations' (FSDP's bf16 or float32)."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


class ReplayRouter(TokenChoiceTopKRouter):
    """torchtitan's token-choice top-k router that can follow recorded expert ids.

    Outside `routing(...)` it computes what TokenChoiceTopKRouter computes: exactly in float32;
    in bf16 with float32 router logits and bf16-valued routing weights, as the engine computes
    them (gate_logits, forward)."""

    replay_ids: torch.Tensor | None = None  # [N, top_k] int64, UNRECORDED rows = own top-k
    replay: bool = False
    stats: torch.Tensor | None = None  # [3] float64: agree, compared, replayed (token count)

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._debug_force_load_balance:
            raise ValueError("ReplayRouter does not support _debug_force_load_balance")
        # float32 scores, as TokenChoiceTopKRouter (softmax/sigmoid in low precision drifts).
        logits = self.gate_logits(x)
        scores = torch.sigmoid(logits) if self.score_func == "sigmoid" else F.softmax(logits, dim=1)
        choice = scores if expert_bias is None else scores + expert_bias
        if self.num_expert_groups is not None:
            choice = self._get_node_limited_routing_scores(choice)
        _, own = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)
        ids = own
        rec = self.replay_ids
        if rec is not None:
            if rec.shape != own.shape:
                raise ValueError(
                    f"replay ids {tuple(rec.shape)} do not match the router's {tuple(own.shape)}"
                )
            recorded = (rec >= 0).all(dim=-1)
            with torch.no_grad():
                same = (own.sort(dim=-1).values == rec.sort(dim=-1).values).all(dim=-1) & recorded
                n_rec = recorded.sum()
                # Count once per forward: an activation-checkpoint recompute runs inside backward.
                if self.stats is not None and torch._C._current_graph_task_id() == -1:
                    replayed = n_rec if self.replay else torch.zeros_like(n_rec)
                    self.stats += torch.stack([same.sum(), n_rec, replayed]).to(self.stats)
            if self.replay:
                ids = torch.where(recorded.unsqueeze(-1), rec, own)
        # The gating weights are the trainer's own scores at the chosen ids: differentiable in
        # the gate whichever ids were chosen. (An expert bias only ever affects selection.)
        top_scores = scores.gather(dim=1, index=ids)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        top_scores = top_scores * self.route_scale
        dt = _compute_dtype(x)
        if dt != torch.float32:
            # The weights in the compute dtype's values, as HF (router_top_value.to(logits dtype))
            # and the engine (ExpertWeights.combine) weight the experts: the float32 (FSDP) and the
            # autocast (bf16 bmm) trainers then compute the same exact products, summed in float32.
            top_scores = top_scores.to(dt).float()
        # Not torchtitan's histc (no CPU kernel for integer ids) nor bincount (a host sync on CUDA).
        num_tokens_per_expert = count_per_expert(ids, self.num_experts)
        return top_scores, ids, num_tokens_per_expert

    def gate_logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 router logits of the compute dtype's input and weight, as the engine computes
        them (services/engine/layers/moe.py Router: float32 GEMM of the bf16 activations and the gate's
        bf16 values). torchtitan's bf16 gate GEMM rounds the logits to bf16 (~4e-3 at |logit|
        ~1), moving the routing weights of the replayed experts by ~1e-4 against the engine's: a
        bf16 bias Router Replay cannot remove. Both operands hold bf16
        values, so a TF32 GEMM would be exact too. float32 training: the gate as it was."""
        dt = _compute_dtype(x)
        w, b = self.gate.weight, self.gate.bias
        if dt == torch.float32 or isinstance(w, DTensor):
            # (tensor parallelism: the gate is a DTensor module whose hooks convert its input)
            return self.gate(x).to(torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.to(dt).float(), w.to(dt).float(), None if b is None else b.float())


def moe_routers(model: nn.Module) -> list[TokenChoiceTopKRouter]:
    """The routers of the model's MoE blocks, in layer order (= the RoutedExperts layer axis)."""
    out = []
    for block in model.layers.values():  # type: ignore[union-attr]
        if getattr(block, "moe_enabled", False):
            out.append(block.moe.router)
    return out


def enable_router_replay(model: nn.Module) -> nn.Module:
    """Swap every MoE router for a ReplayRouter holding the SAME gate (parameter names and values
    unchanged). Idempotent; a dense model is returned as is. Call before sharding."""
    for block in model.layers.values():  # type: ignore[union-attr]
        if not getattr(block, "moe_enabled", False):
            continue
        old = block.moe.router
        if isinstance(old, ReplayRouter):
            continue
        new = ReplayRouter(
            dim=old.gate.in_features,
            num_experts=old.num_experts,
            num_expert_groups=old.num_expert_groups,
            num_limited_groups=old.num_limited_groups,
            top_k=old.top_k,
            score_func=old.score_func,
            route_norm=old.route_norm,
            route_scale=old.route_scale,
            gate_bias=old.gate.bias is not None,
            _debug_force_load_balance=old._debug_force_load_balance,
        )
        new.gate = old.gate
        block.moe.router = new
    return model


@dataclass
class RoutingRecord:
    """Per-MoE-layer counts over the forwards run inside one `routing(...)` block."""

    # With recorded routes, on their device (not copied to the host); else CPU zeros.
    agree: torch.Tensor  # [layers] float64: recorded tokens whose own top-k set == recorded set
    total: torch.Tensor  # [layers] float64: recorded tokens
    replayed: torch.Tensor  # [layers] float64: tokens routed by recorded ids (0 with replay off)


def replay_at(tc: TrainerSection, step: int) -> bool:
    """Whether step `step` (the version it produces) routes by the recorded ids: trainer.router_replay,
    except inside trainer.router_replay_off_steps."""
    off = tc.router_replay_off_steps
    return tc.router_replay and not (off is not None and off[0] <= step <= off[1])


@contextmanager
def routing(model: nn.Module, routes: torch.Tensor | None, replay: bool) -> Iterator[RoutingRecord]:
    """Inside: every forward of `model` on inputs of shape routes.shape[:2] sees the recorded ids
    `routes` [B, T, moe_layers, top_k] (int64, UNRECORDED = -1); with `replay` the MoE layers
    route by them. routes=None: own routing, nothing counted."""
    routers = moe_routers(model)
    n = len(routers)
    rec = RoutingRecord(*(torch.zeros(n, dtype=torch.float64) for _ in range(3)))
    if routes is not None and routers:
        if routes.dim() != 4 or routes.shape[2] != n:
            raise ValueError(f"routes must be [B, T, {n} moe layers, top_k], got {tuple(routes.shape)}")
        for i, r in enumerate(routers):
            if not isinstance(r, ReplayRouter):
                raise TypeError("call enable_router_replay(model) first")
            r.replay_ids = routes[:, :, i].reshape(-1, routes.shape[-1])
            r.replay = replay
            r.stats = torch.zeros(3, dtype=torch.float64, device=routes.device)
    try:
        yield rec
    finally:
        counted = [isinstance(r, ReplayRouter) and r.stats is not None for r in routers]
        if routers and all(counted):
            # One stack on the routers' device, no per-layer host copy (that would be a
            # host sync per MoE layer per micro-batch); the trainer reads them once per step.
            s = torch.stack([r.stats.detach() for r in routers])  # type: ignore[union-attr]
            rec.agree, rec.total, rec.replayed = s[:, 0], s[:, 1], s[:, 2]
        else:
            for i, r in enumerate(routers):
                if counted[i]:
                    s = r.stats.detach().cpu()  # type: ignore[union-attr]
                    rec.agree[i], rec.total[i], rec.replayed[i] = s[0], s[1], s[2]
        for r in routers:
            if isinstance(r, ReplayRouter):
                r.replay_ids, r.replay, r.stats = None, False, None


# ------------------------------------------------------------------ samples -> routing tensors


def sample_routes(sample: Sample, n_inputs: int, layers: int, top_k: int, n_experts: int) -> torch.Tensor:
    """The recorded ids of the sample's first `n_inputs` tokens (the ones the trainer forwards:
    tokens[:-1], after any truncation) as [n_inputs, layers, top_k] int64, UNRECORDED where the
    engine recorded nothing (or the sample carries no routing at all)."""
    out = torch.full((n_inputs, layers, top_k), UNRECORDED, dtype=torch.long)
    if sample.routed_experts is None or n_inputs <= 0:
        return out
    arr = wire.decode(sample.routed_experts)
    if arr.shape[1:] != (layers, top_k):
        raise ValueError(
            f"sample {sample.rollout_id}: routed_experts rows are {list(arr.shape[1:])}, "
            f"the model has [{layers} moe layers, top_k {top_k}]"
        )
    rows = arr[:n_inputs]
    sentinel = wire.unrecorded(arr.dtype)
    missing = rows == sentinel
    if bool(((rows >= n_experts) & ~missing).any()):
        raise ValueError(f"sample {sample.rollout_id}: routed_experts holds an id >= {n_experts} experts")
    ids = torch.from_numpy(np.where(missing, UNRECORDED, rows.astype(np.int64)))
    out[: ids.shape[0]] = ids
    return out


def padded_routes(
    samples: list[Sample], length: int, layers: int, top_k: int, n_experts: int
) -> torch.Tensor:
    """For a padded micro-batch (trainer.batch.collate): [B, length-1, layers, top_k]."""
    out = torch.full((len(samples), length - 1, layers, top_k), UNRECORDED, dtype=torch.long)
    for i, s in enumerate(samples):
        n = max(0, len(s.tokens) - 1)
        out[i, :n] = sample_routes(s, n, layers, top_k, n_experts)
    return out


def packed_routes(samples: list[Sample], layers: int, top_k: int, n_experts: int) -> torch.Tensor:
    """For a packed micro-batch (trainer.packing.pack, same sample order and filter): [1, T, ...]."""
    parts = [
        sample_routes(s, len(s.tokens) - 1, layers, top_k, n_experts) for s in samples if len(s.tokens) >= 2
    ]
    return torch.cat(parts, dim=0).unsqueeze(0)


def micro_batch_samples(samples: list[Sample], packing: bool, token_budget: int) -> list[list[Sample]]:
    """The samples of each micro-batch of `trainer.batch.micro_batches(samples, budget)` or
    `trainer.packing.packed_micro_batches(samples, budget)`, in their order (same planners)."""
    if packing:
        lengths = [max(0, len(s.tokens) - 1) for s in samples]
        groups = [[samples[i] for i in plan] for plan in plan_packs(lengths, token_budget)]
        return [g for g in groups if any(len(s.tokens) >= 2 for s in g)]
    plans = plan_micro_batches([len(s.tokens) for s in samples], token_budget)
    return [[samples[i] for i in plan] for plan in plans]


def micro_batch_routes(
    samples: list[Sample], m: ModelConfig, packing: bool, token_budget: int
) -> list[torch.Tensor | None]:
    """Routing tensors aligned one-to-one with the micro-batches (see micro_batch_samples). None
    per micro-batch for a dense model."""
    groups = micro_batch_samples(samples, packing, token_budget)
    if not m.is_moe:
        return [None] * len(groups)
    layers, k, e = len(m.moe_layers()), m.n_experts_per_tok, m.n_routed_experts
    if packing:
        return [packed_routes(g, layers, k, e) for g in groups]
    # collate pads every row to the longest sample (at least 2 tokens)
    return [padded_routes(g, max(2, max(len(s.tokens) for s in g)), layers, k, e) for g in groups]
