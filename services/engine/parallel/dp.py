"""Data-parallel attention on rank 0: one scheduler and page pool per attention group.

With `dp_attention = G` the engine's ranks form G attention groups (tp ranks each); every group
holds its own requests' KV and runs attention on them, while the MoE layers' experts are split over
all ranks. Rank 0 schedules for every group, as SGLang's data-parallel controller hands each
request to one attention rank and then runs all ranks in lockstep:

- `GroupedScheduler` gives each request to one group at arrival (all its samples together: they
  share the prompt's pages) and keeps one `Scheduler` per group over that group's pool. It offers
  the single `Scheduler`'s interface to LLMEngine, so the engine's step (schedule, spans, sampling
  rows, page bookkeeping, commit) runs unchanged over the groups' concatenated plans.
- The policy: the group that would hold the longest prefix of the prompt (its cached pages, then
  the pages staged for import from a prefill's handoff or a store pull while its free pages last:
  reused instead of recomputed), then the group with the least outstanding work (tokens still to
  compute or generate), then the lowest index. The staged pages are then imported into the chosen
  group's pool (`place`: parallel/pages.py GroupedPageExchange), before admission.
- `group_pages` is a group's pool as rank 0 tracks it without holding it: the page allocator and
  prefix cache (on the meta device: no KV memory) and the routing store on the host, filled from
  the routed ids the group's ranks send back after each step (Router Replay reads them at commit).
  Rank 0's own group uses its real cache.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Container, Iterable

import torch

from services.common.config import ModelConfig
from services.common.routing import unrecorded
from services.engine.block_manager import block_hash, root_hash
from services.engine.kv_cache import KVCache
from services.engine.kv_transfer import PromptTail
from services.engine.parallel.runner import RecordingKVCache
from services.engine.scheduler import Scheduler, StepPlan
from services.engine.sequence import RequestState, Sequence
from services.engine.stats import EngineStats


def group_pages(
    m: ModelConfig, num_blocks: int, block_size: int, max_seq_len: int, max_seqs: int = 1
) -> RecordingKVCache:
    """Another attention group's pool as rank 0 keeps it: pages and prefix cache (meta tensors),
    the routing store on the host, a hybrid model's `max_seqs` state slots (numbers handed out
    here, states on meta tensors); page and state copies recorded for the group's ranks."""
    kv = RecordingKVCache.for_model(
        m, num_blocks, block_size, max_seq_len, torch.float32, torch.device("meta"), max_seqs
    )
    if kv.routing is not None:
        fill = unrecorded(kv.routing_dtype) if kv.routing.dtype == torch.uint8 else -1
        kv.routing = torch.full(kv.routing.shape, fill, dtype=kv.routing.dtype)
    return kv


