"""ModelRunner: one device's model and everything that runs it, between a step's spans and its
sampled tokens.

It builds the model (bf16, or FP8 from the start), loads and swaps its weights, sizes and owns
the paged KV cache, picks the attention backend (the torch path on CPU, the Triton paged kernels
on CUDA), captures the CUDA graphs of decode and mixed steps, sets up the batch-1 persistent
kernel, and launches a step's forward and sampling (`launch`), leaving the tokens on the device
until they are resolved. The engine loop (llm_engine.py) decides what runs; this decides how.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from ops import pdl
from ops.fp8.checkpoint import dequantize_state
from services.common.config import EngineConfig, ModelConfig
from services.common.gpu_memory import cap_process_memory
from services.engine.batch import (
    BlockTables,
    ForwardBatch,
    HostBatch,
    Span,
    StateMeta,
    decode_layout,
    host_to_device,
    num_sms,
    prefill_groups,
)
from services.engine.cuda_graphs import DecodeGraphs, MixedGraphs
from services.engine.kv_cache import KVCache, check_memory_cap, pool_blocks
from services.engine.layers import fp8 as fp8_linear
from services.engine.layers.sampler import PendingSample, Sampler
from services.engine.loader import Checkpoint
from services.engine.models.registry import build_fp8_model, engine_model
from services.engine.overlap import Feed, feed_pending
from services.engine.sequence import Sequence
from services.engine.weight_staging import WeightStager, staging_bytes

if TYPE_CHECKING:
    from services.engine.kernels.megakernel import DecodeMegakernel

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def attention_backend(want: str, m: ModelConfig, device: torch.device) -> str:
    """EngineConfig.attention_backend resolved for a model (a multi-rank engine's rank: its own
    shard's shapes) on a device: "auto" is the Triton paged kernels on CUDA where they apply."""
    # The paged kernels cover standard (GQA) attention with power-of-two head dims (tile
    # shapes) of at least 16 (tl.dot), and MLA's decode (kernels/mla_decode.py) with a
    # power-of-two kv_lora_rank >= 16; MLA's prefill spans keep the torch route (layers/mla.py).
    d, r = m.head_dim, m.kv_lora_rank
    if m.is_mla:
        ok, need = r >= 16 and r & (r - 1) == 0, "MLA with a power-of-two kv_lora_rank >= 16"
    else:
        ok, need = d >= 16 and d & (d - 1) == 0, "standard attention with a power-of-two head_dim >= 16"
    if want == "auto":
        want = "triton" if device.type == "cuda" and ok else "torch"
    if want == "triton" and not ok:
        raise ValueError(f"attention_backend: {want!r} needs {need}")
    return want


class ModelRunner:
    def __init__(self, ckpt: Checkpoint, cfg: EngineConfig):
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        # Before any allocation: a decode sharing its GPU with the trainer stays in its budget.
        self.memory_cap = cap_process_memory(self.device, cfg.cuda_memory_gib)
        self.dtype: torch.dtype = getattr(torch, cfg.dtype)
        self.model_config = m = ckpt.config
        # Positions past the model's own limit were never trained (and the trainer cannot score them).
        self.max_seq_len = min(cfg.max_seq_len, m.max_seq_len)
        if cfg.quantization == "fp8":
            # Attention/MLP linears and experts are FP8 from the start (their high-precision
            # weights are never allocated); lm_head, norms, embeddings, routers stay in dtype. The
            # load quantises high-precision tensors 128x128 and copies an FP8 checkpoint's own bits
            # and scales (layers/fp8.load_hf_state; docs/fp8.md).
            self.model = build_fp8_model(m, self.max_seq_len, ckpt.attention_bias, self.device, self.dtype)
            fp8_linear.load_hf_state(self.model, ckpt.state)
        else:
            self.model = engine_model(m, self.max_seq_len, ckpt.attention_bias).to(self.device, self.dtype)
            self.model.load_hf_state(self._high_precision(ckpt))
        self.model.eval()
        self.model.logits_fp32 = cfg.logits_fp32  # float32 logits: the trainer's (docs/replay.md)
        # GQA or MLA-latent layout, plus the routed-expert store of an MoE model and the Mamba-2
        # state slots of a hybrid one, one per sequence that may run (kv_cache.py).
        blocks = self._num_kv_blocks()
        weight_bytes = sum(t.nbytes for t in (*self.model.parameters(), *self.model.buffers()))
        if cfg.stage_weights:
            weight_bytes += staging_bytes(self.model)  # the staging copy, made in prepare()
        check_memory_cap(cfg, m, blocks, weight_bytes, self.dtype)
        self.kv = KVCache.for_model(
            m,
            blocks,
            cfg.block_size,
            self.max_seq_len,
            self.dtype,
            self.device,
            cfg.max_batch_size,
        )
        # On CUDA, plain batches sample in one fused kernel (kernels/sampling.py: its own stream).
        # Programmatic Dependent Launch of the Triton kernels (forward and fused sampler): on where
        # EngineConfig.pdl asks and the device can (ops/pdl.py); set before graph capture.
        self.pdl = self.model.pdl = pdl.resolve(cfg.pdl, self.device)
        self.sampler = Sampler(fused=self.device.type == "cuda" and cfg.fused_kernels, pdl=self.pdl)

    def prepare(self) -> None:
        """The GPU fast path (docs/kernels.md): paged kernels, fused projections and
        elementwise kernels, the batch-1 kernel and the CUDA graphs. Call once the engine around the
        runner is built: graph capture runs the model."""
        cfg = self.cfg
        self.attention_backend = self._attention_backend()
        # Before graph capture: fused residual-add + RMSNorm and SiLU-mul kernels on CUDA.
        # (A hybrid model's forward has no fused path: models/nemotron_h.py.)
        self.model.fused_elementwise = (
            self.device.type == "cuda"
            and self.attention_backend != "torch"
            and cfg.fused_kernels
            and not self.model_config.is_hybrid
        )
        if self.model.fused_elementwise:
            self.model.fuse_projections()  # q/k/v and gate/up as one GEMM each (bf16 or fp8)
        # After the fusion (the staging copy mirrors the fused buffers and their views), before
        # the batch-1 kernel and the graphs (nothing of theirs is copied).
        self.stager = WeightStager(self.model, self.device, self._load_into) if cfg.stage_weights else None
        self.block_tables = BlockTables(-(-self.max_seq_len // cfg.block_size))
        self.num_sms = num_sms(self.device)
        self.model.megakernel = self._megakernel()  # before graph capture
        self.graphs = self._capture_graphs()
        self.mixed_graphs = self._capture_mixed_graphs()

    def _megakernel(self) -> DecodeMegakernel | None:
        """The batch-1 decode kernel (EngineConfig.megakernel), where the model and device allow."""
        if not (self.cfg.megakernel and self.model.fused_elementwise and self.attention_backend == "triton"):
            return None
        if torch.cuda.get_device_capability(self.device)[0] < 9:
            log.info("megakernel off: written and measured for Hopper (sm_90) only")
            return None
        from services.engine.kernels import megakernel  # Triton: the CUDA path only
        from services.engine.kernels.megakernel import DecodeMegakernel

        why = megakernel.unsupported(self.model) or megakernel.residency_risk()
        if why is None:
            try:
                return DecodeMegakernel(self.model, self.kv.k, self.kv.v, self.cfg.block_size, self.num_sms)
            except ValueError as e:
                why = str(e)
        log.info("megakernel off: %s", why)
        return None

    def _attention_backend(self) -> str:
        return attention_backend(self.cfg.attention_backend, self.model_config, self.device)

    def _capture_graphs(self) -> DecodeGraphs | None:
        if not (self.cfg.cuda_graphs and self.attention_backend == "triton" and self.device.type == "cuda"):
            return None
        size = min(self.cfg.max_batch_size, self.cfg.cuda_graph_max_batch_size)
        graphs = DecodeGraphs(
            self.model,
            self.kv,
            size,
            self.num_sms,
            self.device,
            sample_in_graph=self.cfg.graph_sampling and self.sampler.fused,
            pdl=self.pdl,
        )
        try:
            graphs.capture()
        except RuntimeError:
            # E.g. a model whose forward syncs with the host; decode then runs eagerly (slower).
            log.exception("CUDA graph capture failed; decode steps run eagerly")
            return None
        return graphs

    def _capture_mixed_graphs(self) -> MixedGraphs | None:
        # A hybrid model's prompt chunks scan span by span (layers/mamba2.py), MLA's run the
        # torch expanded route over gathered groups (layers/mla.py): no fixed-shape step.
        m = self.model_config
        if self.graphs is None or not self.cfg.cuda_graph_mixed or m.is_hybrid or m.is_mla:
            return None
        graphs = MixedGraphs(
            self.model,
            self.kv,
            self.cfg.max_num_batched_tokens,
            self.graphs.sizes[-1],
            self.cfg.cuda_graph_max_prefill_spans,
            self.num_sms,
            self.device,
        )
        try:
            graphs.capture(self.graphs.pool)
        except RuntimeError:
            log.exception("CUDA graph capture of mixed steps failed; they run eagerly")
            return None
        return graphs

    def launch(
        self, spans: list[Span], seqs: list[Sequence], rows: list[int], feed: Feed | None = None
    ) -> PendingSample | None:
        """Queue the step's forward and the sampling of `seqs` (from logit rows `rows`: the row of
        each one's last token, by span); None if nothing samples. `feed`: rows whose token is still
        on the device (overlap scheduling), written in before the forward."""
        if self.attention_backend == "torch":
            batch = ForwardBatch.build(spans, self.device, self.kv.max_seq_len, self.kv.block_size)
            if self.kv.states is not None:
                batch.state = StateMeta.build(spans, self.device)
            feed_pending(batch.input_ids, feed)
            hidden, last_index = self.model(batch, self.kv), batch.last_index
        else:
            hb = HostBatch.build(spans, self.kv.block_size, self.block_tables)
            if self.graphs is not None and self.graphs.can_run(hb):
                return self._launch_graph(hb, seqs, rows, feed)
            hidden, last_index = self._forward(hb, spans, feed)
        return self.launch_sample(hidden, last_index, seqs, rows) if seqs else None

    def _launch_graph(
        self, hb: HostBatch, seqs: list[Sequence], rows: list[int], feed: Feed | None
    ) -> PendingSample | None:
        """A decode step on its captured graph. With graph sampling (cuda_graphs.DecodeGraphs)
        the graph samples every row itself when all rows sample in order and plainly; otherwise
        the graph's logits go to the sampler."""
        graphs = self.graphs
        assert graphs is not None
        n = len(hb.ids)
        params = [s.params for s in seqs]
        in_order = len(rows) == n and rows == list(range(n))  # (no forks, every row samples)
        inside = (
            graphs.sample_in_graph
            and in_order
            and self.sampler.fuses(params, self.model_config.vocab_size, top_n=False)
        )
        draws = self.sampler.fused_draws(params, [s.rng for s in seqs]) if inside else None
        logits = graphs.run(hb, feed, draws)
        if not seqs:
            return None
        if inside:
            return graphs.pending(n)
        if not in_order:
            logits = logits.index_select(0, host_to_device(torch.tensor(rows), logits.device))
        return self.sampler.launch(logits, params, [s.rng for s in seqs])

    def _forward(
        self, hb: HostBatch, spans: list[Span], feed: Feed | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states of a paged batch the decode graphs do not take (a mixed-step graph
        or eager) and the row of each span's last token. `feed`: rows whose token is still on
        the device (overlap scheduling), written in before the forward."""
        if self.mixed_graphs is not None and self.mixed_graphs.can_run(hb):
            return self.mixed_graphs.run(hb, feed)
        m = self.model_config
        programs, key_cap = decode_layout(m)
        batch = hb.to_forward_batch(self.device, programs, self.num_sms, key_cap)
        if m.is_mla and not hb.decode_only:  # MLA's prefill spans: the torch expanded route
            batch.groups = prefill_groups(spans, self.device, self.kv.max_seq_len, self.kv.block_size)
        if self.kv.states is not None:
            batch.state = StateMeta.build(spans, self.device)
        feed_pending(batch.input_ids, feed)
        return self.model(batch, self.kv), batch.last_index

    def launch_sample(
        self, hidden: torch.Tensor, last_index: torch.Tensor, seqs: list[Sequence], rows: list[int]
    ) -> PendingSample:
        """Queue logits + sampling of the given rows; the tokens stay on the device until resolved."""
        # Decode steps sample every row in order: index with the device tensor as it is. Otherwise
        # the rows go over pinned and non-blocking: a Python list index is a blocking copy, which
        # waits for the forward (and, with overlap scheduling, for the step before it).
        every = len(rows) == len(last_index) and rows == list(range(len(rows)))
        if not every:
            last_index = last_index.index_select(0, host_to_device(torch.tensor(rows), last_index.device))
        logits = self.model.logits(hidden[last_index])
        return self.sampler.launch(logits, [s.params for s in seqs], [s.rng for s in seqs])

    def _num_kv_blocks(self) -> int:
        return pool_blocks(self.cfg, self.model_config, self.max_seq_len, self.dtype)

    # ------------------------------------------------------------------ weights

    def load_state(self, ckpt: Checkpoint) -> None:
        """Swap the model's weights in place (CUDA graphs keep pointing at the same buffers)."""
        self._load_into(self.model, ckpt)

    def _load_into(self, model: torch.nn.Module, ckpt: Checkpoint) -> None:
        """Write `ckpt` into `model`: the live one, or the stager's structural copy of it."""
        if self.cfg.quantization == "fp8":
            # Re-quantises high-precision weights into the fp8 buffers; copies an fp8 checkpoint's.
            fp8_linear.load_hf_state(model, ckpt.state)
        else:
            model.load_hf_state(self._high_precision(ckpt))  # type: ignore[operator]

    def _high_precision(self, ckpt: Checkpoint) -> dict[str, torch.Tensor]:
        """The checkpoint's state with any fp8 pairs dequantised to the engine dtype."""
        return dequantize_state(ckpt.state, self.dtype) if ckpt.fp8 else ckpt.state
