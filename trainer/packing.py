"""Packing: samples concatenated into one row per micro-batch, with document masking.

A packed micro-batch is ONE row holding every sample's inputs (`tokens[:-1]`) back to back:

    inputs    = s0.tokens[:-1] ++ s1.tokens[:-1] ++ ...        [1, T], T = sum(len - 1) <= budget
    targets   = s0.tokens[1:]  ++ s1.tokens[1:]  ++ ...        (the same shift as trainer.batch)
    positions = 0..len0-2      ++ 0..len1-2      ++ ...        RoPE restarts at every sample
    loss_mask / logp_infer = loss_mask[1:] / logprobs[1:] per sample; advantages per token

Attention is causal within a sample and never crosses samples: `DocumentSDPA` replaces the
inner attention of every torchtitan block and, inside `document_mask(model, seq_lens)`, runs
SDPA with a block-diagonal causal mask. Outside that context it is torchtitan's causal SDPA
unchanged. (On CPU neither torchtitan's varlen path, flash-attention only, nor FlexAttention,
no CPU backward, can train; on GPU the varlen kernel is the faster path and not wired yet.)

No padding, so every forwarded token is real; the loss and its normaliser are unchanged
(docs/loss.md), hence packed and padded micro-batches give the same update.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torchtitan.models.attention import ScaledDotProductAttentionWrapper

from services.common.schemas import Sample
from trainer.batch import to_device


@dataclass
class PackedMicroBatch:
    inputs: torch.Tensor  # [1, T] int64
    targets: torch.Tensor  # [1, T] int64
    positions: torch.Tensor  # [1, T] int64, restarting at 0 for every sample
    loss_mask: torch.Tensor  # [1, T] float32
    logp_infer: torch.Tensor  # [1, T] float32
    advantages: torch.Tensor  # [1, T] float32, each token's advantage (Sample.advantages_per_token)
    seq_lens: list[int]  # inputs per sample, in order (sum = T)
    n_tokens: int  # real tokens of the samples (as MicroBatch.n_tokens: len(tokens) each)

    def to(self, device: torch.device) -> PackedMicroBatch:
        if device.type == "cpu":
            return self
        t = {
            k: to_device(getattr(self, k), device)
            for k in ("inputs", "targets", "positions", "loss_mask", "logp_infer", "advantages")
        }
        return PackedMicroBatch(**t, seq_lens=self.seq_lens, n_tokens=self.n_tokens)


def plan_packs(lengths: list[int], token_budget: int) -> list[list[int]]:
    """First-fit decreasing: sample indices per pack, each pack's summed length <= budget (a
    longer sample gets a pack of its own). Deterministic (ties broken by index)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    packs: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for k, r in enumerate(room):
            if lengths[i] <= r:
                packs[k].append(i)
                room[k] -= lengths[i]
                break
        else:
            packs.append([i])
            room.append(token_budget - lengths[i])
    return packs


def pack(samples: list[Sample]) -> PackedMicroBatch:
    """Concatenate `samples` into one row (see the module docstring for the layout)."""
    used = [s for s in samples if len(s.tokens) >= 2]  # a 1-token sample has nothing to score
    if not used:
        raise ValueError("pack needs a sample with at least two tokens")
    inp, tgt, pos, mask, logp, adv, lens = [], [], [], [], [], [], []
    for s in used:
        n = len(s.tokens) - 1
        inp.extend(s.tokens[:-1])
        tgt.extend(s.tokens[1:])
        pos.extend(range(n))
        mask.extend(s.loss_mask[1:])
        logp.extend(s.logprobs[1:])
        adv.extend(s.advantages_per_token()[1:])
        lens.append(n)

    def row(x: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype).unsqueeze(0)

    return PackedMicroBatch(
        inputs=row(inp, torch.long),
        targets=row(tgt, torch.long),
        positions=row(pos, torch.long),
        loss_mask=row(mask, torch.float32),
        logp_infer=row(logp, torch.float32),
        advantages=row(adv, torch.float32),
        seq_lens=lens,
        n_tokens=sum(len(s.tokens) for s in samples),
    )


def packed_micro_batches(samples: list[Sample], token_budget: int) -> list[PackedMicroBatch]:
    """Pack `samples` into micro-batches of at most `token_budget` forwarded tokens each."""
    lengths = [max(0, len(s.tokens) - 1) for s in samples]
    out = []
    for plan in plan_packs(lengths, token_budget):
        group = [samples[i] for i in plan]
        if any(len(s.tokens) >= 2 for s in group):
            out.append(pack(group))
    return out


def block_causal_mask(seq_lens: list[int], device: torch.device | None = None) -> torch.Tensor:
    """[T, T] bool, True = may attend: causal and within the same sample."""
    dev = torch.device("cpu") if device is None else torch.device(device)
    # The lengths through pinned memory, the output size from the host: repeat_interleave on
    # CUDA would otherwise read the lengths' sum back from the device (a host sync).
    t = sum(seq_lens)
    doc = torch.repeat_interleave(
        torch.arange(len(seq_lens), device=dev), to_device(torch.tensor(seq_lens), dev), output_size=t
    )
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril_()
    return causal & (doc.unsqueeze(0) == doc.unsqueeze(1))


class DocumentSDPA(ScaledDotProductAttentionWrapper):
    """torchtitan's SDPA wrapper; with `mask` set (by document_mask) it applies that mask."""

    mask: torch.Tensor | None = None

    def forward(  # type: ignore[override]
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        enable_gqa: bool = False,
        is_causal: bool = True,
    ) -> torch.Tensor:
        if self.mask is None:
            return super().forward(q, k, v, scale=scale, enable_gqa=enable_gqa, is_causal=is_causal)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=self.mask, scale=scale, enable_gqa=enable_gqa
        )


def _attentions(model: nn.Module) -> list[nn.Module]:
    # (a hybrid stack's Mamba-2 / MLP / MoE layers have none: trainer/nemotron.py)
    return [layer.attention for layer in model.layers.values() if hasattr(layer, "attention")]  # type: ignore[union-attr]


def enable_document_masking(model: nn.Module) -> nn.Module:
    """Give every block's attention a DocumentSDPA (idempotent; call before sharding)."""
    for attn in _attentions(model):
        if attn.attn_type != "sdpa":
            raise ValueError(f"document masking needs attn_type 'sdpa', not {attn.attn_type!r}")
        if not isinstance(attn.inner_attention, DocumentSDPA):
            attn.inner_attention = DocumentSDPA()
    return model


@contextmanager
def document_mask(
    model: nn.Module, seq_lens: list[int], device: torch.device | None = None
) -> Iterator[None]:
    """Inside: every attention of `model` is block-diagonal causal over `seq_lens`."""
    mask = block_causal_mask(seq_lens, device)
    inner = [a.inner_attention for a in _attentions(model)]
    if not all(isinstance(m, DocumentSDPA) for m in inner):
        raise TypeError("call enable_document_masking(model) first")
    for m in inner:
        m.mask = mask
    try:
        yield
    finally:
        for m in inner:
            m.mask = None
