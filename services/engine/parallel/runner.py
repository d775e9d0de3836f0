"""What every rank of a multi-rank engine runs: its shard of the model and of the KV cache, driven
by orders from rank 0.

Rank 0 runs the scheduler (services/engine/parallel/engine.py). For every step it broadcasts a
`StepOrder`: the step's spans (each sequence's new tokens, positions and page table), which rows
sample with which parameters and the draws its RNGs made for them, and the page copies its
scheduler did since the last order. Every rank then runs the same forward on its shard (the
collectives inside the layers keep them in step) and samples with `ShardedSampler`, which returns
the same tokens and log-probs on every rank: rank 0 keeps them, the others drop them. Weight
updates are orders too, in sequence with the steps: each rank reads and applies its own slices.

Every rank prepares the single-rank engine's fast path on its shard at start (`prepare`): the
paged kernels at the shard's head counts, on CUDA the fused elementwise kernels and decode graphs
captured in the same order on every rank; a decode step's order names the graph to replay.

A rank whose peer died fails its next collective (the groups' timeout bounds the wait) and the
error ends `serve_orders`: the process exits non-zero and its supervisor restarts the group.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ops import pdl
from ops.fp8.checkpoint import dequantize_state, is_fp8_weight
from services.common.config import EngineConfig, ModelConfig, ParallelConfig
from services.common.modeldir import model_config_from_hf
from services.common.schemas import SamplingParams
from services.common.weights_slice import SliceSpec
from services.engine.batch import (
    BlockTables,
    ForwardBatch,
    HostBatch,
    Span,
    StateMeta,
    decode_layout,
    num_sms,
    prefill_groups,
)
from services.engine.cuda_graphs import DecodeGraphs, padded_size
from services.engine.kv_cache import KVCache, pool_blocks
from services.engine.layers import fp8 as fp8_linear
from services.engine.layers.sampler import SampleOutput
from services.engine.loader import Checkpoint, WeightsError, read_checkpoint
from services.engine.model_runner import attention_backend
from services.engine.parallel.experts import ExpertParallelMoE
from services.engine.parallel.fp8 import mamba_in_proj_pairs
from services.engine.parallel.group import EngineGroups
from services.engine.parallel.linear import split_range
from services.engine.parallel.model import (
    build_parallel_model,
    check_supported,
    local_config,
    local_state,
    mamba_runs,
    sharded_logits,
    slice_spec,
)
from services.engine.parallel.orders import Book, LeanStep, receive, split_orders
from services.engine.parallel.pages import ExportOrder, ImportOrder, run_export, run_import
from services.engine.parallel.vocab import ShardedLogits, ShardedSampler
from services.engine.state_cache import StateCache

log = logging.getLogger(__name__)


@dataclass
class StepOrder:
    """One step for every rank (pickled by the broadcast: host data only)."""

    spans: list[Span] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # the span whose last token each sample reads
    params: list[SamplingParams] = field(default_factory=list)
    draws: list[float] = field(default_factory=list)  # ShardedSampler.draws, made on rank 0
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) pages, before the forward
    state_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) Mamba-2 state slots
    # Send the forwarded tokens' routed expert ids back (an attention group other than rank 0's:
    # rank 0 keeps a copy of that group's routing store).
    routing: bool = False
    # The decode graph every rank replays (its padded batch size), chosen by rank 0; None: eager.
    graph: int | None = None


@dataclass
class GroupResult:
    """What an attention group's first rank sends rank 0 after a step."""

    out: SampleOutput | None
    slots: np.ndarray | None = None  # [T] the forwarded tokens' cache rows
    routing: np.ndarray | None = None  # [moe layers, T, k] their routed ids (the store's dtype)


@dataclass
class StartOrder:
    """Build the shard of this weights directory (a worker's first order)."""

    path: str


@dataclass
class WeightsOrder:
    path: str
    version: int


@dataclass
class StopOrder:
    pass


Order = StartOrder | StepOrder | LeanStep | WeightsOrder | ExportOrder | ImportOrder | StopOrder


