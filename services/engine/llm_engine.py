"""LLMEngine: the synchronous, library-first inference engine.

    engine = LLMEngine("runs/x/weights/step_3", EngineConfig(device="cpu"))
    [resp] = engine.generate([GenerateRequest(input_ids=[5, 6, 7])])

One `step()` = schedule, one batched forward over every scheduled sequence's new tokens (prompt
chunks of prefilling sequences, the last sampled token of decoding ones), sample one token per
sequence whose tokens are now all cached, publish newly full KV pages to the prefix cache, retire
finished ones. The async service wrapper (async_engine.py) drives the same
`step()` from a background thread. With `overlap_schedule` a step launches the next forward before
reading the previous step's tokens and does that step's bookkeeping while it runs
(`_step_overlapped`, docs/engine.md).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer

from services.common import routing
from services.common.config import EngineConfig
from services.common.schemas import GenerateRequest, GenerateResponse
from services.engine.batch import BlockTables, Span
from services.engine.cuda_graphs import DecodeGraphs, MixedGraphs
from services.engine.kv_cache import KVCache
from services.engine.kv_transfer import PageExchange, layout_id
from services.engine.layers.sampler import PendingSample, SampleOutput, Sampler
from services.engine.loader import Checkpoint, WeightsError, read_checkpoint
from services.engine.model_runner import ModelRunner
from services.engine.overlap import Feed, InFlight
from services.engine.scheduler import Scheduler, StepPlan
from services.engine.sequence import RequestState, Sequence, Status
from services.engine.stats import EngineStats
from services.engine.weight_staging import WeightStager

log = logging.getLogger(__name__)


class InvalidRequest(ValueError):
    """A request the engine cannot serve; `field` names the offending field (e.g. "input_ids")."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


