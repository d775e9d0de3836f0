"""RolloutGroups -> padded training tensors, split across ranks and into micro-batches.

Alignment (the part that is easy to get wrong): a Sample's loss_mask[t] / logprobs[t] describe
tokens[t], sampled from the policy given tokens[:t]. The model fed tokens[:, :-1] produces at
column t the distribution of tokens[t+1], so the tensors built here are shifted by one:

    inputs     = tokens[:, :-1]
    targets    = tokens[:, 1:]             column t = sample token t+1
    loss_mask  = sample.loss_mask[1:]      column t says whether token t+1 is trained
    logp_infer = sample.logprobs[1:]       the engine's log-prob of token t+1

Token 0 has no context and is never trained (a loss_mask[0] of 1 is ignored). Rows are
right-padded with `pad_id` and mask 0; under causal attention the padding only influences
positions after the last real token, which are masked, so padding never changes a loss token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.schemas import RolloutGroup, Sample


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [B, L] int64, right-padded
    loss_mask: torch.Tensor  # [B, L-1] float32, aligned with tokens[:, 1:]
    logp_infer: torch.Tensor  # [B, L-1] float32, aligned with tokens[:, 1:]
    advantages: torch.Tensor  # [B, L-1] float32, aligned with tokens[:, 1:] (Sample.advantages_per_token)
    n_tokens: int  # real (non-pad) tokens in the micro-batch

    def to(self, device: torch.device) -> MicroBatch:
        if device.type == "cpu":
            return self
        t = {
            k: to_device(getattr(self, k), device)
            for k in ("tokens", "loss_mask", "logp_infer", "advantages")
        }
        return MicroBatch(**t, n_tokens=self.n_tokens)

    @property
    def inputs(self) -> torch.Tensor:
        return self.tokens[:, :-1]

    @property
    def targets(self) -> torch.Tensor:
        return self.tokens[:, 1:]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host-built CPU tensor on `device` without stalling the host. A copy from
    pageable memory may wait for the stream's queued work before it is staged, so a micro-batch
    copied while the previous one's backward runs drained the GPU; from pinned memory the copy
    is queued and the host goes on. (torch's pinned-memory allocator keeps the block until the
    copy has run, so the pinned tensor may be dropped at once.)"""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def flatten(groups: list[RolloutGroup]) -> list[Sample]:
    """The training sequences of `groups`: each sample's parts (a trimmed episode's earlier
    segments, then its last part)."""
    return [p for g in groups for s in g.samples for p in s.parts()]


def truncate(sample: Sample, max_len: int) -> Sample:
    """Cut a sample to `max_len` tokens (the model's positions: max_seq_len inputs + 1 target)."""
    if len(sample.tokens) <= max_len:
        return sample
    return sample.model_copy(
        update={
            "tokens": sample.tokens[:max_len],
            "loss_mask": sample.loss_mask[:max_len],
            "logprobs": sample.logprobs[:max_len],
            "versions": sample.versions[:max_len],
            "token_advantages": None
            if sample.token_advantages is None
            else sample.token_advantages[:max_len],
        }
    )


def collate(samples: list[Sample], pad_id: int = 0) -> MicroBatch:
    """Pad `samples` into one MicroBatch (see the module docstring for the alignment)."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    length = max(2, max(len(s.tokens) for s in samples))
    b = len(samples)
    tokens = torch.full((b, length), pad_id, dtype=torch.long)
    mask = torch.zeros((b, length - 1), dtype=torch.float32)
    logp = torch.zeros((b, length - 1), dtype=torch.float32)
    adv = torch.zeros((b, length - 1), dtype=torch.float32)
    n_tokens = 0
    for i, s in enumerate(samples):
        n = len(s.tokens)
        n_tokens += n
        tokens[i, :n] = torch.tensor(s.tokens, dtype=torch.long)
        if n > 1:
            mask[i, : n - 1] = torch.tensor(s.loss_mask[1:], dtype=torch.float32)
            logp[i, : n - 1] = torch.tensor(s.logprobs[1:], dtype=torch.float32)
            adv[i, : n - 1] = torch.tensor(s.advantages_per_token()[1:], dtype=torch.float32)
    return MicroBatch(tokens=tokens, loss_mask=mask, logp_infer=logp, advantages=adv, n_tokens=n_tokens)


def loss_token_count(samples: list[Sample]) -> int:
    """Loss tokens the trainer will actually see (token 0 excluded, as in collate)."""
    return sum(sum(s.loss_mask[1:]) for s in samples)


def split_for_ranks(samples: list[Sample], world: int) -> list[list[Sample]]:
    """Deterministic, length-balanced split: longest first, dealt round-robin. Every rank runs
    the same function on the same broadcast batch, so no index lists need to be sent."""
    order = sorted(range(len(samples)), key=lambda i: (-len(samples[i].tokens), i))
    return [[samples[i] for i in order[r::world]] for r in range(world)]


def plan_micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Group sample indices so that each micro-batch's padded size (rows x longest row) stays
    within `token_budget`. Sorting by length keeps padding small; a sample longer than the
    budget gets a micro-batch of its own (it cannot be split without changing the loss)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plans: list[list[int]] = []
    cur: list[int] = []
    cur_len = 0
    for i in order:
        longest = max(cur_len, lengths[i])
        if cur and (len(cur) + 1) * longest > token_budget:
            plans.append(cur)
            cur, longest = [], lengths[i]
        cur.append(i)
        cur_len = longest
    if cur:
        plans.append(cur)
    return plans


def micro_batches(samples: list[Sample], token_budget: int, pad_id: int = 0) -> list[MicroBatch]:
    plans = plan_micro_batches([len(s.tokens) for s in samples], token_budget)
    return [collate([samples[i] for i in plan], pad_id) for plan in plans]