class RecordingStateCache(StateCache):
    """Rank 0's Mamba-2 state slots: a forked sample's copy of its parent's states (made after the
    forward that prefilled both) is recorded for the other ranks, which make it before the next
    forward. Slot numbers are rank 0's scheduler's on every rank; zeroing a sequence's slot is
    part of the forward (its first span), so allocation, release and preemption need no order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.copies: list[tuple[int, int]] = []

    def copy(self, src: int, dst: int) -> None:
        super().copy(src, dst)
        self.copies.append((src, dst))


class RecordingKVCache(KVCache):
    """Rank 0's KV cache: the page copies its scheduler makes (a forked sample's private copy of
    its parent's last prompt page) are done here and recorded for the other ranks' caches."""

    state_cache = RecordingStateCache

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.copies: list[tuple[int, int]] = []

    def copy_block(self, src: int, dst: int) -> None:
        super().copy_block(src, dst)
        self.copies.append((src, dst))

    def take_copies(self) -> list[tuple[int, int]]:
        out, self.copies = self.copies, []
        return out

    def take_state_copies(self) -> list[tuple[int, int]]:
        if not isinstance(self.states, RecordingStateCache):
            return []
        out, self.states.copies = self.states.copies, []
        return out


class RankRunner:
    """One rank's model shard, KV cache shard and sampler. `ckpt`: this rank's slices of the
    weights to load (`read`); None leaves the weights unset (whoever builds it fills them)."""

    def __init__(
        self,
        m: ModelConfig,
        cfg: EngineConfig,
        par: ParallelConfig,
        groups: EngineGroups,
        device: torch.device,
        num_blocks: int,
        max_seq_len: int,
        kv_cls: type[KVCache] = KVCache,
        ckpt: Checkpoint | None = None,
    ) -> None:
        self.cfg, self.par, self.groups, self.device = cfg, par, groups, device
        self.dtype: torch.dtype = getattr(torch, cfg.dtype)
        self.model_config = m
        self.max_seq_len = max_seq_len
        bias = ckpt.attention_bias if ckpt is not None else False
        self.fp8 = cfg.quantization == "fp8"
        self.model = build_parallel_model(
            m, par, groups, max_seq_len, bias, device, self.dtype, fp8=self.fp8
        ).eval()
        self.model.logits_fp32 = cfg.logits_fp32
        if ckpt is not None:
            self.load(ckpt)
        self.kv = kv_cls.for_model(
            local_config(m, par),
            num_blocks,
            cfg.block_size,
            max_seq_len,
            self.dtype,
            device,
            group_slots(cfg, par),
        )
        self.sampler = ShardedSampler()
        self.checkpoint = ckpt  # the one read at start: rank 0's engine takes its metadata
        # The fast path (`prepare`): torch attention and no graphs until then.
        self.attention_backend = "torch"
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs = None  # steps with prompt tokens run eagerly on every rank
        self.pdl = False
        self.block_tables = BlockTables(-(-max_seq_len // cfg.block_size))
        self.book = Book()  # a worker's mirror of rank 0's page tables (parallel/orders.py)
        self.num_sms = num_sms(device)

    @property
    def expert_parallel(self) -> bool:
        return any(isinstance(mod, ExpertParallelMoE) for mod in self.model.modules())

    def prepare(self, device_path: bool | None = None) -> None:
        """The single-rank engine's fast path (ModelRunner.prepare) on this rank's shard, on every
        rank alike (the same config and shapes give every rank the same choices): the paged
        attention kernels where EngineConfig.attention_backend resolves to them for the shard's
        heads; on CUDA the fused residual-add + RMSNorm / SiLU-mul kernels with fused q/k/v and
        gate/up GEMMs, and the decode CUDA graphs, captured by every rank in the same order
        (the same ladder, largest first) so the collectives inside (the tp all-reduces, the
        vocabulary all-reduce) pair up. A layer whose collective sizes are read on the host (the
        expert-parallel all-to-all) cannot be captured: an engine with one keeps its steps eager.

        device_path: run the CUDA-only parts (fused kernels, graphs) off CUDA too, the graphs
        then uncaptured (their static batch runs eagerly): Triton-interpreter tests on CPU.
        Default: on CUDA."""
        cfg, m = self.cfg, self.model.config  # the shard's shapes
        on_device = self.device.type == "cuda" if device_path is None else device_path
        self.attention_backend = attention_backend(cfg.attention_backend, m, self.device)
        paged = self.attention_backend != "torch"
        self.pdl = self.model.pdl = pdl.resolve(cfg.pdl, self.device)
        self.model.fused_elementwise = on_device and paged and cfg.fused_kernels and not m.is_hybrid
        if self.model.fused_elementwise:
            self.model.fuse_projections()
        if not (on_device and paged and cfg.cuda_graphs) or self.expert_parallel:
            return
        size = min(cfg.max_batch_size, cfg.cuda_graph_max_batch_size)
        graphs = DecodeGraphs(self.model, self.kv, size, self.num_sms, self.device)
        if self.device.type == "cuda":
            try:
                graphs.capture()
            except RuntimeError as e:
                # The other ranks may be inside a collective of the same capture: the group cannot
                # go on eagerly on its own; the way out is the config.
                raise RuntimeError(
                    f"rank {self.groups.world.rank}: CUDA graph capture failed ({e}); "
                    "set engine.cuda_graphs = false to run decode steps eagerly"
                ) from e
        self.graphs = graphs

    def graph_size(self, spans: list[Span]) -> int | None:
        """The decode graph (padded batch size) that runs these spans, or None (eager): rank 0's
        choice, sent in the StepOrder."""
        g = self.graphs
        if g is None or len(spans) > g.sizes[-1] or any(len(s.tokens) != 1 for s in spans):
            return None
        return padded_size(len(spans), g.sizes)

    def read(self, path: str | Path) -> Checkpoint:
        """This rank's slices of a weights directory (memory-mapped; services/common/weights_slice.py)."""
        return read_rank_checkpoint(path, self.cfg, self.par, self.groups, self.model_config)

    @torch.no_grad()
    def load(self, ckpt: Checkpoint) -> None:
        """Apply this rank's slices in place, as ModelRunner.load_state does on one rank: an FP8
        engine copies an FP8 checkpoint's bits and scales and quantises high-precision weights
        128x128; a high-precision engine dequantises an FP8 checkpoint's pairs."""
        state = local_state(ckpt.state, ckpt.config, self.groups)
        if self.fp8:
            spec = slice_spec(self.model_config, self.par, self.groups)
            mamba_in_proj_pairs(self.model, state, ckpt.path, spec)
            fp8_linear.load_hf_state(self.model, state)
        else:
            self.model.load_hf_state(dequantize_state(state, self.dtype) if ckpt.fp8 else state)

    def _copies(self, order: StepOrder) -> None:
        for src, dst in order.copies:
            self.kv.copy_block(src, dst)
        for src, dst in order.state_copies:
            assert self.kv.states is not None
            self.kv.states.copy(src, dst)

    def _forward(self, order: StepOrder) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The order's forward: (final hidden states and each span's last row), or on a decode
        graph (the graph's logits of the rank's vocabulary slice, one row per span, and None);
        then the forwarded tokens' cache slots."""
        spans = order.spans
        if self.attention_backend == "torch":
            batch = ForwardBatch.build(spans, self.device, self.max_seq_len, self.kv.block_size)
        else:
            hb = HostBatch.build(spans, self.kv.block_size, self.block_tables)
            if order.graph is not None:
                if self.graphs is None:
                    raise RuntimeError(f"rank {self.groups.world.rank}: ordered a decode graph; it has none")
                logits = self.graphs.run(hb)
                key = self.graphs.last_key
                if key is None or key[0] != order.graph:
                    raise RuntimeError(
                        f"rank {self.groups.world.rank}: ran the {key} decode graph, ordered {order.graph}"
                    )
                return logits, None, torch.from_numpy(hb.slots)
            m = self.model.config  # the shard's heads
            programs, key_cap = decode_layout(m)
            batch = hb.to_forward_batch(self.device, programs, self.num_sms, key_cap)
            if m.is_mla and not hb.decode_only:  # MLA's prefill spans: the torch expanded route
                batch.groups = prefill_groups(spans, self.device, self.max_seq_len, self.kv.block_size)
        if self.kv.states is not None:
            batch.state = StateMeta.build(spans, self.device)
        return self.model(batch, self.kv), batch.last_index, batch.slot_mapping

    def _logits(self, out: torch.Tensor, last_index: torch.Tensor | None, rows: list[int]) -> ShardedLogits:
        """The rank's slice of the sampled rows' logits (`_forward`'s output)."""
        vocab = self.model_config.vocab_size
        if last_index is None:  # a decode graph's logits
            start, _ = split_range(vocab, self.groups.tp.size, self.groups.tp.rank)
            shard = out.index_select(0, torch.tensor(rows, device=out.device))
            return ShardedLogits(shard, start, vocab, self.groups.tp)
        index = last_index[torch.tensor(rows, device=last_index.device)]
        return sharded_logits(self.model, out[index], self.groups, vocab)

    @torch.inference_mode()
    def step(self, order: StepOrder) -> SampleOutput | None:
        self._copies(order)
        if not order.spans:
            return None
        out, last_index, _ = self._forward(order)
        if not order.rows:
            return None
        return self.sampler.sample(self._logits(out, last_index, order.rows), order.params, order.draws)

    @torch.inference_mode()
    def step_group(self, order: StepOrder) -> GroupResult | None:
        """This rank's attention group's part of a step (its LeanStep); every rank then sends its
        result to rank 0 (`gather_group`)."""
        self._copies(order)
        if not order.spans:
            self.idle_forward()
            return None
        out, last_index, slots = self._forward(order)
        res = GroupResult(None)
        if order.routing and self.kv.routing is not None:
            res.slots = slots.cpu().numpy()
            res.routing = self.kv.routing[:, slots.to(self.kv.routing.device)].cpu().numpy()
        if order.rows:
            logits = self._logits(out, last_index, order.rows)
            res.out = self.sampler.sample(logits, order.params, order.draws)
        return res

    def idle_forward(self) -> None:
        """An attention group with nothing to run: its ranks still take part in every MoE layer's
        all-to-alls (in layer order, as the busy groups' forwards do), with no tokens."""
        x = torch.empty((0, self.model_config.dim), dtype=self.dtype, device=self.device)
        hybrid = self.model_config.is_hybrid  # (nemotron_h: backbone.layers[i].mixer)
        for layer in (self.model.backbone if hybrid else self.model.model).layers:
            moe = layer.mixer if hybrid else layer.mlp
            if isinstance(moe, ExpertParallelMoE):
                moe(x)

    def gather_group(self, res: GroupResult | None) -> list[GroupResult | None] | None:
        """Every attention group's result on rank 0 (its first rank's: a tp group's ranks sample
        the same tokens); None on the other ranks."""
        return self.groups.world.gather_objects(res if self.groups.tp.rank == 0 else None)

    def unpack(self, lean: LeanStep) -> StepOrder:
        """The StepOrder a lean one stands for, from this rank's mirror of the page tables."""
        spans, params = self.book.apply(lean)
        return StepOrder(
            spans, lean.rows, params, lean.draws, lean.copies, lean.state_copies, lean.routing, lean.graph
        )

    def run(self, order: Order) -> SampleOutput | None:
        if isinstance(order, LeanStep):
            order = self.unpack(order)
            if split_orders(self.groups):
                self.gather_group(self.step_group(order))
                return None
        if isinstance(order, StepOrder):
            return self.step(order)
        if isinstance(order, WeightsOrder):
            self.load(self.read(order.path))
        if isinstance(order, ExportOrder):
            run_export(order, self.kv, self.model_config, self.groups)
        if isinstance(order, ImportOrder):
            run_import(order, self.kv, self.model_config, self.groups)
        return None


