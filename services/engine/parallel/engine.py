"""The engine over several ranks: rank 0 is an LLMEngine whose model and KV cache are its shards;
ranks 1.. run `run_worker` (services/engine/parallel/runner.py).

Rank 0 keeps everything the single-rank engine does on the host (requests, the scheduler and its
page tables, prefix cache, preemption, forks, stop conditions, routed-expert read-back), and each
step it sends the forward's inputs to the other ranks (a `LeanStep`: the page tables' changes
only, parallel/orders.py), runs its own shard and takes
the sampled tokens, identical on every rank. Weight updates go to every rank in step order, each
rank reading its own slices.

With data-parallel attention (`dp_attention` > 1) rank 0 keeps one scheduler and page pool per
attention group (services/engine/parallel/dp.py): each step it sends every group only its own part
of the plan (an idle group joins the MoE layers' exchanges with no tokens) and each
group's first rank sends back its samples and the routed expert ids of the tokens it forwarded
(Router Replay reads them from rank 0's copy of the group's routing store).

On CUDA every rank takes the single-rank fast path where it applies (RankRunner.prepare: paged
attention kernels, fused elementwise kernels, decode CUDA graphs captured in step on every rank,
none with expert parallelism); rank 0 names each decode step's graph in the StepOrder. Not on
this path: the fused sampler (the vocabulary is split), graphs of mixed steps, the batch-1
megakernel and overlap scheduling (each step is synchronous). KV pages move whole: an export
gathers the KV heads of the ranks of the sequence's attention group, an import scatters them to
the ranks of the group its request is placed in (parallel/pages.py).
"""

from __future__ import annotations

import time
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from services.common.config import EngineConfig, ParallelConfig
from services.common.gpu_memory import cap_process_memory
from services.engine.batch import Span
from services.engine.kv_cache import KVCache
from services.engine.layers.sampler import SampleOutput
from services.engine.llm_engine import LLMEngine
from services.engine.loader import Checkpoint, WeightsError
from services.engine.overlap import Feed
from services.engine.parallel.dp import GroupedScheduler, group_pages
from services.engine.parallel.group import EngineGroups
from services.engine.parallel.model import local_config
from services.engine.parallel.orders import LeanStep, Ledger, send, send_each
from services.engine.parallel.pages import GatheringPageExchange, GroupedPageExchange
from services.engine.parallel.runner import (
    RecordingKVCache,
    StartOrder,
    StepOrder,
    StopOrder,
    WeightsOrder,
    build_runner,
    group_slots,
    rank_device,
)
from services.engine.parallel.vocab import ShardedSampler
from services.engine.scheduler import Scheduler, StepPlan
from services.engine.sequence import RequestState, Sequence
from services.engine.stats import EngineStats


@dataclass
class Sampled:
    """A step's samples, already on the host (the multi-rank step is synchronous)."""

    out: SampleOutput

    def resolve(self) -> SampleOutput:
        return self.out


