"""Continuous batching with chunked prefill over the paged KV cache: what runs in the next step.

Every step has a budget of `max_num_batched_tokens` fed tokens. Running sequences go first, oldest
first: a decode feeds 1 token, a prompt still being prefilled feeds its next chunk (as much as the
budget and free pages allow), so a long prompt is split across steps instead of stalling every
decode behind it. What budget is left admits waiting sequences in arrival order (FIFO: if the head
does not fit, nobody behind it jumps the queue).

Pages run out as sequences grow. Then the newest running sequence is *preempted*: its pages are
released and it re-queues at the front, to be recomputed (prompt + output so far) when pages free
up; its full pages usually stay in the prefix cache, so the recompute is mostly cache hits. The
oldest sequence therefore always progresses, and any request that fits the pool on its own (which
validation guarantees) completes.

On admission the sequence's full pages are looked up in the prefix cache (block_manager.py); only the
tokens after the longest cached prefix are computed. The n samples of one request share their
prompt: the first prefills it and the others *fork* from it in the step its prefill completes
(they share its full prompt pages, copy the partly filled last one, and sample from its logits).

With overlap scheduling (docs/engine.md) a running sequence may hold one *pending* token, sampled
by the step still in flight: it is fed from the device, counts as one of the sequence's tokens, a
sequence whose pending token ends it by length is not scheduled again, and a sequence with a
pending token is never preempted.

A hybrid model's running sequences each hold a Mamba-2 state slot (state_cache.py), taken at
admission or fork and given back with the pages; its prefix caching is off.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Container
from dataclasses import dataclass, field

from services.engine.block_manager import block_hash, root_hash
from services.engine.kv_cache import KVCache
from services.engine.kv_transfer import PromptTail
from services.engine.sequence import RequestState, Sequence, Status
from services.engine.stats import EngineStats

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


@dataclass
class StepPlan:
    # (sequence, how many of its uncached tokens are fed this step)
    compute: list[tuple[Sequence, int]] = field(default_factory=list)
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)  # (child, parent in compute)

    @property
    def empty(self) -> bool:
        return not self.compute

    @property
    def num_seqs(self) -> int:
        return len(self.compute) + len(self.forks)


class Scheduler:
    def __init__(
        self,
        kv: KVCache,
        max_batch_size: int,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        prefix_caching: bool = True,
        stats: EngineStats | None = None,
    ):
        self.kv = kv
        self.blocks = kv.blocks
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        # A hybrid model's Mamba-2 states (state_cache.py): a slot per running sequence, and no
        # prefix caching (a cached page would skip tokens the state never saw).
        self.states = kv.states
        self.prefix_caching = prefix_caching and self.states is None
        self.stats = stats if stats is not None else EngineStats()
        self.version = 0  # salts the prefix-cache hashes of sequences admitted from now on
        # Keys of pages being copied in (PageExchange.landing_keys): a prefix that continues with
        # one is admitted once it has landed, not recomputed now.
        self.landing: Container[bytes] = frozenset()
        # Model/page-layout id in every hash chain's root (kv_transfer.layout_id; "" in tests).
        self.layout = ""
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: preemption takes from the end
        # Partial last prompt pages computed elsewhere (a same-host prefill's handoff), per waiting
        # sequence seeded with its first token: used, or dropped, at its first admission.
        self.tails: dict[Sequence, PromptTail] = {}
        self.tail_pages_used = 0
        # Writes a tail into the sequence's page: here, into this cache; a multi-rank engine's
        # ranks each write their part of it (parallel/pages.py GatheringPageExchange.write_tail).
        self.write_tail: Callable[[PromptTail, int], None] = lambda tail, page: tail.write(self.kv, page)
        # Prompt page keys computed off the loop thread (the pull that staged the pages), per
        # waiting sequence: (weight version, keys). Used at first admission when the version is
        # still the salt, else recomputed; dropped either way.
        self.known_keys: dict[Sequence, tuple[int, list[bytes]]] = {}

    def add(self, request: RequestState) -> None:
        # Samples already finished (their first token came from a prefill service) never run.
        self.waiting.extend(s for s in request.seqs if s.status is not Status.FINISHED)
        for s in request.seqs:
            # The length at which max_tokens or max_seq_len ends it (engine._stop_reason).
            s.max_len = min(len(s.prompt) + s.params.max_tokens, self.kv.max_seq_len)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        bs = self.kv.block_size
        # Requests whose prompt prefill completes in this step: their waiting samples fork.
        completing: dict[RequestState, Sequence] = {}

        def add(seq: Sequence, n: int) -> None:
            nonlocal budget
            plan.compute.append((seq, n))
            budget -= n
            if not seq.output and seq.num_cached + n == len(seq.prompt):
                completing[seq.request] = seq

        starved = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            cached = seq.num_cached
            # Overlap scheduling: a token sampled by the step in flight is not in seq.output yet.
            pend = seq.pending
            total = len(seq.prompt) + len(seq.output) + pend
            if pend and total >= seq.max_len:
                i += 1  # it finishes by length when that token lands: no forward for a discarded token
                continue
            if cached + 1 == total and cached < len(seq.block_table) * bs and (seq.output or pend):
                # Fast path, almost every sequence of a decode step: one token, and its page is
                # already there (no allocation, so no preemption); the same outcome as below.
                plan.compute.append((seq, 1))
                budget -= 1
                i += 1
                continue
            want = min(seq.num_tokens + pend - cached, budget)
            # Free pages first; a prefill chunk shrinks to what fits before anyone is preempted.
            fit = (len(seq.block_table) + self.kv.num_free) * bs - seq.num_cached
            while fit < 1 and self.running[-1] is not seq and not self.running[-1].pending:
                self._preempt(self.running.pop())
                fit = (len(seq.block_table) + self.kv.num_free) * bs - seq.num_cached
            if fit < 1:
                if self.running[-1].pending:
                    # Overlap scheduling never preempts a sequence whose token is in flight (its
                    # pages hold what that token's bookkeeping reads, e.g. routed experts): this
                    # step leaves the rest out, and the next one, with that token landed, preempts.
                    starved = True
                    break
                self._preempt(self.running.pop())  # it is the newest: it waits for older ones
                break
            n = min(want, fit)
            self._grow(seq, seq.num_cached + n)
            add(seq, n)
            i += 1

        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size and not starved:
            seq = self.waiting[0]
            if seq.pending:
                break  # a guard: a sequence with a token in flight is never preempted (above)
            parent = completing.get(seq.request)
            if parent is not None and not seq.output:
                if not self._fork(seq, parent):
                    break
                plan.forks.append((seq, parent))
            else:
                if any(
                    s.request is seq.request and not s.output and s.num_cached < len(s.prompt)
                    for s in self.running
                ):
                    break  # a sibling is still prefilling this prompt: fork from it later
                n = self._admit(seq, budget)
                if n == 0:
                    break
                add(seq, n)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
        return plan

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        """Allocate pages so the table covers num_tokens positions (the caller checked num_free)."""
        while len(seq.block_table) < self.kv.blocks_for(num_tokens):
            seq.block_table.append(self.blocks.allocate())

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Give a waiting sequence its cached prefix and pages for its first chunk; return the
        chunk's length, or 0 (touching nothing) if the pages are not there."""
        bs = self.kv.block_size
        seq.salt = self.version
        hits: list[int] = []
        hashes: list[bytes] = []
        if self.prefix_caching:
            tokens = seq.tokens()
            prev = root_hash(seq.salt, self.layout)
            known = self.known_keys.get(seq)
            keys = known[1] if known is not None and known[0] == seq.salt else []
            # At least the last token is computed: its logits give the next token.
            for i in range((len(tokens) - 1) // bs):
                prev = keys[i] if i < len(keys) else block_hash(prev, tokens[i * bs : (i + 1) * bs])
                block = self.blocks.lookup(prev)
                if block is None:
                    if prev in self.landing:
                        return 0  # its next page is landing: wait for it (a step or a few)
                    break
                hits.append(block)
                hashes.append(prev)
        cached = len(hits) * bs
        tail = self._tail(seq, hashes) if self.tails else None
        if tail is not None:
            cached = len(seq.prompt)  # the whole prompt: only the seeded token(s) are fed
        n = min(seq.num_tokens - cached, budget)
        # Cached pages nobody uses sit in the evictable pool: taking them costs free pages too.
        cost = sum(self.blocks.ref[b] == 0 for b in hits) + self.kv.blocks_for(cached + n) - len(hits)
        if cost > self.kv.num_free or (self.states is not None and not self.states.num_free):
            return 0
        if self.states is not None:
            seq.state_slot = self.states.allocate()  # zeroed when its first span runs
        self.tails.pop(seq, None)  # one chance: after a preemption the tail is recomputed
        self.known_keys.pop(seq, None)
        for b in hits:
            self.blocks.acquire(b)
        seq.block_table, seq.block_hashes, seq.num_cached = hits, hashes, cached
        self._grow(seq, cached + n)
        if tail is not None:  # into its own page after the hits, never a cached one
            self.write_tail(tail, seq.block_table[len(hashes)])
            self.tail_pages_used += 1
        self.stats.prefix_cache_queried_tokens += seq.num_tokens
        self.stats.prefix_cache_hit_tokens += cached
        return n

    def _tail(self, seq: Sequence, hashes: list[bytes]) -> PromptTail | None:
        """The staged tail of `seq` if it continues exactly its cached prefix: every full prompt
        page is a hit (no more: a longer hit already covers the tail's page), a seeded token is left
        to feed, and the tail's key is the tail_hash of this chain (same weights and layout, same
        tokens); else None and the tail's tokens are computed."""
        tail = self.tails.get(seq)
        bs = self.kv.block_size
        full = len(seq.prompt) // bs
        if tail is None or len(hashes) != full or seq.num_tokens <= len(seq.prompt):
            return None
        prev = hashes[-1] if hashes else root_hash(seq.salt, self.layout)
        return tail if tail.matches(prev, seq.prompt[full * bs :]) else None

    def _fork(self, child: Sequence, parent: Sequence) -> bool:
        """Reserve the child's private copy of the parent's partly filled last prompt page (the
        engine fills it and shares the full pages after the forward)."""
        partial = len(parent.prompt) % self.kv.block_size != 0
        if partial and self.kv.num_free < 1:
            return False
        if self.states is not None:
            if not self.states.num_free:
                return False
            child.state_slot = self.states.allocate()  # the parent's state, copied after the forward
        child.block_table = [self.blocks.allocate()] if partial else []
        return True

    def finish_forks(self, plan: StepPlan) -> None:
        """After the forward: children share the parent's full prompt pages."""
        bs = self.kv.block_size
        for child, parent in plan.forks:
            full = len(parent.prompt) // bs
            shared = parent.block_table[:full]
            for b in shared:
                self.blocks.acquire(b)
            if child.block_table:
                self.kv.copy_block(parent.block_table[full], child.block_table[0])
            if self.states is not None:
                self.states.copy(parent.state_slot, child.state_slot)
            child.block_table = shared + child.block_table
            child.block_hashes = parent.block_hashes[:full]
            child.salt = parent.salt
            child.num_cached = len(parent.prompt)

    def register_full_pages(self, seq: Sequence) -> None:
        """Publish the sequence's newly completed pages in the prefix cache."""
        if not self.prefix_caching:
            return
        bs = self.kv.block_size
        if len(seq.block_hashes) >= seq.num_cached // bs:
            return
        tokens = seq.tokens()
        while len(seq.block_hashes) < seq.num_cached // bs:
            i = len(seq.block_hashes)
            prev = seq.block_hashes[-1] if seq.block_hashes else root_hash(seq.salt, self.layout)
            h = block_hash(prev, tokens[i * bs : (i + 1) * bs])
            self.blocks.register(seq.block_table[i], h)
            seq.block_hashes.append(h)

    # ------------------------------------------------------------------ releasing pages

    def _free_pages(self, seq: Sequence) -> None:
        # Last page first, so under LRU a prefix's tail is evicted before its head (a chain is
        # useless without its head).
        for b in reversed(seq.block_table):
            self.blocks.release(b)
        seq.block_table, seq.block_hashes, seq.num_cached = [], [], 0
        if seq.state_slot >= 0:
            assert self.states is not None
            self.states.release(seq.state_slot)  # a preempted sequence recomputes from zero
            seq.state_slot = -1

    def _preempt(self, seq: Sequence) -> None:
        self._free_pages(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.stats.preemptions_total += 1

    def release_finished(self) -> None:
        done = [s for s in self.running if s.status is Status.FINISHED]
        for s in done:
            self._free_pages(s)
        if done:
            self.running = [s for s in self.running if s.status is not Status.FINISHED]

    def abort(self, request: RequestState) -> None:
        """Drop a request's sequences wherever they are (finish_reason "abort"); frees their pages."""
        for s in request.seqs:
            self.tails.pop(s, None)
            self.known_keys.pop(s, None)
            if s.status is not Status.FINISHED:
                s.status, s.finish_reason = Status.FINISHED, "abort"
        self.waiting = deque(s for s in self.waiting if s.request is not request)
        self.release_finished()

    def requests(self) -> list[RequestState]:
        return list(dict.fromkeys(s.request for s in [*self.waiting, *self.running]))

    def abort_all(self) -> list[RequestState]:
        requests = self.requests()
        for r in requests:
            self.abort(r)
        return requests
