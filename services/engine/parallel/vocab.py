"""The vocabulary split over a tp group: embedding, LM head, and what the sampler needs from the
logits (log-probs, top-n, the sampled token) computed on the shards, never gathering a row.

Rank r of the group holds vocabulary rows [r V/tp, (r+1) V/tp). The embedding looks up the ids it
owns (zeros elsewhere) and sums over the group: exactly one rank contributes each row. The head's
logits stay split; from them, with a few [rows]-sized collectives:

- log-softmax: the row's max (all-reduce max), then the sum of exp(logit - max) (all-reduce sum);
  log p = logit - (max + log sum), the trainer's chunked log-prob recipe distributed;
- a token's logit: its owner rank's value, the others add zero (all-reduce sum);
- top-n: each rank's own top-n, an all-gather of n x ranks candidates, the top-n of those;
- the sampled token (`ShardedSampler`): greedy is the largest logit (each rank's argmax, gathered;
  the lowest index wins ties, as argmax over the whole row); a draw is the inverse CDF of the
  single-rank sampler (services/engine/layers/sampler.py): each rank's probability mass is gathered, the
  rank whose cumulative range holds u x total finds the token in its own CDF. Same u, same token
  (up to the rounding of float64 partial sums).

Rows with top-k / top-p / min-p truncation are the exception: their truncation needs a sort of the
whole row, so those rows (and only those) are gathered and sampled by the single-rank sampler.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ops.lm_head import float32_logits
from services.common.schemas import SamplingParams
from services.engine.layers.sampler import SampleOutput, Sampler, TopLaunch, plain
from services.engine.parallel.group import RankGroup
from services.engine.parallel.linear import split_range


class VocabParallelEmbedding(nn.Module):
    """HF `embed_tokens`, rows split over the group."""

    def __init__(self, vocab: int, dim: int, group: RankGroup) -> None:
        super().__init__()
        self.group, self.vocab = group, vocab
        self.start, self.end = split_range(vocab, group.size, group.rank)
        self.weight = nn.Parameter(torch.zeros(self.end - self.start, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.group.all_reduce(out.masked_fill(~mine[:, None], 0))

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor) -> None:
        self.weight.copy_(weight[self.start : self.end].to(self.weight))


class VocabParallelHead(nn.Module):
    """HF `lm_head` (or the tied embedding), rows split over the group: logits of the rank's slice."""

    def __init__(self, vocab: int, dim: int, group: RankGroup, tied: VocabParallelEmbedding | None = None):
        super().__init__()
        self.group, self.vocab = group, vocab
        self.start, self.end = split_range(vocab, group.size, group.rank)
        self.tied = tied
        self.weight = None if tied is not None else nn.Parameter(torch.zeros(self.end - self.start, dim))
        self.logits_fp32 = True  # EngineConfig.logits_fp32, as CausalLM.logits

    def shard_weight(self) -> torch.Tensor:
        w = self.tied.weight if self.tied is not None else self.weight
        assert w is not None
        return w

    def forward(self, hidden: torch.Tensor) -> ShardedLogits:
        w = self.shard_weight()
        logits = float32_logits(hidden, w) if self.logits_fp32 else F.linear(hidden, w).float()
        return ShardedLogits(logits, self.start, self.vocab, self.group)

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor) -> None:
        if self.weight is not None:
            self.weight.copy_(weight[self.start : self.end].to(self.weight))


