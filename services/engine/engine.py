"""LLMEngine: the synchronous, library-first inference engine.

    engine = LLMEngine("runs/x/weights/step_3", EngineConfig(device="cpu"))
    [resp] = engine.generate([GenerateRequest(input_ids=[5, 6, 7])])

One `step()` = schedule, one batched forward over every scheduled sequence's new tokens (prompts
of newly admitted sequences, the last sampled token of running ones), sample one token per
sequence, retire finished ones. The async service wrapper (async_engine.py) drives the same
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
from services.engine.scheduler import DEFAULT_MAX_PREFILL_TOKENS, Scheduler
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
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
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
            cfg.max_batch_size,
            self.max_seq_len,
            m.n_kv_heads,
            m.head_dim,
            self.dtype,
            self.device,
        )
        self.scheduler = Scheduler(self.kv, max_prefill_tokens)
        self.sampler = Sampler()
        self.eos_token_ids = set(ckpt.eos_token_ids)
        self.model_dir = ckpt.path
        self.version = version if version is not None else (ckpt.version or 0)
        self.stats = EngineStats()
        # Set by AsyncEngine: then only its thread may call step().
        self.background = False

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
        plan = self.scheduler.schedule()
        if plan.empty:
            return []
        t0 = time.perf_counter()
        spans = [Span(s.slot, s.num_cached, s.uncached_tokens()) for s in plan.compute]
        batch = ForwardBatch.build(spans, self.device, self.kv.max_seq_len)
        hidden = self.model(batch, self.kv)
        logits = self.model.logits(hidden[batch.last_index])  # one row per computed sequence

        row = {id(s): i for i, s in enumerate(plan.compute)}
        for child, parent in plan.forks:
            self.kv.copy(parent.slot, child.slot, len(parent.prompt))
        seqs = plan.compute + [child for child, _ in plan.forks]
        rows = list(range(len(plan.compute))) + [row[id(parent)] for _, parent in plan.forks]
        tokens, logprobs = self.sampler(logits[rows], [s.params for s in seqs], [s.rng for s in seqs])

        finished: list[RequestState] = []
        for seq, token, logprob in zip(seqs, tokens, logprobs, strict=True):
            seq.num_cached = seq.num_tokens  # everything fed so far is now in the cache
            seq.append(token, logprob, self.version)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                seq.status, seq.finish_reason = Status.FINISHED, reason
                if seq.request.finished:
                    finished.append(seq.request)
        self.scheduler.release_finished()
        self.stats.requests_finished += len(finished)
        self.stats.observe_step(len(seqs), len(seqs), time.perf_counter() - t0)
        return finished

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
        self.version = version
        self.model_dir = ckpt.path
        self.stats.weight_updates_total += 1

    def load_weights(self, path: str | Path, version: int) -> None:
        self.apply_weights(self.read_weights(path), version)