class GroupedScheduler:
    """One Scheduler per attention group behind the Scheduler interface LLMEngine uses."""

    def __init__(
        self,
        pools: list[KVCache],
        max_batch_size: int,
        max_num_batched_tokens: int,
        prefix_caching: bool,
        stats: EngineStats,
    ) -> None:
        """pools[g]: group g's cache (rank 0's real one for its own group). `max_batch_size` is
        the engine's, shared out over the groups (as the capacity plan counts it, sbatch/plan.py);
        `max_num_batched_tokens` bounds each group's forward, as it bounds one rank's."""
        per_group = max(1, max_batch_size // len(pools))
        self.groups = [
            Scheduler(kv, per_group, max_num_batched_tokens, prefix_caching, stats) for kv in pools
        ]
        self.kv = pools[0]
        self.stats = stats
        self.prefix_caching = self.groups[0].prefix_caching
        self.group_of: dict[RequestState, int] = {}
        # Filled by the engine before add() (a pulled prompt's keys, a handed-off tail); moved to
        # the chosen group's scheduler there.
        self.known_keys: dict[Sequence, tuple[int, list[bytes]]] = {}
        self.tails: dict[Sequence, PromptTail] = {}
        self.plans: list[StepPlan] = []  # the groups' parts of the last schedule()
        # Set by the engine when pages move (parallel/pages.py GroupedPageExchange): the keys of
        # pages staged for import, and the import of a prompt's staged pages into its group.
        self.incoming: Callable[[], set[bytes]] = set
        self.place: Callable[[set[bytes], int], int] | None = None

    # The settings the engine writes apply to every group.
    @property
    def version(self) -> int:
        return self.groups[0].version

    @version.setter
    def version(self, v: int) -> None:
        for s in self.groups:
            s.version = v

    @property
    def layout(self) -> str:
        return self.groups[0].layout

    @layout.setter
    def layout(self, v: str) -> None:
        for s in self.groups:
            s.layout = v

    @property
    def landing(self) -> Container[bytes]:
        return self.groups[0].landing

    @landing.setter
    def landing(self, v: Container[bytes]) -> None:
        for s in self.groups:
            s.landing = v

    @property
    def waiting(self) -> deque[Sequence]:
        return deque(s for g in self.groups for s in g.waiting)

    @property
    def running(self) -> list[Sequence]:
        return [s for g in self.groups for s in g.running]

    # ------------------------------------------------------------------ placement

    def choose(
        self, request: RequestState, keys: list[bytes] | None = None, staged: set[bytes] | None = None
    ) -> int:
        """The group a new request runs in: the longest prompt prefix it will hold (cached, or
        staged for import and fitting in its free pages), then least work."""
        if staged is None:
            staged = self.incoming() if self.place is not None else set()
        keys = self._prompt_keys(request, staged) if keys is None else keys
        if not any(k in staged for k in keys):
            # The page holding the last prompt token is computed for its logits anyway.
            keys = keys[: (len(request.prompt) - 1) // self.kv.block_size]
        hits = self._prefix_pages(keys, staged)
        load = [self._work(g) for g in self.groups]
        return min(range(len(self.groups)), key=lambda g: (-hits[g], load[g], g))

    def _prompt_keys(self, request: RequestState, staged: set[bytes]) -> list[bytes]:
        """The keys of the prompt's leading full pages (the chain the prefix cache and the store
        use) that some group caches or that are staged: the pull's keys when it left them
        (admission's known_keys), else hashed here up to the first page nobody has."""
        if not self.prefix_caching:
            return []
        for seq in request.seqs:
            known = self.known_keys.get(seq)
            if known is not None and known[0] == self.version:
                return known[1]
        prompt, bs = request.prompt, self.kv.block_size
        prev = root_hash(self.version, self.layout)
        out = []
        for i in range(len(prompt) // bs):
            prev = block_hash(prev, prompt[i * bs : (i + 1) * bs])
            if prev not in staged and all(s.blocks.lookup(prev) is None for s in self.groups):
                break
            out.append(prev)
        return out

    def _prefix_pages(self, keys: list[bytes], staged: set[bytes]) -> list[int]:
        """Per group, how many of the prompt's leading pages it would hold once the staged pages
        are imported there: cached ones, then staged ones while its free pages last."""
        counts = []
        for s in self.groups:
            free, n = s.blocks.num_free, 0
            for k in keys:
                if s.blocks.lookup(k) is None:
                    if k not in staged or free == 0:
                        break
                    free -= 1
                n += 1
            counts.append(n)
        return counts

    def chain_group(self, hashes: list[bytes], pin: list[bytes]) -> int:
        """Where a staged chain no request claimed goes: the group holding most of its cached head
        (`pin`) and pages, then least work."""
        held = [sum(s.blocks.lookup(h) is not None for h in (*pin, *hashes)) for s in self.groups]
        load = [self._work(s) for s in self.groups]
        return min(range(len(self.groups)), key=lambda g: (-held[g], load[g], g))

    @staticmethod
    def _work(s: Scheduler) -> int:
        return sum(q.max_len - q.num_cached for q in (*s.waiting, *s.running))

    def add(self, request: RequestState) -> None:
        staged = self.incoming() if self.place is not None else set()
        keys = self._prompt_keys(request, staged)
        g = self.choose(request, keys, staged)
        if self.place is not None:
            self.place(set(keys), g)  # the prompt's staged pages land in its group's pool
        self.group_of[request] = g
        sched = self.groups[g]
        for s in request.seqs:
            if s in self.known_keys:
                sched.known_keys[s] = self.known_keys.pop(s)
            if s in self.tails:
                sched.tails[s] = self.tails.pop(s)
        sched.add(request)

    def has_work(self) -> bool:
        return any(s.has_work() for s in self.groups)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> StepPlan:
        """Every group's plan, concatenated in group order (`plans` keeps the parts)."""
        self.plans = [s.schedule() for s in self.groups]
        return StepPlan([c for p in self.plans for c in p.compute], [f for p in self.plans for f in p.forks])

    def bounds(self) -> list[int]:
        """Where each group's sequences start in the last plan's compute list (and its end)."""
        out = [0]
        for p in self.plans:
            out.append(out[-1] + len(p.compute))
        return out

    def finish_forks(self, plan: StepPlan) -> None:
        for s, part in zip(self.groups, self.plans, strict=True):
            if part.forks:
                s.finish_forks(part)

    def register_full_pages(self, seq: Sequence) -> None:
        self.groups[self.group_of[seq.request]].register_full_pages(seq)

    def pool_of(self, seq: Sequence) -> KVCache:
        return self.groups[self.group_of[seq.request]].kv

    # ------------------------------------------------------------------ releasing

    def release_finished(self) -> None:
        for s in self.groups:
            s.release_finished()
        self._forget(r for r in list(self.group_of) if r.finished)

    def abort(self, request: RequestState) -> None:
        g = self.group_of.get(request)
        if g is not None:
            self.groups[g].abort(request)
        self._forget([request])

    def requests(self) -> list[RequestState]:
        return [r for s in self.groups for r in s.requests()]

    def abort_all(self) -> list[RequestState]:
        requests = self.requests()
        for r in requests:
            self.abort(r)
        return requests

    def _forget(self, requests: Iterable[RequestState]) -> None:
        for r in requests:
            self.group_of.pop(r, None)
            for s in r.seqs:
                self.known_keys.pop(s, None)
                self.tails.pop(s, None)
