"""The engine over several ranks: rank 0 is an LLMEngine whose model and KV cache are its shards;
ranks 1.. run `run_worker` (services/engine/parallel/runner.py).

Rank 0 keeps everything the single-rank engine does on the host (requests, the scheduler and its
page tables, prefix cache, preemption, forks, stop conditions, routed-expert read-back), and each
step it sends the forward's inputs to the other ranks (`StepOrder`), runs its own shard and takes
the sampled tokens, identical on every rank. Weight updates go to every rank in step order, each
rank reading its own slices.

What the multi-rank engine does not do yet: data-parallel attention (one scheduler per attention
group), FP8, the CUDA fast path (paged kernels, CUDA graphs, fused sampler, overlap
scheduling: it runs the torch attention path on any device) and KV page export/import (pages
are split by KV heads across ranks).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tokenizers import Tokenizer

from services.common.config import EngineConfig, ParallelConfig
from services.common.gpu_memory import cap_process_memory
from services.engine.batch import Span
from services.engine.kv_transfer import PageExchange, layout_id
from services.engine.layers.sampler import SampleOutput
from services.engine.llm_engine import LLMEngine
from services.engine.loader import Checkpoint, WeightsError
from services.engine.overlap import Feed
from services.engine.parallel.group import EngineGroups
from services.engine.parallel.runner import (
    RecordingKVCache,
    StartOrder,
    StepOrder,
    StopOrder,
    WeightsOrder,
    build_runner,
    rank_device,
)
from services.engine.parallel.vocab import ShardedSampler
from services.engine.scheduler import Scheduler
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
    ) -> None:
        """on_failure: called when a step or a weight update fails. The ranks are then out of step
        (a peer may have died, or missed an order), so the group cannot go on: a service exits
        there and its supervisor restarts every rank. Without it the error is raised as is."""
        if groups.world.rank != 0:
            raise ValueError("ranks other than 0 run runner.run_worker")
        self.par, self.groups = par, groups
        self.on_failure = on_failure
        self.cfg = cfg
        self.device = rank_device(cfg, groups.world.rank)
        self.memory_cap = cap_process_memory(self.device, cfg.cuda_memory_gib)
        self.dtype = getattr(torch, cfg.dtype)
        # The workers build their shards of the same directory meanwhile.
        groups.world.broadcast_object(StartOrder(str(model_dir)))
        self.runner = build_runner(model_dir, cfg, par, groups)
        ckpt = self.runner.checkpoint
        assert ckpt is not None
        self.model_config = m = ckpt.config
        self.max_seq_len = self.runner.max_seq_len
        self.model, self.kv = self.runner.model, self.runner.kv
        self.stats = EngineStats()
        self.scheduler = Scheduler(
            self.kv, cfg.max_batch_size, cfg.max_num_batched_tokens, cfg.enable_prefix_caching, self.stats
        )
        self.model.pdl = False
        self.eos_token_ids = set(ckpt.eos_token_ids)
        tok_file = ckpt.path / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(tok_file)) if tok_file.is_file() else None
        self.watchers = {}
        self.model_dir = ckpt.path
        self.version = self.scheduler.version = version if version is not None else (ckpt.version or 0)
        self.layout = self.scheduler.layout = layout_id(m.arch, self.kv) + f"|tp{par.tp}"
        self.pages = PageExchange(self.kv, layout=self.layout)
        self.scheduler.landing = self.pages.landing_keys
        self._born_finished = []
        self._inflight = None
        self._resolve_s = 0.0
        self._prefill_lag = None
        self.overlap = False
        self.background = False
        self.model.fused_elementwise = False
        self.model.megakernel = None

    def step(self) -> list[RequestState]:
        try:
            return super().step()
        except BaseException as e:
            self._failed(e)
            raise

    def _failed(self, e: BaseException) -> None:
        if self.on_failure is not None:
            self.on_failure(e)

    def _launch(
        self, spans: list[Span], seqs: list[Sequence], rows: list[int], feed: Feed | None = None
    ) -> Sampled | None:
        assert feed is None, "a multi-rank engine does not overlap steps"
        params = [s.params for s in seqs]
        kv = self.kv
        assert isinstance(kv, RecordingKVCache)
        draws = ShardedSampler.draws(params, [s.rng for s in seqs])
        order = StepOrder(spans, rows, params, draws, kv.take_copies())
        self.groups.world.broadcast_object(order)
        out = self.runner.step(replace(order, copies=[]))  # rank 0 made its page copies already
        return Sampled(out) if out is not None else None

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
            self.groups.world.broadcast_object(WeightsOrder(str(ckpt.path), version))
            self.runner.load(ckpt)
        except BaseException as e:
            self._failed(e)
            raise
        self.version = self.scheduler.version = version
        self.model_dir = ckpt.path
        self.stats.observe_weights(time.monotonic() - t0, ckpt.read_s, ckpt.nbytes)

    def close(self) -> None:
        """Release the worker ranks (they return from run_worker)."""
        self.groups.world.broadcast_object(StopOrder())