class ParallelEngine(LLMEngine):
    """Rank 0 of a multi-rank engine: LLMEngine's API (generate, step, add_request, weights)."""

    def __init__(
        self,
        model_dir: str | Path,
        cfg: EngineConfig,
        par: ParallelConfig,
        groups: EngineGroups,
        version: int | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
        device_path: bool | None = None,
        check_orders: bool = False,
    ) -> None:
        """on_failure: called when a step or a weight update fails. The ranks are then out of step
        (a peer may have died, or missed an order), so the group cannot go on: a service exits
        there and its supervisor restarts every rank. Without it the error is raised as is.
        device_path: RankRunner.prepare's (the workers' run_worker must be given the same).
        check_orders: every order carries a digest of the page tables the workers must hold (they
        raise on a mismatch): for tests."""
        if groups.world.rank != 0:
            raise ValueError("ranks other than 0 run runner.run_worker")
        self.par, self.groups = par, groups
        self.on_failure = on_failure
        self.cfg = cfg
        self.device = rank_device(cfg, groups.world.rank)
        self.memory_cap = cap_process_memory(self.device, cfg.cuda_memory_gib)
        self.dtype = getattr(torch, cfg.dtype)
        # The workers build their shards of the same directory meanwhile.
        send(groups, StartOrder(str(model_dir)))
        self.runner = build_runner(model_dir, cfg, par, groups, device_path)
        ckpt = self.runner.checkpoint
        assert ckpt is not None
        self.model_config = m = ckpt.config
        self.max_seq_len = self.runner.max_seq_len
        self.model, self.kv = self.runner.model, self.runner.kv
        self.stats = EngineStats()
        self.grouped: GroupedScheduler | None = None
        # What each attention group's workers know of the page tables (parallel/orders.py).
        self.ledgers = [Ledger(check_orders) for _ in range(par.dp_attention)]
        self._span_seqs: list[Sequence] = []
        if par.dp_attention > 1:
            kv = self.kv
            local = local_config(m, par)
            pools = [kv] + [
                group_pages(local, kv.num_blocks, kv.block_size, self.max_seq_len, group_slots(cfg, par))
                for _ in range(1, par.dp_attention)
            ]
            self.grouped = GroupedScheduler(
                pools, cfg.max_batch_size, cfg.max_num_batched_tokens, cfg.enable_prefix_caching, self.stats
            )
            self.scheduler = self.grouped  # type: ignore[assignment]
        else:
            self.scheduler = Scheduler(
                self.kv, cfg.max_batch_size, cfg.max_num_batched_tokens, cfg.enable_prefix_caching, self.stats
            )
        self.eos_token_ids = set(ckpt.eos_token_ids)
        tok_file = ckpt.path / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(tok_file)) if tok_file.is_file() else None
        self.watchers = {}
        self.model_dir = ckpt.path
        self.version = self.scheduler.version = version if version is not None else (ckpt.version or 0)
        # Pages move whole under the single-rank layout (parallel/pages.py), each attention
        # group's through its own ranks.
        if self.grouped is None:
            self.pages = GatheringPageExchange(self.kv, m, groups)
            self.scheduler.write_tail = self.pages.write_tail
        else:
            grouped = self.grouped
            parts = [GatheringPageExchange(s.kv, m, groups, g) for g, s in enumerate(grouped.groups)]
            for s, part in zip(grouped.groups, parts, strict=True):
                s.write_tail = part.write_tail
            self.pages = GroupedPageExchange(
                parts, lambda seq: grouped.group_of[seq.request], grouped.chain_group
            )
            grouped.incoming, grouped.place = self.pages.staged_keys, self.pages.import_for
        self.layout = self.scheduler.layout = self.pages.layout
        self.scheduler.landing = self.pages.landing_keys
        self._born_finished = []
        self._inflight = None
        self._resolve_s = 0.0
        self._prefill_lag = None
        self.overlap = False
        self.background = False
        self.model.megakernel = None  # one kernel over every layer: no room for a collective

    def step(self) -> list[RequestState]:
        try:
            return super().step()
        except BaseException as e:
            self._failed(e)
            raise

    def _failed(self, e: BaseException) -> None:
        if self.on_failure is not None:
            self.on_failure(e)

    def spans(self, plan: StepPlan) -> list[Span]:
        self._span_seqs = [s for s, _ in plan.compute]  # whose page table each span carries
        return super().spans(plan)

    def _launch(
        self, spans: list[Span], seqs: list[Sequence], rows: list[int], feed: Feed | None = None
    ) -> Sampled | None:
        assert feed is None, "a multi-rank engine does not overlap steps"
        params = [s.params for s in seqs]
        draws = ShardedSampler.draws(params, [s.rng for s in seqs])
        if self.grouped is not None:
            return Sampled(self._launch_groups(self.grouped, spans, seqs, rows, draws))
        kv = self.kv
        assert isinstance(kv, RecordingKVCache)
        lean = self.ledgers[0].order(spans, self._span_seqs, rows, seqs, draws)
        lean.copies, lean.state_copies = kv.take_copies(), kv.take_state_copies()
        lean.graph = self.runner.graph_size(spans)
        send(self.groups, lean)
        # Rank 0 made its page and state copies already.
        out = self.runner.step(StepOrder(spans, rows, params, draws, graph=lean.graph))
        return Sampled(out) if out is not None else None

    def _launch_groups(
        self,
        grouped: GroupedScheduler,
        spans: list[Span],
        seqs: list[Sequence],
        rows: list[int],
        draws: list[float],
    ) -> SampleOutput:
        """One step over the attention groups: each only its part of the plan, the samples back
        in `seqs` order, other groups' routed ids into rank 0's copy of their routing store."""
        bounds = grouped.bounds()
        pools = [s.kv for s in grouped.groups]
        where: list[list[int]] = [[] for _ in pools]  # each group's samples' places in `seqs`
        for i, row in enumerate(rows):
            where[bisect_right(bounds, row) - 1].append(i)
        parts: list[LeanStep | None] = []
        for g, pool in enumerate(pools):
            assert isinstance(pool, RecordingKVCache)
            lo, hi = bounds[g], bounds[g + 1]
            if g == 0 and self.par.tp == 1:  # rank 0 is its group: nobody to tell (copies made)
                pool.take_copies()
                pool.take_state_copies()
                parts.append(None)
                continue
            lean = self.ledgers[g].order(
                spans[lo:hi],
                self._span_seqs[lo:hi],
                [rows[i] - lo for i in where[g]],
                [seqs[i] for i in where[g]],
                [draws[i] for i in where[g]],
            )
            lean.copies, lean.state_copies = pool.take_copies(), pool.take_state_copies()
            # Every forwarded token's ids come back, not only those of requests asking now: a later
            # request that asks may reuse these pages from the prefix cache.
            lean.routing = g > 0
            parts.append(lean)
        send_each(self.groups, parts)
        own = where[0]
        mine = StepOrder(spans[: bounds[1]], [rows[i] for i in own], [seqs[i].params for i in own])
        mine.draws = [draws[i] for i in own]
        results = self.runner.gather_group(self.runner.step_group(mine))  # copies made already
        assert results is not None
        n = len(seqs)
        out = SampleOutput([0] * n, [0.0] * n, [None] * n)
        tp = self.par.tp
        for g, places in enumerate(where):
            res = results[g * tp]
            if g > 0 and res is not None and res.routing is not None:
                routing = pools[g].routing
                assert routing is not None and res.slots is not None
                routing[:, torch.from_numpy(res.slots)] = torch.from_numpy(res.routing)
            if not places:
                continue
            got = res.out if res is not None else None
            if got is None or len(got.tokens) != len(places):
                raise RuntimeError(f"attention group {g} returned no samples for {len(places)} rows")
            for j, i in enumerate(places):
                out.tokens[i], out.logprobs[i], out.top[i] = got.tokens[j], got.logprobs[j], got.top[j]
        return out

    @property
    def kv_pools(self) -> list[KVCache]:
        return [self.kv] if self.grouped is None else [s.kv for s in self.grouped.groups]

    def routing_pool(self, seq: Sequence) -> KVCache:
        return self.kv if self.grouped is None else self.grouped.pool_of(seq)

    def read_weights(self, path: str | Path) -> Checkpoint:
        """This rank's slices of a weights directory, checked against the served model."""
        ckpt = self.runner.read(path)
        if not ckpt.same_architecture(self.model_config):
            raise WeightsError(
                f"{ckpt.path}: architecture {ckpt.config} differs from the loaded {self.model_config}"
            )
        return ckpt

    def apply_weights(self, ckpt: Checkpoint, version: int) -> None:
        """Every rank loads its slices of `ckpt`'s directory, between steps."""
        t0 = time.monotonic()
        try:
            send(self.groups, WeightsOrder(str(ckpt.path), version))
            self.runner.load(ckpt)
        except BaseException as e:
            self._failed(e)
            raise
        self.version = self.scheduler.version = version
        self.model_dir = ckpt.path
        self.stats.observe_weights(time.monotonic() - t0, ckpt.read_s, ckpt.nbytes)

    def close(self) -> None:
        """Release the worker ranks (they return from run_worker)."""
        send(self.groups, StopOrder())
