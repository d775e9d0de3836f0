"""Per-request and per-sample state. A request with SamplingParams.n = k owns k Sequences; each
is scheduled, cached and sampled on its own, and the request completes when all k have."""

from __future__ import annotations

import hashlib
import random
import secrets
import time
from enum import Enum, auto

from tokenizers import Tokenizer

from services.common.schemas import (
    GenerateChoice,
    GenerateRequest,
    GenerateResponse,
    RoutedExperts,
    SamplingParams,
)
from services.engine.detokenizer import OutputText


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


def sample_seed(seed: int | None, index: int) -> int:
    """The RNG seed of choice `index` of a request: derived from (seed, index) by hashing, so the
    n samples of one request, and requests with nearby seeds, draw unrelated streams."""
    if seed is None:
        return secrets.randbits(63)
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Sequence:
    def __init__(self, request: RequestState, index: int):
        self.request = request
        self.index = index
        self.prompt = request.prompt
        self.params = request.params
        # An RNG per sample: its draws do not depend on which other sequences share the batch (or
        # on the device), so a seeded request reproduces exactly. The sampler needs one uniform per
        # token; a host-side random.Random gives it in ~0.1 us where a torch.Generator draw plus
        # .item() costs ~5 us, which at a batch of 256 was a third of a GPU decode step.
        self.rng = random.Random(sample_seed(request.params.seed, index))
        self.output: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        # Only for requests that asked for top-n log-probs / text (the RL hot path needs neither).
        self.top_logprobs: list[list[tuple[int, float]]] | None = (
            [] if self.params.logprobs is not None else None
        )
        self.text: OutputText | None = None
        if request.tokenizer is not None and (self.params.stop or self.params.detokenize):
            self.text = OutputText(request.tokenizer, self.prompt, self.params.stop)
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        # KV pages holding positions 0.. (kv_cache.py); empty while waiting.
        self.block_table: list[int] = []
        # Chained prefix-cache hashes of the first len(block_hashes) pages (full and computed),
        # rooted at `salt`: the weight version when the sequence was (re)admitted.
        self.block_hashes: list[bytes] = []
        self.salt = 0
        # Its slot in the Mamba-2 state cache (state_cache.py) while running; -1 without one.
        self.state_slot = -1
        # Tokens whose K/V are in the cache; the rest (the prompt, fed in chunks, then the last
        # sampled token) are fed in later steps. 0 again after a preemption: recomputed.
        self.num_cached = 0
        # Overlap scheduling (docs/engine.md): tokens sampled on the device but not yet appended
        # (0 or 1 between steps), and the row of the latest one in the in-flight step's sample.
        self.pending = 0
        self.pending_row = 0
        self.max_len = 1 << 62  # set by Scheduler.add: the length at which max_tokens/max_seq_len end it
        # Set by the engine when the sample finishes, if the request asked for routed experts.
        self.routed_experts: RoutedExperts | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def uncached_tokens(self) -> list[int]:
        if self.num_cached < len(self.prompt):
            return self.prompt[self.num_cached :] + self.output
        return self.output[self.num_cached - len(self.prompt) :]

    def append(
        self, token: int, logprob: float, version: int, top: list[tuple[int, float]] | None = None
    ) -> None:
        self.output.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if self.top_logprobs is not None:
            self.top_logprobs.append(top or [])

    def choice(self) -> GenerateChoice:
        return GenerateChoice(
            output_ids=list(self.output),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            finish_reason=self.finish_reason or "abort",  # type: ignore[arg-type]
            top_logprobs=None if self.top_logprobs is None else [list(t) for t in self.top_logprobs],
            text=None if self.text is None else self.text.text,
            stop_str=None if self.text is None else self.text.stop_str,
            routed_experts=self.routed_experts,
        )


class RequestState:
    def __init__(self, request_id: str, req: GenerateRequest, tokenizer: Tokenizer | None = None):
        self.request_id = request_id
        self.prompt: list[int] = list(req.input_ids)
        self.params: SamplingParams = req.sampling
        self.return_routed_experts = req.return_routed_experts
        self.tokenizer = tokenizer  # for stop strings / output text
        self.arrival = time.monotonic()
        self.seqs = [Sequence(self, i) for i in range(req.sampling.n)]

    @property
    def finished(self) -> bool:
        return all(s.status is Status.FINISHED for s in self.seqs)

    def response(self) -> GenerateResponse:
        return GenerateResponse(
            request_id=self.request_id,
            prompt_tokens=len(self.prompt),
            choices=[s.choice() for s in self.seqs],
        )