def config_of(path: str | Path) -> ModelConfig:
    """The model a weights directory holds, from its config.json (enough to plan the slices)."""
    try:
        return model_config_from_hf(json.loads((Path(path) / "config.json").read_text()))
    except (OSError, ValueError) as e:
        raise WeightsError(f"{path}: {e}") from e


def check_engine(cfg: EngineConfig, m: ModelConfig, par: ParallelConfig) -> None:
    """What the weights need not be read for: the layout against the model; with FP8 weights
    a Mamba-2 `in_proj` whose tensor-parallel runs fall on the 128x128 tiles (parallel/fp8.py)."""
    check_supported(m, par)
    if cfg.quantization == "fp8" and m.is_hybrid and "M" in m.hybrid_pattern and par.tp > 1:
        layer = m.hybrid_pattern.index("M")
        name = f"backbone.layers.{layer}.mixer.in_proj.weight"
        runs = mamba_runs(m)
        assert len(runs) == 3
        inner, gn, heads = runs
        for rank in range(par.tp):
            spec = SliceSpec(rank, par.tp, mamba=(inner, gn, heads))
            try:
                spec.mamba_tiles(name, 2 * inner + 2 * gn + heads, 128)
            except ValueError as e:
                raise ValueError(f"parallel.tp: quantization fp8: {e}") from e


