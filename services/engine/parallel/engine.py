"""The engine over several ranks: rank 0 is an LLMEngine whose model and KV cache are its shards;
ranks 1.. run `run_worker` (services/engine/parallel/runner.py).

Rank 0 keeps everything the single-rank engine does on the host (requests, the scheduler and its
page tables, prefix cache, preemption, forks, stop conditions, routed-expert read-back), and each
step it sends the forward's inputs to the other ranks (`StepOrder`), runs its own shard and takes
the sampled tokens, identical on every rank. Weight updates go to every rank in step order, each
rank reading its own slices.

What the multi-rank engine does not do yet: data-parallel attention (one scheduler per attention
group), MLA models, FP8, the CUDA fast path (paged kernels, CUDA graphs, fused sampler, overlap
scheduling: it runs the torch attention path on any device) and KV page export/import (pages
are split by KV heads across ranks).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tokenizers import Tokenizer

from services.common.config import EngineConfig, ModelConfig, ParallelConfig
from services.common.gpu_memory import cap_process_memory
from services.engine.batch import BlockTables, Span, num_sms
from services.engine.engine import LLMEngine, resolve_device
from services.engine.kv_cache import KVCache
from services.engine.kv_transfer import PageExchange, layout_id
from services.engine.loader import Checkpoint, WeightsError
from services.engine.overlap import Feed
from services.engine.parallel.group import EngineGroups
from services.engine.parallel.model import check_supported, local_config
from services.engine.parallel.runner import (
    RankRunner,
    RecordingKVCache,
    StepOrder,
    StopOrder,
    WeightsOrder,
    config_of,
    serve_orders,
)
from services.engine.parallel.vocab import ShardedSampler
from services.engine.sampler import SampleOutput, Sampler
from services.engine.scheduler import Scheduler
from services.engine.sequence import Sequence
from services.engine.stats import EngineStats


@dataclass
class Sampled:
    """A step's samples, already on the host (the multi-rank step is synchronous)."""

    out: SampleOutput

    def resolve(self) -> SampleOutput:
        return self.out


def check_engine(cfg: EngineConfig, m: ModelConfig, par: ParallelConfig) -> None:
    check_supported(m, par)
    if par.ranks > 1 and cfg.quantization != "none":
        raise ValueError("quantization: a multi-rank engine serves bf16/float32 weights only")


def kv_blocks(cfg: EngineConfig, m: ModelConfig, par: ParallelConfig, max_seq_len: int) -> int:
    """Pages in every rank's pool (the same number on all: rank 0's page tables index them all);
    a byte budget counts the rank's own KV heads."""
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    if cfg.kv_cache_bytes is not None:
        per_block = KVCache.bytes_per_block_for(
            local_config(m, par), cfg.block_size, getattr(torch, cfg.dtype)
        )
        return max(1, cfg.kv_cache_bytes // per_block)
    return cfg.max_batch_size * -(-max_seq_len // cfg.block_size)


def _runner(
    model_dir: str | Path, cfg: EngineConfig, par: ParallelConfig, groups: EngineGroups
) -> RankRunner:
    torch.set_num_threads(cfg.torch_threads)
    m = config_of(model_dir)
    check_engine(cfg, m, par)
    device = resolve_device(cfg.device)
    max_seq_len = min(cfg.max_seq_len, m.max_seq_len)
    blocks = kv_blocks(cfg, m, par, max_seq_len)
    kv_cls = RecordingKVCache if groups.world.rank == 0 else KVCache
    return RankRunner(model_dir, cfg, par, groups, device, blocks, max_seq_len, kv_cls)


def run_worker(model_dir: str | Path, cfg: EngineConfig, par: ParallelConfig, groups: EngineGroups) -> None:
    """Ranks 1..: build the shard and run rank 0's orders until it stops (a dead peer raises)."""
    if groups.world.rank == 0:
        raise ValueError("rank 0 runs ParallelEngine")
    serve_orders(_runner(model_dir, cfg, par, groups))


class ParallelEngine(LLMEngine):
    """Rank 0 of a multi-rank engine: LLMEngine's API (generate, step, add_request, weights)."""

    def __init__(
        self,
        model_dir: str | Path,
        cfg: EngineConfig,
        par: ParallelConfig,
        groups: EngineGroups,
        version: int | None = None,
    ) -> None:
        if groups.world.rank != 0:
            raise ValueError("ranks other than 0 run run_worker")
        self.par, self.groups = par, groups
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.memory_cap = cap_process_memory(self.device, cfg.cuda_memory_gib)
        self.dtype = getattr(torch, cfg.dtype)
        self.runner = _runner(model_dir, cfg, par, groups)
        ckpt = self.runner.checkpoint
        self.model_config = m = ckpt.config
        self.max_seq_len = self.runner.max_seq_len
        self.model, self.kv = self.runner.model, self.runner.kv
        self.stats = EngineStats()
        self.scheduler = Scheduler(
            self.kv, cfg.max_batch_size, cfg.max_num_batched_tokens, cfg.enable_prefix_caching, self.stats
        )
        self.pdl = self.model.pdl = False
        self.sampler = Sampler()  # the interface LLMEngine keeps; the draws go to ShardedSampler
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
        self.attention_backend = "torch"
        self.model.fused_elementwise = False
        self.block_tables = BlockTables(-(-self.max_seq_len // cfg.block_size))
        self.num_sms = num_sms(self.device)
        self.model.megakernel = None
        self.graphs = None
        self.mixed_graphs = None

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
        self.groups.world.broadcast_object(WeightsOrder(str(ckpt.path), version))
        self.runner.load(ckpt)
        self.version = self.scheduler.version = version
        self.model_dir = ckpt.path
        self.stats.observe_weights(time.monotonic() - t0, ckpt.read_s, ckpt.nbytes)

    def close(self) -> None:
        """Release the worker ranks (they return from run_worker)."""
        self.groups.world.broadcast_object(StopOrder())