@dataclass
class ShardedLogits:
    """[rows, V / tp] float32 logits of vocabulary rows [start, start + V / tp) of `vocab`."""

    shard: torch.Tensor
    start: int
    vocab: int
    group: RankGroup

    @property
    def end(self) -> int:
        return self.start + self.shard.shape[-1]

    def with_shard(self, shard: torch.Tensor) -> ShardedLogits:
        return ShardedLogits(shard, self.start, self.vocab, self.group)

    def sanitized(self) -> ShardedLogits:
        """sampler.sanitize over the whole row: NaN -> -inf, +inf -> the largest float, and rows with
        nothing finite on any rank uniform (zeros everywhere)."""
        x = torch.nan_to_num(
            self.shard, nan=float("-inf"), posinf=torch.finfo(self.shard.dtype).max, neginf=float("-inf")
        )
        alive = torch.isfinite(x).any(dim=-1).float()
        dead = self.group.all_reduce(alive, "max") == 0
        return self.with_shard(torch.where(dead[:, None], torch.zeros_like(x), x))

    def max_and_log_sum(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[rows] each: the row's max m (0 where nothing is finite) and log sum exp(logit - m)."""
        m = self.group.all_reduce(self.shard.max(dim=-1).values, "max")
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        s = self.group.all_reduce((self.shard - m[:, None]).exp().sum(dim=-1))
        return m, s.log()

    @property
    def rows(self) -> int:
        return self.shard.shape[0]

    def log_softmax(self) -> ShardedLogits:
        # (x - m) - log s, as torch.log_softmax computes it: x - (m + log s) would lose log s
        # next to a huge m (a +inf logit sanitised to the largest float).
        m, log_s = self.max_and_log_sum()
        return self.with_shard((self.shard - m[:, None]) - log_s[:, None])

    def token_values(self, tokens: torch.Tensor) -> torch.Tensor:
        """[rows]: each row's value at its token (global ids), from the rank that owns it."""
        local = tokens - self.start
        mine = (local >= 0) & (local < self.shard.shape[-1])
        got = self.shard.gather(1, local.clamp(0, max(0, self.shard.shape[-1] - 1))[:, None])[:, 0]
        return self.group.all_reduce(torch.where(mine, got, torch.zeros_like(got)))

    def argmax(self) -> torch.Tensor:
        """[rows] global index of each row's largest value (lowest index on ties, as argmax)."""
        local = self.shard.argmax(dim=-1)
        value = self.shard.gather(1, local[:, None])[:, 0]
        values = self.group.all_gather(value)  # [ranks, rows]
        ids = self.group.all_gather(local + self.start)
        best = values.argmax(dim=0)  # the first rank holding the maximum: the lowest index
        return ids.gather(0, best[None])[0]

    def topk(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([rows, n] values, [rows, n] global ids) of each row's n largest, largest first."""
        k = min(n, self.shard.shape[-1])
        values, ids = self.shard.topk(k, dim=-1)
        cand_v = self.group.all_gather(values)  # [ranks, rows, k]
        cand_i = self.group.all_gather(ids + self.start)
        cand_v = cand_v.permute(1, 0, 2).reshape(self.rows, -1)
        cand_i = cand_i.permute(1, 0, 2).reshape(self.rows, -1)
        top_v, pick = cand_v.topk(min(n, cand_v.shape[-1]), dim=-1)
        return top_v, cand_i.gather(1, pick)

    def gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The full [len(rows), vocab] logits of the given rows, on every rank (for the few rows
        that need the whole row: truncated sampling)."""
        parts = self.group.all_gather(self.shard[rows])  # [ranks, r, V / tp]
        return parts.permute(1, 0, 2).reshape(len(rows), -1)


def inverse_cdf(logp: ShardedLogits, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampler.launch's draw over a split row: the first token whose cumulative probability
    exceeds u x total. Returns ([rows] global ids, [rows] bool: the token has no mass, the
    rounding corner the caller replaces by the greedy token)."""
    group = logp.group
    cdf = logp.shard.double().exp().cumsum(dim=-1)  # [rows, V / tp]
    masses = group.all_gather(cdf[:, -1])  # [ranks, rows]
    ends = masses.cumsum(dim=0)
    target = u * ends[-1]
    # The owner: the first rank whose cumulative range reaches past the target (the last if none).
    reaches = (target[None, :] < ends).double()
    owner = torch.where(
        reaches.any(dim=0), reaches.argmax(dim=0), torch.full_like(target, group.size - 1).long()
    )
    prefix = ends[group.rank - 1] if group.rank else torch.zeros_like(target)
    local = torch.searchsorted(cdf + prefix[:, None], target[:, None], right=True)[:, 0]
    local = local.clamp(max=cdf.shape[-1] - 1)
    mine = owner == group.rank
    no_mass = mine & (logp.shard.gather(1, local[:, None])[:, 0] == float("-inf"))
    # One all-reduce for both: the id (0 off the owner) and the no-mass flag.
    packed = torch.stack([torch.where(mine, local + logp.start, 0).double(), no_mass.double()])
    packed = group.all_reduce(packed)
    return packed[0].long(), packed[1] > 0


class _Drawn(random.Random):
    """A row's RNG whose next draw is already known (drawn on rank 0 and broadcast), so the
    single-rank sampler reproduces the draw on every rank."""

    def __init__(self, u: float) -> None:
        super().__init__(0)
        self.u = u

    def random(self) -> float:
        return self.u


class ShardedSampler:
    """services/engine/sampler.Sampler's results (tokens, their log-probs, top-n) from logits split
    over a tp group. Every rank calls `sample` with the same params and draws; every rank gets the
    same output. Draws come from `draws` on the rank that owns the RNGs (the scheduler's)."""

    @staticmethod
    def draws(params: list[SamplingParams], rngs: list[random.Random]) -> list[float]:
        """One uniform per sampled row, as Sampler.launch consumes them (greedy rows draw none)."""
        return [0.0 if p.temperature == 0 else rng.random() for p, rng in zip(params, rngs, strict=True)]

    def sample(self, logits: ShardedLogits, params: list[SamplingParams], u: list[float]) -> SampleOutput:
        vocab = logits.vocab
        device = logits.shard.device
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        greedy = temps == 0
        scaled = logits.with_shard(logits.shard / torch.where(greedy, 1.0, temps)[:, None]).sanitized()
        logp = scaled.log_softmax()
        best = scaled.argmax()
        drawn, no_mass = inverse_cdf(logp, torch.tensor(u, dtype=torch.float64, device=device))
        tokens = torch.where(greedy | no_mass, best, drawn)
        chosen = logp.token_values(tokens)
        cut = [i for i, p in enumerate(params) if not plain(p, vocab)]
        if cut:
            idx = torch.tensor(cut, device=device)
            full = logits.gather_rows(idx)
            out = Sampler().sample(full, [params[i] for i in cut], [_Drawn(u[i]) for i in cut])
            tokens[idx] = torch.tensor(out.tokens, device=device)
            chosen[idx] = torch.tensor(out.logprobs, dtype=chosen.dtype, device=device)
        return SampleOutput(tokens.tolist(), chosen.tolist(), self._top(logits, params))

    @staticmethod
    def _top(logits: ShardedLogits, params: list[SamplingParams]) -> list[list[tuple[int, float]] | None]:
        want = [p.logprobs for p in params]
        rows = [i for i, n in enumerate(want) if n is not None]
        if not rows:
            return [None] * len(params)
        n = min(max(want[i] or 0 for i in rows), logits.vocab)
        idx = torch.tensor(rows, device=logits.shard.device)
        raw = logits.with_shard(logits.shard[idx]).sanitized().log_softmax()
        values, ids = raw.topk(n) if n > 0 else (raw.shard[:, :0], raw.shard[:, :0].long())
        return Sampler._top_resolve(TopLaunch(rows, want, values, ids), len(params))