def read_rank_checkpoint(
    path: str | Path, cfg: EngineConfig, par: ParallelConfig, groups: EngineGroups, m: ModelConfig
) -> Checkpoint:
    """The rank's slices of a weights directory. Under quantization = "fp8" every weight the
    engine holds in FP8 must be cut on 128-row/column tiles (a WeightsError names the first that
    is not), so that the rank quantises the single-rank engine's tiles; an FP8 checkpoint's
    scales need that cut whatever the engine (services/common/weights_slice.py)."""
    tiled = is_fp8_weight if cfg.quantization == "fp8" else None
    return read_checkpoint(path, slice_spec(m, par, groups), tiled=tiled)


def group_slots(cfg: EngineConfig, par: ParallelConfig) -> int:
    """The sequences one attention group runs at once (dp.GroupedScheduler's share of
    max_batch_size): a hybrid model's Mamba-2 state slots per rank."""
    return max(1, cfg.max_batch_size // par.dp_attention)


def kv_blocks(cfg: EngineConfig, m: ModelConfig, par: ParallelConfig, max_seq_len: int) -> int:
    """Pages in every rank's pool (the same number on all: rank 0's page tables index them all);
    a byte budget counts the rank's own KV heads and state slots."""
    local = local_config(m, par)
    return pool_blocks(cfg, local, max_seq_len, getattr(torch, cfg.dtype), group_slots(cfg, par))


def rank_device(cfg: EngineConfig, rank: int) -> torch.device:
    """The rank's device: with CUDA, the rank-th visible GPU (a replica sees exactly its GPUs)."""
    want = cfg.device
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def build_runner(
    model_dir: str | Path,
    cfg: EngineConfig,
    par: ParallelConfig,
    groups: EngineGroups,
    device_path: bool | None = None,
) -> RankRunner:
    """The rank's runner on the weights of `model_dir` (its slices only), its fast path prepared
    (`RankRunner.prepare`: every rank of the group calls this at start, so graphs capture in step)."""
    torch.set_num_threads(cfg.torch_threads)
    ckpt = read_rank_checkpoint(model_dir, cfg, par, groups, config_of(model_dir))
    m = ckpt.config
    check_engine(cfg, m, par)
    max_seq_len = min(cfg.max_seq_len, m.max_seq_len)
    blocks = kv_blocks(cfg, m, par, max_seq_len)
    kv_cls = RecordingKVCache if groups.world.rank == 0 else KVCache
    device = rank_device(cfg, groups.world.rank)
    runner = RankRunner(m, cfg, par, groups, device, blocks, max_seq_len, kv_cls, ckpt)
    runner.prepare(device_path)
    return runner


def run_worker(
    cfg: EngineConfig, par: ParallelConfig, groups: EngineGroups, device_path: bool | None = None
) -> None:
    """Ranks 1..: wait for rank 0's StartOrder, build the shard, run its orders until it says stop.
    A failed collective (a dead peer) raises out of here. device_path: RankRunner.prepare's, as
    rank 0's ParallelEngine was given."""
    world = groups.world
    if world.rank == 0:
        raise ValueError("rank 0 runs ParallelEngine")
    start = receive(groups)
    if isinstance(start, StopOrder):
        return
    if not isinstance(start, StartOrder):
        raise RuntimeError(f"rank {world.rank}: expected a StartOrder first, got {type(start).__name__}")
    runner = build_runner(start.path, cfg, par, groups, device_path)
    while True:
        order = receive(groups)
        if isinstance(order, StopOrder):
            log.info("rank %d: stop", world.rank)
            return
        runner.run(order)
