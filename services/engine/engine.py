"""LLMEngine: the synchronous, library-first inference engine.

    engine = LLMEngine("runs/x/weights/step_3", EngineConfig(device="cpu"))
    [resp] = engine.generate([GenerateRequest(input_ids=[5, 6, 7])])

One `step()` = schedule, one batched forward over every scheduled sequence's new tokens (prompt
chunks of prefilling sequences, the last sampled token of decoding ones), sample one token per
sequence whose tokens are now all cached, publish newly full KV pages to the prefix cache, retire
finished ones. The async service wrapper (async_engine.py) drives the same
`step()` from a background thread.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import torch

from services.common.config import EngineConfig
from services.common.schemas import GenerateRequest, GenerateResponse
from services.engine.batch import ForwardBatch, Span
from services.engine.kv_cache import KVCache
from services.engine.loader import Checkpoint, WeightsError, read_checkpoint
from services.engine.model import CausalLM
from services.engine.sampler import Sampler
from services.engine.scheduler import Scheduler
from services.engine.sequence import RequestState, Sequence, Status
from services.engine.stats import EngineStats


class InvalidRequest(ValueError):
    """A request the engine cannot serve; `field` names the offending field (e.g. "input_ids")."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class LLMEngine:
    def __init__(
        self,
        model_dir: str | Path,
        cfg: EngineConfig,
        version: int | None = None,
    ):
        torch.set_num_threads(cfg.torch_threads)
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.dtype: torch.dtype = getattr(torch, cfg.dtype)
        ckpt = read_checkpoint(model_dir)
        self.model_config = m = ckpt.config
        # Positions past the model's own limit were never trained (and the trainer cannot score them).
        self.max_seq_len = min(cfg.max_seq_len, m.max_seq_len)
        self.model = CausalLM(m, self.max_seq_len, ckpt.attention_bias).to(self.device, self.dtype).eval()
        self.model.load_hf_state(ckpt.state)
        self.kv = KVCache(
            m.n_layers,
            self._num_kv_blocks(),
            cfg.block_size,
            self.max_seq_len,
            m.n_kv_heads,
            m.head_dim,
            self.dtype,
            self.device,
        )
        self.stats = EngineStats()
        self.scheduler = Scheduler(
            self.kv, cfg.max_batch_size, cfg.max_num_batched_tokens, cfg.enable_prefix_caching, self.stats
        )
        self.sampler = Sampler()
        self.eos_token_ids = set(ckpt.eos_token_ids)
        self.model_dir = ckpt.path
        self.version = self.scheduler.version = version if version is not None else (ckpt.version or 0)
        # Set by AsyncEngine: then only its thread may call step().
        self.background = False

    def _num_kv_blocks(self) -> int:
        cfg, m = self.cfg, self.model_config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if cfg.kv_cache_bytes is not None:
            per_block = KVCache.bytes_per_block(
                m.n_layers, cfg.block_size, m.n_kv_heads, m.head_dim, self.dtype
            )
            return max(1, cfg.kv_cache_bytes // per_block)
        return cfg.max_batch_size * -(-self.max_seq_len // cfg.block_size)

    # ------------------------------------------------------------------ requests

    def validate(self, req: GenerateRequest) -> None:
        """Raise InvalidRequest for what pydantic cannot know: vocab and length limits."""
        vocab = self.model_config.vocab_size
        bad = next(((i, t) for i, t in enumerate(req.input_ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(
                "input_ids", f"token id {bad[1]} at position {bad[0]} is outside [0, {vocab})"
            )
        if len(req.input_ids) >= self.max_seq_len:
            raise InvalidRequest(
                "input_ids",
                f"prompt has {len(req.input_ids)} tokens; max_seq_len is {self.max_seq_len} "
                "and at least one position must be left to generate",
            )
        # One sequence must fit the pool on its own, or preemption could never make room for it.
        longest = min(len(req.input_ids) + req.sampling.max_tokens, self.max_seq_len)
        if self.kv.blocks_for(longest) > self.kv.num_blocks:
            raise InvalidRequest(
                "input_ids",
                f"prompt of {len(req.input_ids)} tokens plus up to {req.sampling.max_tokens} new ones needs "
                f"{self.kv.blocks_for(longest)} KV pages of {self.kv.block_size} tokens; "
                f"the pool has {self.kv.num_blocks}",
            )

    def add_request(self, req: GenerateRequest) -> RequestState:
        self.validate(req)
        state = RequestState(req.request_id or uuid.uuid4().hex, req)
        self.scheduler.add(state)
        self.stats.requests_total += 1
        self.stats.prompt_tokens_total += len(state.prompt)
        return state

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def abort(self, state: RequestState) -> None:
        self.scheduler.abort(state)

    def abort_all(self) -> list[RequestState]:
        return self.scheduler.abort_all()

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResponse]:
        """Run requests to completion in-process (all batched together), in order."""
        if self.background:
            raise RuntimeError("this engine is driven by an AsyncEngine; use its submit()")
        states = [self.add_request(r) for r in requests]
        while not all(s.finished for s in states):
            self.step()
        return [s.response() for s in states]

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def step(self) -> list[RequestState]:
        """One batched forward + sample; returns the requests that finished in this step."""
        expired = self._expire() if self.cfg.request_timeout_s is not None else []
        plan = self.scheduler.schedule()
        if plan.empty:
            return expired
        t0 = time.perf_counter()
        spans = [Span(s.block_table, s.num_cached, s.uncached_tokens()[:n]) for s, n in plan.compute]
        batch = ForwardBatch.build(spans, self.device, self.kv.max_seq_len, self.kv.block_size)
        hidden = self.model(batch, self.kv)
        self.stats.computed_tokens_total += len(batch.input_ids)

        # Sequences whose tokens are now all cached sample; a partial prefill chunk does not.
        row: dict[int, int] = {}
        for i, (s, n) in enumerate(plan.compute):
            done = s.num_cached + n == s.num_tokens
            s.num_cached += n
            self.scheduler.register_full_pages(s)
            if done:
                row[id(s)] = i
        self.scheduler.finish_forks(plan)
        seqs = [s for s, _ in plan.compute if id(s) in row] + [child for child, _ in plan.forks]
        rows = [row[id(s)] for s, _ in plan.compute if id(s) in row] + [row[id(p)] for _, p in plan.forks]
        tokens, logprobs = [], []
        if seqs:
            logits = self.model.logits(hidden[batch.last_index[rows]])
            tokens, logprobs = self.sampler(logits, [s.params for s in seqs], [s.rng for s in seqs])

        finished: list[RequestState] = []
        for seq, token, logprob in zip(seqs, tokens, logprobs, strict=True):
            seq.append(token, logprob, self.version)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                seq.status, seq.finish_reason = Status.FINISHED, reason
                if seq.request.finished:
                    finished.append(seq.request)
        self.scheduler.release_finished()
        self.stats.requests_finished += len(finished)
        self.stats.observe_step(plan.num_seqs, len(seqs), time.perf_counter() - t0)
        return expired + finished

    def _expire(self) -> list[RequestState]:
        """Abort requests older than request_timeout_s (their pages are freed at once)."""
        assert self.cfg.request_timeout_s is not None
        deadline = time.monotonic() - self.cfg.request_timeout_s
        expired = [r for r in self.scheduler.requests() if r.arrival < deadline]
        for r in expired:
            self.scheduler.abort(r)
        self.stats.requests_timed_out += len(expired)
        self.stats.requests_finished += len(expired)
        return expired

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if len(seq.output) >= p.max_tokens or seq.num_tokens >= self.max_seq_len:
            return "length"
        return None

    # ------------------------------------------------------------------ weights

    def read_weights(self, path: str | Path) -> Checkpoint:
        """Read and check a weights directory (any thread; touches no engine state)."""
        ckpt = read_checkpoint(path)
        if not ckpt.same_architecture(self.model_config):
            raise WeightsError(
                f"{ckpt.path}: architecture {ckpt.config} differs from the loaded {self.model_config}"
            )
        return ckpt

    def apply_weights(self, ckpt: Checkpoint, version: int) -> None:
        """Swap weights in place. Call between steps only. Running sequences keep their KV (computed
        by the old weights) and continue; tokens sampled from now on are tagged `version`."""
        self.model.load_hf_state(ckpt.state)
        # New admissions hash under the new version: pages computed by the old weights never match.
        self.version = self.scheduler.version = version
        self.model_dir = ckpt.path
        self.stats.weight_updates_total += 1

    def load_weights(self, path: str | Path, version: int) -> None:
        self.apply_weights(self.read_weights(path), version)
