"""Token sampling with per-sequence parameters and RNG, returning the log-prob of each sampled token.

The log-prob is that of the distribution the token was actually drawn from: logits / temperature,
restricted to the top-k / min-p / top-p support and renormalised over it. With temperature 1 and no
truncation that is exactly log_softmax(logits), the quantity the trainer recomputes, so the
importance ratio pi_train / pi_infer is 1 up to float rounding when the weights agree.
Greedy rows (temperature 0) report the untruncated log_softmax(logits): the distribution they
"sample" from is a point mass, whose log-prob (0) carries no information.

Optional top-n log-probs (SamplingParams.logprobs = n) are those of the model's own distribution,
log_softmax(logits) before temperature and truncation, as OpenAI and vLLM report them.

Everything is float32 (whatever the model dtype) and guarded against inf/NaN logits.

On CUDA (Sampler(fused=True), set by the engine) a batch of only greedy / plain rows is sampled by
kernels/sampling.py in one pass over the logits: same distribution, same log-probs, same RNG
consumption, but a different random stream from this torch path (so a seed's tokens differ between
GPU and CPU; greedy does not). Batches with top-k/top-p/min-p rows take the torch path.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from services.common.schemas import SamplingParams
from services.engine.batch import host_to_device

# -inf (a masked or NaN logit) is not valid JSON; top-n log-probs report it as this instead.
LOWEST = torch.finfo(torch.float32).min


def sanitize(x: torch.Tensor) -> torch.Tensor:
    """Map NaN to -inf and +inf to the largest float, and give rows with nothing finite a uniform
    distribution, so log_softmax never sees inf - inf."""
    x = torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(x.dtype).max, neginf=float("-inf"))
    dead = ~torch.isfinite(x).any(dim=-1, keepdim=True)
    return torch.where(dead, torch.zeros_like(x), x)


def truncate(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor | None = None
) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, then those less likely than min_p times the
    most likely token, then those outside the smallest set whose probability (after top-k and
    min-p) reaches top_p. top_k = vocab, min_p = 0 and top_p = 1 leave a row unchanged."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    remove = ranks[None, :] >= top_k[:, None]
    if min_p is not None:
        # p_i < min_p * p_max  <=>  logit_i - logit_max < log(min_p), with no softmax needed
        # (and no underflow for extreme logits). log(0) = -inf keeps everything.
        floor = sorted_logits[:, :1] + torch.log(min_p)[:, None]
        remove |= sorted_logits < floor
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # Rows with top_p = 1 skip this: rounding could otherwise drop the far tail.
    remove |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    remove[:, 0] = False  # the most likely token always survives
    mask = torch.zeros_like(remove).scatter(1, order, remove)
    return logits.masked_fill(mask, float("-inf"))


@dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[float]  # of each sampled token, under the distribution it was drawn from
    # Per row: the n most likely (id, log-prob) under log_softmax(logits), most likely first;
    # None for rows that did not ask (SamplingParams.logprobs is None).
    top: list[list[tuple[int, float]] | None]


@dataclass
class TopLaunch:
    """Top-n log-probs still on the device: the rows that asked, how many each, values and ids."""

    rows: list[int]
    want: list[int | None]
    values: torch.Tensor  # [len(rows), n]
    ids: torch.Tensor


@dataclass
class PendingSample:
    """A sampled batch whose results are still on the device (Sampler.launch). `tokens` can feed
    the next forward directly (overlap scheduling, docs/engine.md); `resolve()` is the host's one
    wait for them. On CUDA the copies to pinned host memory are queued at launch, so resolving
    waits only for the sampler itself, not for anything queued after it."""

    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32
    top: TopLaunch | None
    batch: int
    ready: torch.cuda.Event | None = None  # recorded after the device -> host copies
    host: tuple[torch.Tensor, torch.Tensor] | None = None  # pinned copies of tokens, logprobs

    @staticmethod
    def start(
        tokens: torch.Tensor, logprobs: torch.Tensor, top: TopLaunch | None, batch: int
    ) -> PendingSample:
        if not tokens.is_cuda:
            return PendingSample(tokens, logprobs, top, batch)
        # Device -> pinned host now (asynchronous), then an event: resolve() waits on exactly these.
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (tokens, logprobs)]
        host[0].copy_(tokens, non_blocking=True)
        host[1].copy_(logprobs, non_blocking=True)
        if top is not None:
            top = TopLaunch(
                top.rows,
                top.want,
                top.values.to("cpu", non_blocking=True),
                top.ids.to("cpu", non_blocking=True),
            )
        ready = torch.cuda.Event()
        ready.record()
        return PendingSample(tokens, logprobs, top, batch, ready, (host[0], host[1]))

    def resolve(self) -> SampleOutput:
        if self.host is not None:
            if self.ready is not None:
                self.ready.synchronize()
            tokens, logprobs = self.host
        else:
            tokens, logprobs = self.tokens, self.logprobs
        return SampleOutput(tokens.tolist(), logprobs.tolist(), Sampler._top_resolve(self.top, self.batch))


def plain(p: SamplingParams, vocab: int) -> bool:
    """True if the row samples from the whole of softmax(logits / T), or is greedy."""
    return p.temperature == 0 or not (0 < p.top_k < vocab or p.top_p < 1 or p.min_p > 0)


class Sampler:
    def __init__(self, fused: bool = False, pdl: bool = False):
        """fused: batches whose rows are all plain (greedy, or T > 0 without top-k/top-p/min-p)
        run kernels/sampling.py, one pass over the logits; the engine sets it on CUDA only, since
        that path draws a different random stream from the torch path for the same seed.
        pdl: launch those kernels with Programmatic Dependent Launch (EngineConfig.pdl, resolved
        by the engine: ops/pdl.py)."""
        self.fused = fused
        self.pdl = pdl

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], rngs: list[random.Random]
    ) -> tuple[list[int], list[float]]:
        """logits [B, V] (any dtype/device); one params and RNG per row. Greedy rows draw nothing."""
        out = self.sample(logits, params, rngs)
        return out.tokens, out.logprobs

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], rngs: list[random.Random]
    ) -> SampleOutput:
        """As __call__, plus the top-n log-probs of the rows that asked for them."""
        return self.launch(logits, params, rngs).resolve()

    def launch(
        self, logits: torch.Tensor, params: list[SamplingParams], rngs: list[random.Random]
    ) -> PendingSample:
        """Queue the sampling of a batch; the results stay on the device until resolve(). The RNG
        draws happen here, on the host, exactly as in sample()."""
        if self.fuses(params, logits.shape[-1]):
            return self._sample_fused(logits, params, rngs)
        logits = logits.float()
        batch, vocab = logits.shape
        device = logits.device
        # Host -> device without a stream sync (batch.host_to_device): on CUDA sampling is launched
        # while the forward may still be running, and with overlap scheduling a step ahead of it.
        temps = host_to_device(torch.tensor([p.temperature for p in params], dtype=torch.float32), device)
        greedy = temps == 0
        scaled = sanitize(logits / torch.where(greedy, 1.0, temps)[:, None])

        rows = [
            i
            for i, p in enumerate(params)
            if p.temperature > 0 and (0 < p.top_k < vocab or p.top_p < 1 or p.min_p > 0)
        ]
        if rows:
            idx = host_to_device(torch.tensor(rows), device)
            top_k = host_to_device(torch.tensor([params[i].top_k or vocab for i in rows]), device).clamp(
                max=vocab
            )
            top_p = host_to_device(torch.tensor([params[i].top_p for i in rows], dtype=torch.float32), device)
            min_p = None
            if any(params[i].min_p > 0 for i in rows):
                min_p = host_to_device(
                    torch.tensor([params[i].min_p for i in rows], dtype=torch.float32), device
                )
            scaled[idx] = truncate(scaled[idx], top_k, top_p, min_p)
        logp = torch.log_softmax(scaled, dim=-1)

        # Inverse-CDF sampling: one uniform per row from the row's own RNG (host side, so the
        # per-row cost is tiny), then one vectorised searchsorted for the batch. The first index
        # whose cumulative mass exceeds u * total always has non-zero mass.
        u = host_to_device(
            torch.tensor(
                [0.0 if p.temperature == 0 else rng.random() for p, rng in zip(params, rngs, strict=True)],
                dtype=torch.float64,
            ),
            device,
        )
        cdf = logp.double().exp().cumsum(dim=-1)
        drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=vocab - 1)
        best = scaled.argmax(dim=-1, keepdim=True)
        # Guard the u * total == total rounding corner, which would land on a masked token.
        drawn = torch.where(logp.gather(1, drawn) == float("-inf"), best, drawn)
        tokens = torch.where(greedy[:, None], best, drawn)
        chosen = logp.gather(1, tokens)
        assert tokens.shape == (batch, 1)
        return PendingSample.start(tokens[:, 0], chosen[:, 0], self._top_launch(logits, params), batch)

    def fuses(self, params: list[SamplingParams], vocab: int, top_n: bool = True) -> bool:
        """True if this batch samples on the fused kernel: the sampler is the fused one and every
        row is plain; with top_n=False, also no row asks for top-n log-probs (a decode graph's
        own sampling reports none)."""
        if not self.fused or not all(plain(p, vocab) for p in params):
            return False
        return top_n or all(p.logprobs is None for p in params)

    @staticmethod
    def fused_draws(params: list[SamplingParams], rngs: list[random.Random]) -> tuple[list[float], list[int]]:
        """The fused kernel's per-row inputs: (temperatures, seeds). One draw per sampled token
        from the row's RNG, as the torch path (a prefill service's first token advances the RNG
        by exactly one draw: engine._seed_first_tokens); greedy rows draw nothing."""
        temps = [p.temperature for p in params]
        seeds = [
            0 if p.temperature == 0 else int(rng.random() * 2**53)
            for p, rng in zip(params, rngs, strict=True)
        ]
        return temps, seeds

    def _sample_fused(
        self, logits: torch.Tensor, params: list[SamplingParams], rngs: list[random.Random]
    ) -> PendingSample:
        from ops.pdl import scope as pdl_scope
        from services.engine.kernels.sampling import fused_sample  # triton: only when used

        t, s = self.fused_draws(params, rngs)
        temps = torch.tensor(t, dtype=torch.float32)
        seeds = torch.tensor(s, dtype=torch.int64)
        if logits.is_cuda:
            # Pinned + non_blocking: a pageable copy would wait here for the forward to finish.
            temps = host_to_device(temps, logits.device)
            seeds = host_to_device(seeds, logits.device)
        with pdl_scope(self.pdl):
            tokens, logprobs = fused_sample(logits, temps, seeds)
        # Reading the tokens (PendingSample.resolve) is the step's wait for the GPU.
        top = (
            self._top_launch(logits.float(), params) if any(p.logprobs is not None for p in params) else None
        )
        return PendingSample.start(tokens, logprobs, top, len(params))

    @staticmethod
    def _top_launch(logits: torch.Tensor, params: list[SamplingParams]) -> TopLaunch | None:
        want = [p.logprobs for p in params]
        rows = [i for i, n in enumerate(want) if n is not None]
        if not rows:
            return None  # the common (RL) case costs nothing
        n = min(max(want[i] or 0 for i in rows), logits.shape[-1])
        idx = host_to_device(torch.tensor(rows), logits.device)
        raw = torch.log_softmax(sanitize(logits[idx]), dim=-1)
        values, ids = raw.topk(n, dim=-1) if n > 0 else (raw[:, :0], raw[:, :0].long())
        return TopLaunch(rows, want, values, ids)

    @staticmethod
    def _top_resolve(launch: TopLaunch | None, batch: int) -> list[list[tuple[int, float]] | None]:
        top: list[list[tuple[int, float]] | None] = [None] * batch
        if launch is None:
            return top
        values_l, ids_l = launch.values.tolist(), launch.ids.tolist()
        for j, i in enumerate(launch.rows):
            k = launch.want[i] or 0
            # -inf (a masked/NaN logit) is not JSON; report it as the most negative float.
            top[i] = [(t, max(v, LOWEST)) for t, v in zip(ids_l[j][:k], values_l[j][:k], strict=True)]
        return top