class LLMEngine:
    # EngineConfig.stage_weights: the staging copy of the weights (ModelRunner's; multi-rank: none).
    stager: WeightStager | None = None

    def __init__(
        self,
        model_dir: str | Path,
        cfg: EngineConfig,
        version: int | None = None,
    ):
        torch.set_num_threads(cfg.torch_threads)
        self.cfg = cfg
        ckpt = read_checkpoint(model_dir)
        # The model, its KV cache and everything that runs them (model_runner.py).
        self.runner = runner = ModelRunner(ckpt, cfg)
        self.model, self.kv, self.model_config = runner.model, runner.kv, runner.model_config
        self.device, self.dtype, self.max_seq_len = runner.device, runner.dtype, runner.max_seq_len
        self.memory_cap = runner.memory_cap
        self.stats = EngineStats()
        self.scheduler = Scheduler(
            self.kv, cfg.max_batch_size, cfg.max_num_batched_tokens, cfg.enable_prefix_caching, self.stats
        )
        self.eos_token_ids = set(ckpt.eos_token_ids)
        # Stop strings and output text (sequence.py) need it; None when the directory has none.
        tok_file = ckpt.path / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(tok_file)) if tok_file.is_file() else None
        # request_id -> callback(state), called on the stepping thread after every step that added
        # tokens to that request: the decode service streams (SSE) through it.
        self.watchers: dict[str, Callable[[RequestState], None]] = {}
        self.model_dir = ckpt.path
        self.version = self.scheduler.version = version if version is not None else (ckpt.version or 0)
        # Pages travel between engines (prefill -> KV store -> decode) keyed by hash chains rooted
        # at (weight version, layout): kv_transfer.py.
        self.layout = self.scheduler.layout = layout_id(self.model_config.arch, self.kv)
        self.pages = PageExchange(self.kv, layout=self.layout)
        self.scheduler.landing = self.pages.landing_keys
        self._born_finished: list[RequestState] = []  # every sample ended on its prefilled token
        # Overlap scheduling (cfg.overlap_schedule, docs/engine.md): the launched step whose tokens
        # have not been appended yet.
        self._inflight: InFlight | None = None
        self._resolve_s = 0.0  # seconds the last _land waited for its tokens (stats.last_step_phases)
        # Overlap scheduling: (tokens, time the step before it landed) of the prefill step in
        # flight, whose cost is known when it lands (its period between two landings).
        self._prefill_lag: tuple[int, float] | None = None
        ov = cfg.overlap_schedule
        self.overlap = ov is True or (ov == "auto" and self.device.type == "cuda")
        # Set by AsyncEngine: then only its thread may call step().
        self.background = False
        # The GPU fast path (paged kernels, CUDA graphs), last: graph capture runs the model.
        runner.prepare()
        self.stager = runner.stager

    def _launch(
        self, spans: list[Span], seqs: list[Sequence], rows: list[int], feed: Feed | None = None
    ) -> PendingSample | None:
        """Queue a step's forward and the sampling of `seqs` (model_runner.py; a multi-rank engine,
        parallel/engine.py, sends it to its ranks instead)."""
        return self.runner.launch(spans, seqs, rows, feed)

    # The runner's parts a caller may read (tests and benchmarks swap the sampler or the graphs).
    @property
    def sampler(self) -> Sampler:
        return self.runner.sampler

    @sampler.setter
    def sampler(self, sampler: Sampler) -> None:
        self.runner.sampler = sampler

    @property
    def graphs(self) -> DecodeGraphs | None:
        return self.runner.graphs

    @graphs.setter
    def graphs(self, graphs: DecodeGraphs | None) -> None:
        self.runner.graphs = graphs

    @property
    def mixed_graphs(self) -> MixedGraphs | None:
        return self.runner.mixed_graphs

    @property
    def attention_backend(self) -> str:
        return self.runner.attention_backend

    @property
    def pdl(self) -> bool:
        return self.runner.pdl

    @property
    def num_sms(self) -> int:
        return self.runner.num_sms

    @property
    def block_tables(self) -> BlockTables:
        return self.runner.block_tables

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
        if (req.sampling.stop or req.sampling.detokenize) and self.tokenizer is None:
            field = "sampling.stop" if req.sampling.stop else "sampling.detokenize"
            raise InvalidRequest(field, "this model directory has no tokenizer.json to detokenise with")
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
        state = RequestState(req.request_id or uuid.uuid4().hex, req, self.tokenizer)
        first = self.pages.take_first(state.request_id)
        tail = self.pages.take_tail(state.request_id)
        keys = self.pages.take_keys(state.request_id)
        if first is not None:
            self._seed_first_tokens(state, first)
            if state.finished:
                self._born_finished.append(state)  # the next step() reports it
            for s in state.seqs:
                if s.status is Status.FINISHED:
                    continue
                if keys is not None:  # the pull's page keys: admission need not hash again
                    self.scheduler.known_keys[s] = keys
                if tail is not None:
                    # The prompt's partial last page, from the prefill that sampled the first
                    # token: each sample copies it into its own page at admission.
                    self.scheduler.tails[s] = tail
        self.scheduler.add(state)
        self.stats.requests_total += 1
        self.stats.prompt_tokens_total += len(state.prompt)
        return state

    @property
    def in_flight(self) -> bool:
        """A launched step's tokens are not appended yet (overlap scheduling; flush() lands them)."""
        return self._inflight is not None

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def abort(self, state: RequestState) -> None:
        self.scheduler.abort(state)

    def abort_all(self) -> list[RequestState]:
        self._inflight = None  # its tokens would be discarded anyway; after a failed step, unsafe
        self._prefill_lag = None
        return self.scheduler.abort_all()

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResponse]:
        """Run requests to completion in-process (all batched together), in order."""
        if self.background:
            raise RuntimeError("this engine is driven by an AsyncEngine; use its submit()")
        states = [self.add_request(r) for r in requests]
        while not all(s.finished for s in states):
            self.step()
        if not self.scheduler.has_work():
            self.flush()  # only discarded tokens of finished sequences are left in flight
        return [s.response() for s in states]

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def step(self) -> list[RequestState]:
        """One batched forward + sample; returns the requests that finished in this step."""
        t_begin = time.perf_counter()
        self.stats.last_step_phases = {}  # stays empty if nothing is scheduled
        expired = self._expire() if self.cfg.request_timeout_s is not None else []
        if self._born_finished:
            expired, self._born_finished = self._born_finished + expired, []
        if self.pages.pending:
            self.pages.drain()  # pages pulled from the KV store: prefix hits for this admission
        t_drain = time.perf_counter()
        if self.overlap:
            return expired + self._step_overlapped(t_drain - t_begin)
        plan = self.scheduler.schedule()
        if plan.empty:
            return expired
        t0 = time.perf_counter()
        spans = self.spans(plan)
        seqs, rows = self._sampling_rows(plan)
        t1 = time.perf_counter()
        launched = self._launch(spans, seqs, rows)
        t2 = time.perf_counter()
        # Host bookkeeping that needs no sampled token runs here, while the forward is in flight.
        self.advance(plan)
        t3 = time.perf_counter()
        # The step's one host <-> device sync.
        out = launched.resolve() if launched is not None else SampleOutput([], [], [])
        t4 = time.perf_counter()
        finished = self.commit(seqs, out)  # counts the generated tokens
        self.stats.observe_step(plan.num_seqs, 0, time.perf_counter() - t0)
        if self.watchers:
            self._notify_watchers(seqs)
        t5 = time.perf_counter()
        self.stats.last_step_phases = {
            "drain": t_drain - t_begin,
            "schedule": t0 - t_drain,
            "prep": t1 - t0,
            "forward": t2 - t1,
            "sample": t4 - t3,
            "post": (t3 - t2) + (t5 - t4),
        }
        return expired + finished

    def spans(self, plan: StepPlan) -> list[Span]:
        """The new tokens of every scheduled sequence (a decode's is its last sampled token)."""
        spans = []
        fed = 0
        for s, n in plan.compute:
            start = s.num_cached
            out = s.output
            fed += n
            if n == 1 and start == len(s.prompt) + len(out) - 1:  # (num_tokens, inlined: hot loop)
                toks = [out[-1] if out else s.prompt[-1]]  # decode: no list slicing
            else:
                toks = s.uncached_tokens()[:n]
            spans.append(Span(s.block_table, start, toks, s.state_slot))
        self.stats.computed_tokens_total += fed
        return spans

    def advance(self, plan: StepPlan) -> None:
        """After the forward is issued: mark the fed tokens cached, publish full pages, give forked
        children their pages."""
        register = self.scheduler.register_full_pages
        bs = self.kv.block_size if self.scheduler.prefix_caching else 1 << 62
        for s, n in plan.compute:
            s.num_cached = cached = s.num_cached + n
            if len(s.block_hashes) < cached // bs:  # a page filled up (the call is a no-op otherwise)
                register(s)
        if plan.forks:
            self.scheduler.finish_forks(plan)

    @property
    def kv_pools(self) -> list[KVCache]:
        """The page pools this engine schedules (a data-parallel engine: one per attention group)."""
        return [self.kv]

    def routing_pool(self, seq: Sequence) -> KVCache:
        """The cache whose routing store holds `seq`'s expert ids (a data-parallel engine keeps one
        per attention group)."""
        return self.kv

    def commit(
        self, seqs: list[Sequence], out: SampleOutput, version: int | None = None
    ) -> list[RequestState]:
        """Append the sampled tokens, apply stop conditions, free finished sequences' pages;
        returns the requests that finished. `version`: of the weights that computed the tokens
        (default: the current one). A sequence already finished (overlap scheduling: its extra
        token; or aborted meanwhile) gets nothing."""
        finished: list[RequestState] = []
        done: list[Sequence] = []
        stop_reason = self._stop_reason
        version = self.version if version is None else version
        skipped = 0
        for seq, token, logprob, top in zip(seqs, out.tokens, out.logprobs, out.top, strict=True):
            if seq.status is Status.FINISHED:
                skipped += 1
                continue
            seq.append(token, logprob, version, top)
            reason = stop_reason(seq, token)
            if reason is not None:
                seq.status, seq.finish_reason = Status.FINISHED, reason
                done.append(seq)
                if seq.request.return_routed_experts and self.kv.routing is not None:
                    # Every forwarded token's expert ids, read from its pages before they are freed.
                    ids = self.routing_pool(seq).read_routing(seq.block_table, seq.num_cached, seq.num_tokens)
                    seq.routed_experts = routing.encode(ids)
                if seq.request.finished:
                    finished.append(seq.request)
        if self.pages.sink is not None and done:
            self.pages.export(done, [r.request_id for r in finished])  # before the pages are freed
        self.scheduler.release_finished()
        self.stats.requests_finished += len(finished)
        self.stats.generated_tokens_total += len(seqs) - skipped
        return finished

    # ------------------------------------------------------------------ overlap scheduling

    def _step_overlapped(self, drain_s: float = 0.0) -> list[RequestState]:
        """Step N+1 launched before step N's tokens are read (docs/engine.md, "Overlap scheduling"):
        schedule, launch forward + sampling (pending tokens fed on the device), then land N (wait
        for its tokens, append, stop, free) while N+1 computes, then N+1's page bookkeeping."""
        t_sched = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.empty:
            return self.flush()
        t0 = time.perf_counter()
        spans, feed = self._spans_overlapped(plan)
        seqs, rows = self._sampling_rows(plan)
        t1 = time.perf_counter()
        launched = self._launch(spans, seqs, rows, feed)
        for j, s in enumerate(seqs):
            s.pending += 1
            s.pending_row = j
        t2 = time.perf_counter()
        prev, self._inflight = self._inflight, (InFlight(seqs, launched, self.version) if launched else None)
        self._resolve_s = 0.0
        finished = self._land(prev) if prev is not None else []
        t_landed = time.perf_counter()
        self._observe_prefill_landed(t_landed)
        self._advance_overlapped(plan)
        # commit() counts the generated tokens: a discarded one is not generated.
        t3 = time.perf_counter()
        # A prefill step's cost is not this call's time (its launch + the previous step's
        # landing): with CUDA graphs the launch is ~0.1 ms and a 2k-token prefill looked free to
        # the KV-pull policy. It is timed as the period from the landing before it to its own.
        fed = self.stats.observe_step(plan.num_seqs, 0, t3 - t0, prefill=False)
        self._prefill_lag = (fed, t_landed) if fed > plan.num_seqs else None
        self.stats.last_step_phases = {
            "drain": drain_s,
            "schedule": t0 - t_sched,
            "prep": t1 - t0,
            "forward": t2 - t1,
            "sample": self._resolve_s,  # the wait for the previous step's tokens
            "post": t3 - t2 - self._resolve_s,
        }
        return finished

    def flush(self) -> list[RequestState]:
        """Land the step in flight, if any, without launching another (overlap scheduling; a no-op
        otherwise): returns the requests it finished."""
        prev, self._inflight = self._inflight, None
        out = self._land(prev) if prev is not None else []
        self._observe_prefill_landed(time.perf_counter())
        return out

    def _observe_prefill_landed(self, now: float) -> None:
        if self._prefill_lag is not None:
            tokens, since = self._prefill_lag
            self._prefill_lag = None
            self.stats.observe_prefill(tokens, now - since)

    def _land(self, rec: InFlight) -> list[RequestState]:
        t = time.perf_counter()
        out = rec.sample.resolve()  # the wait for that step's tokens (the next one is queued)
        self._resolve_s = time.perf_counter() - t
        for s in rec.seqs:
            s.pending -= 1
        # Before commit: a sequence finished already gets no token (and its watcher no call).
        live = [s for s in rec.seqs if s.status is not Status.FINISHED] if self.watchers else []
        finished = self.commit(rec.seqs, out, rec.version)
        if live:
            self._notify_watchers(live)
        return finished

    def _spans_overlapped(self, plan: StepPlan) -> tuple[list[Span], Feed | None]:
        """As spans(); a sequence whose next token is pending feeds a placeholder that the device
        overwrites with the in-flight token (its row in the in-flight sample: pending_row)."""
        spans: list[Span] = []
        dst: list[int] = []
        src: list[int] = []
        row = 0
        for s, n in plan.compute:
            start = s.num_cached
            if s.pending:
                assert n == 1, "a pending token is the only uncached one"
                toks = [0]
                dst.append(row)
                src.append(s.pending_row)
            elif n == 1 and start == len(s.prompt) + len(s.output) - 1:
                toks = [s.output[-1] if s.output else s.prompt[-1]]
            else:
                toks = s.uncached_tokens()[:n]
            spans.append(Span(s.block_table, start, toks, s.state_slot))
            row += n
        self.stats.computed_tokens_total += row
        if not dst:
            return spans, None
        assert self._inflight is not None
        return spans, Feed(dst, src, self._inflight.sample.tokens)

    def _sampling_rows(self, plan: StepPlan) -> tuple[list[Sequence], list[int]]:
        """The sequences that sample in this step and their logit rows, chosen before the forward:
        a sequence samples once every token it has (pending ones included) is fed (a partial
        prefill chunk does not sample); a forked child samples from its parent's row."""
        seqs: list[Sequence] = []
        rows: list[int] = []
        for i, (s, n) in enumerate(plan.compute):
            if s.num_cached + n == len(s.prompt) + len(s.output) + s.pending:
                seqs.append(s)
                rows.append(i)
        if plan.forks:
            index = {id(s): i for i, (s, _) in enumerate(plan.compute)}
            for child, parent in plan.forks:
                seqs.append(child)
                rows.append(index[id(parent)])
        return seqs, rows

    def _advance_overlapped(self, plan: StepPlan) -> None:
        """advance()'s page bookkeeping, after the previous step landed (so every fed token is in
        seq.output for the page hashes); sequences that landing finished are skipped."""
        register = self.scheduler.register_full_pages
        bs = self.kv.block_size if self.scheduler.prefix_caching else 1 << 62
        for s, n in plan.compute:
            if s.status is Status.FINISHED:
                continue  # its pages are freed; the token fed for it is discarded
            s.num_cached = cached = s.num_cached + n
            if len(s.block_hashes) < cached // bs:
                register(s)
        if plan.forks:
            self.scheduler.finish_forks(plan)

    def _notify_watchers(self, seqs: list[Sequence]) -> None:
        for state in {id(s.request): s.request for s in seqs}.values():
            watcher = self.watchers.get(state.request_id)
            if watcher is None:
                continue
            try:
                watcher(state)
            except Exception:  # noqa: BLE001 - one broken stream must not fail the whole step
                log.exception("watcher of request %s failed; dropped", state.request_id)
                self.watchers.pop(state.request_id, None)

    def _seed_first_tokens(self, state: RequestState, first: list[tuple[int, float, int]]) -> None:
        """Start each sample from a first token sampled elsewhere (a prefill service, same weights,
        same seed): append it and advance the sample's RNG past the draw it used, so the rest of the
        sequence is what this engine would have sampled itself."""
        if len(first) != len(state.seqs):
            raise InvalidRequest("request_id", f"{len(first)} prefilled tokens for {len(state.seqs)} samples")
        for seq, (token, logprob, version) in zip(state.seqs, first, strict=True):
            if seq.params.temperature > 0:
                seq.rng.random()
            seq.append(token, logprob, version)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                seq.status, seq.finish_reason = Status.FINISHED, reason

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
            if seq.text is not None:
                seq.text.finish()  # the stop token's own text is not part of the output
            return "stop"
        if seq.text is not None and seq.text.push(token):
            return "stop"  # a stop string completed; seq.text is cut before it
        n = len(seq.output)
        if n >= p.max_tokens or len(seq.prompt) + n >= self.max_seq_len:  # (num_tokens, inlined)
            return "stop" if seq.text is not None and seq.text.finish() else "length"
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
        by the old weights) and continue; tokens sampled from now on are tagged `version`. With
        EngineConfig.stage_weights: staged here, then swapped (AsyncEngine stages off the loop)."""
        if self.stager is not None:
            self.swap_weights(ckpt, version, self.stage_weights(ckpt))
            return
        t0 = time.monotonic()
        self.runner.load_state(ckpt)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the copies are done: the apply's true time
        self._weights_live(ckpt, version, time.monotonic() - t0)

    def stage_weights(self, ckpt: Checkpoint) -> float:
        """EngineConfig.stage_weights: write `ckpt` into the staging copy of the weights, from any
        thread while steps run (one version at a time, each swapped in before the next is staged);
        returns the seconds taken. A failure (e.g. a tensor of the wrong shape) raises and leaves
        the live weights and the version as they were."""
        assert self.stager is not None, "EngineConfig.stage_weights is off"
        return self.stager.stage(ckpt)

    def swap_weights(self, ckpt: Checkpoint, version: int, stage_s: float) -> None:
        """Between steps: the staged `ckpt` goes live (a device-to-device copy into the live
        buffers) and tokens sampled from now on are tagged `version`."""
        assert self.stager is not None, "EngineConfig.stage_weights is off"
        t0 = time.monotonic()
        self.stager.swap()
        self._weights_live(ckpt, version, time.monotonic() - t0, stage_s)

    def _weights_live(self, ckpt: Checkpoint, version: int, apply_s: float, stage_s: float = 0.0) -> None:
        # New admissions hash under the new version: pages computed by the old weights never match.
        self.version = self.scheduler.version = version
        self.model_dir = ckpt.path
        self.stats.observe_weights(apply_s, ckpt.read_s, ckpt.nbytes, stage_s)

    def load_weights(self, path: str | Path, version: int) -> None:
        self.apply_weights(self.read_weights(path), version)
