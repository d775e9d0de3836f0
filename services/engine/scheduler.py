"""Continuous batching: which sequences run in the next step.

Every step decodes all running sequences and admits waiting ones while the KV cache has free
slots (and the step's prefill token budget lasts), so new requests join at the next step instead
of waiting for a batch to drain. Requests beyond capacity simply stay queued.

The n samples of one request share their prompt: the first admitted sample prefills it and the
others admitted in the same step *fork* from it (copy its prompt KV, sample from its logits).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.engine.kv_cache import KVCache
from services.engine.sequence import RequestState, Sequence, Status

# Prompt tokens admitted per step (a step always admits at least one prompt). Bounds one step's
# latency and attention padding when many long prompts arrive together.
DEFAULT_MAX_PREFILL_TOKENS = 8192


@dataclass
class StepPlan:
    compute: list[Sequence] = field(default_factory=list)  # feed tokens: new prefills, then decodes
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)  # (child, parent in compute)

    @property
    def empty(self) -> bool:
        return not self.compute

    @property
    def num_seqs(self) -> int:
        return len(self.compute) + len(self.forks)


class Scheduler:
    def __init__(self, kv: KVCache, max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS):
        self.kv = kv
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, request: RequestState) -> None:
        self.waiting.extend(request.seqs)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        decodes = list(self.running)
        budget = self.max_prefill_tokens
        prefilling: dict[RequestState, Sequence] = {}
        while self.waiting and self.kv.num_free > 0:
            seq = self.waiting[0]
            parent = prefilling.get(seq.request)
            if parent is not None:
                plan.forks.append((seq, parent))
            else:
                cost = len(seq.uncached_tokens())
                if plan.compute and cost > budget:
                    break
                budget -= cost
                prefilling[seq.request] = seq
                plan.compute.append(seq)
            self.waiting.popleft()
            seq.slot = self.kv.allocate()
            seq.status = Status.RUNNING
            self.running.append(seq)
        plan.compute.extend(decodes)
        return plan

    def release_finished(self) -> None:
        done = [s for s in self.running if s.status is Status.FINISHED]
        for s in done:
            self.kv.free(s.slot)
            s.slot = -1
        if done:
            self.running = [s for s in self.running if s.status is not Status.FINISHED]

    def abort(self, request: RequestState) -> None:
        """Drop a request's sequences wherever they are (finish_reason "abort")."""
        for s in request.seqs:
            if s.status is not Status.FINISHED:
                s.status, s.finish_reason = Status.FINISHED, "abort"
        self.waiting = deque(s for s in self.waiting if s.request is not request)
        self.release_finished()

    def abort_all(self) -> list[RequestState]:
        requests = list(dict.fromkeys(s.request for s in [*self.waiting, *self.running]))
        for r in requests:
            self.abort(r)
        return requests
