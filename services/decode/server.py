"""The decode service: one engine replica behind HTTP.

    python -m services.decode --config RUN_DIR/config.json --redis-url redis://host:port/0

On start it registers itself (version -1, health "loading"), waits for the trainer's first weights
to appear in Redis, loads them, and serves. Later versions arrive via POST /update_weights, which
swaps them at a step boundary while requests keep running.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import redis
from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from prometheus_client import REGISTRY
from tokenizers import Tokenizer

from services.common.chat import ChatTemplate, ChatTemplateError
from services.common.config import RunConfig
from services.common.gate import BodyLimit
from services.common.gpu_memory import memory_held
from services.common.schemas import (
    ChatCompletionRequest,
    ChatCompletionTokensRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    GenerateRequest,
    GenerateResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from services.common.service import (
    Service,
    add_update_weights_route,
    create_app,
    loaded,
    log_event,
    start_service,
    token_body_limit,
)
from services.decode.metrics import EngineCollector
from services.decode.openai import (
    PromptError,
    Stream,
    api_field,
    forced_call,
    forced_call_text,
    to_chat_completion,
    to_chat_generate_request,
    to_completion,
    to_generate_request,
)
from services.decode.streaming import sse_events
from services.decode.tokenize import detokenize, tokenize
from services.engine import AsyncEngine, InvalidRequest, LLMEngine, WeightsError
from services.engine.host_tuning import tune_after_startup
from services.engine.parallel.ranks import EngineRanks, end_replica
from services.engine.parallel.runner import check_engine
from services.kvstore.router import KVRouter

WEIGHTS_POLL_S = 0.5
# A broken rank group exits this long after /health turned 503 and the requests it held were
# answered: their 503s reach the clients first, and the supervisor restarts the group promptly.


def start_checks(cfg: RunConfig) -> None:
    """What the decode service refuses to start with (SystemExit naming the key), on the config
    alone: the test of the shipped configs runs it without building an engine."""
    par = cfg.decode.parallel
    if par.ranks > 1:
        try:
            check_engine(cfg.decode.engine, cfg.model, par)
        except ValueError as e:
            raise SystemExit(f"decode.parallel: {e}") from None


class Decode:
    """The replica's state: the engine appears once the first weights are loaded."""

    def __init__(self, service: Service):
        self.service = service
        self.cfg = service.cfg
        self.log = service.log
        self.engine: AsyncEngine | None = None
        self.tokenizer: Tokenizer | None = None
        self.chat_template: ChatTemplate | None = None  # the model directory's, for /v1/chat/completions
        self.paused = False  # remembered while loading, applied to the engine once it exists
        # kvstore.enabled: pull prompt pages from the KV store / route long prompts to prefill
        # services before the engine prefills (services/kvstore/router.py).
        self.kv: KVRouter | None = (
            KVRouter(self.cfg, service.bus.services) if self.cfg.kvstore.enabled else None
        )
        self._load_lock = asyncio.Lock()
        # decode.parallel over several ranks: this process is rank 0 and starts the others with
        # the engine (services/engine/parallel/ranks.py).
        self.ranks: EngineRanks | None = None
        start_checks(self.cfg)

    # ------------------------------------------------------------------ weights

    async def load(self, path: str, version: int, initial: bool = False) -> int:
        """First call builds the engine; later ones swap weights between steps. Raises WeightsError.
        initial=True (the Redis poller) does nothing once an engine exists: a POST /update_weights
        that won the race may already have loaded a newer version."""
        async with self._load_lock:
            if self.engine is not None and (initial or version == self.engine.version):
                # The version it serves is not applied again: a version names one set of weights
                # for the whole run (and /update_weights takes only its announced directory).
                return self.engine.version
            if self.engine is None:
                if self.cfg.decode.parallel.ranks > 1:
                    engine = await asyncio.to_thread(self._start_ranks, path, version)
                else:
                    engine = await asyncio.to_thread(LLMEngine, path, self.cfg.decode.engine, version)
                tok_file = Path(path) / "tokenizer.json"
                self.tokenizer = Tokenizer.from_file(str(tok_file)) if tok_file.exists() else None
                try:
                    self.chat_template = ChatTemplate.from_model_dir(path)
                except ChatTemplateError as e:  # completions still work; chat answers 400
                    self.log.error(f"{path}: {e}")
                if self.kv is not None:
                    self.kv.attach(engine)
                # Start-up's objects out of the GC's way, the GIL back to the step loop sooner (host_tuning.py).
                log_event(self.log, "host tuned", **tune_after_startup())
                self.engine = AsyncEngine(engine).start()
                if self.paused:
                    self.engine.pause()
                log_event(
                    self.log,
                    "engine ready",
                    path=path,
                    version=version,
                    device=str(engine.device),
                    dtype=self.cfg.decode.engine.dtype,
                    max_batch_size=self.cfg.decode.engine.max_batch_size,
                    max_seq_len=engine.max_seq_len,
                    kv_blocks=engine.kv.num_blocks,
                    kv_bytes=engine.kv.kv_bytes,
                    state_bytes=engine.kv.state_bytes,  # Mamba-2 slots, out of the same budget
                    **engine.memory_cap,
                    **memory_held(engine.device),  # weights, KV pool, CUDA graph pools
                )
            else:
                old = self.engine.version
                t0 = time.monotonic()
                await self.engine.load_weights(path, version)
                log_event(
                    self.log,
                    "weights updated",
                    path=path,
                    version=version,
                    previous=old,
                    s=round(time.monotonic() - t0, 4),  # read + swap at a step boundary
                )
            self.service.version = version
            return version

    def _start_ranks(self, path: str, version: int) -> LLMEngine:
        name = f"decode.{self.service.index}"
        self.ranks = EngineRanks(self.cfg, "decode", self._ranks_failed, bus=self.service.bus, name=name)
        self.ranks.start()
        par = self.cfg.decode.parallel
        log_event(
            self.log, "engine ranks joined", ranks=par.ranks, tp=par.tp, ep=par.ep, nodes=self.ranks.nodes
        )
        return self.ranks.engine(path, version)

    def _ranks_failed(self, why: str) -> None:
        end_replica(self.service, self.engine, self.ranks, why)

    async def wait_for_weights(self) -> None:
        """Poll Redis for the latest published weights until an engine is up (or another path,
        POST /update_weights, built it first)."""
        announced = False
        while self.engine is None:
            try:
                info = await asyncio.to_thread(self.service.bus.latest_weights)
            except redis.RedisError as e:
                self.log.warning(f"redis unavailable while waiting for weights: {e}")
                info = None
            if info is not None:
                try:
                    await self.load(info.path, info.version, initial=True)
                    return
                except WeightsError as e:
                    # Keep polling: the trainer may publish a usable version next.
                    self.log.error(f"cannot load published weights: {e}")
            elif not announced:
                log_event(self.log, "waiting for weights", key=self.service.bus.k.weights_latest)
                announced = True
            await asyncio.sleep(WEIGHTS_POLL_S)

    # ------------------------------------------------------------------ helpers

    def loaded(self) -> AsyncEngine:
        return loaded(self.engine)

    def ready(self) -> AsyncEngine:
        """The engine, for a new generation: 503 (Retry-After) while loading or paused. Requests
        already queued when the replica was paused wait for POST /resume."""
        self.loaded()
        if self.service.failed:  # a broken rank group: it exits in a moment, retry elsewhere
            raise HTTPException(503, self.service.failed)
        if self.paused:
            raise HTTPException(
                503,
                "paused: this replica takes no new requests until POST /resume",
                headers={"Retry-After": "1"},
            )
        return self.engine

    def clamp(self, req: GenerateRequest) -> GenerateRequest:
        """max_tokens past the end of the context means "until the context is full": the
        sequence then ends there with finish_reason "length"."""
        assert self.engine is not None
        room = self.engine.engine.max_seq_len - len(req.input_ids)
        if 0 < room < req.sampling.max_tokens:
            req.sampling.max_tokens = room
        return req

    def failure(self) -> str:
        """A dead engine loop thread answers no request again: /health must say so."""
        if self.engine is not None and not self.engine.alive:
            return "engine loop thread died"
        return self.service.failure()

    def health(self) -> dict[str, Any]:
        eng = self.engine
        return {
            "status": "ok" if eng is not None else "loading",
            "queue": eng.num_waiting if eng else 0,
            "running": eng.num_running if eng else 0,
            "paused": eng.paused if eng else self.paused,
            "idle_s": round(eng.engine.stats.idle_seconds_total, 3) if eng else 0.0,
            **({"kv": self.kv.stats()} if self.kv is not None else {}),
        }

    async def submit(self, req: GenerateRequest) -> GenerateResponse:
        engine = self.ready()
        self.clamp(req)
        try:
            if self.kv is not None:
                return await self.kv.generate(engine, req)
            return await engine.submit(req)
        except RuntimeError as e:  # engine stopping
            raise HTTPException(503, str(e)) from None


_collector: EngineCollector | None = None


def build_app(service: Service) -> FastAPI:
    global _collector
    state = Decode(service)
    # One collector per process (registering twice raises); it reports the latest app's engine.
    if _collector is None:
        _collector = EngineCollector(lambda: state.engine)
        REGISTRY.register(_collector)
    else:
        _collector.engine = lambda: state.engine

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async with service.registered():
            # No weights ever loaded is no decode: a loader that dies fails /health.
            loader = service.watch(
                asyncio.create_task(state.wait_for_weights()), "weights loader", lambda: True
            )
            try:
                yield
            finally:
                loader.cancel()
                if state.engine is not None:
                    await asyncio.to_thread(state.engine.stop)
                if state.ranks is not None:
                    engine = state.engine.engine if state.engine is not None else None
                    await asyncio.to_thread(state.ranks.stop, engine)  # type: ignore[arg-type]
                if state.kv is not None:
                    await state.kv.close()
                log_event(service.log, "engine stopped")

    sec = service.cfg.decode
    data = BodyLimit(sec.max_request_bytes, "decode.max_request_bytes")
    app = create_app(
        "relay-decode",
        state.health,
        lifespan,
        service=service,
        failure=state.failure,
        open_routes={"GET /v1/models", "GET /v1/models/{model_id}"},
        body_limits={
            "POST /v1/generate": token_body_limit(sec.engine, data),
            **{
                f"POST {route}": data
                for route in (
                    "/v1/completions",
                    "/v1/chat/completions",
                    "/v1/chat/completions/tokens",
                    "/tokenize",
                    "/v1/tokenize",
                    "/detokenize",
                    "/v1/detokenize",
                )
            },
        },
    )
    app.state.decode = state

    @app.post("/v1/generate", response_model=GenerateResponse)
    async def generate(req: GenerateRequest) -> GenerateResponse:
        try:
            return await state.submit(req)
        except InvalidRequest as e:
            raise HTTPException(400, str(e)) from None

    async def openai_call(
        req: CompletionRequest | ChatCompletionRequest,
        greq: GenerateRequest,
        prompt_field: str,
        forced: str = "",
    ) -> GenerateResponse | StreamingResponse:
        """Run an OpenAI request: the whole response, or (stream: true) an SSE stream."""
        engine = state.ready()
        greq.request_id = uuid.uuid4().hex
        try:
            # Checked before answering 200, so bad input is a 4xx even when streaming.
            engine.engine.validate(state.clamp(greq))
            if req.stream:
                stream = Stream(
                    req, state.tokenizer, service.cfg.run.name, greq.request_id, greq.input_ids, forced
                )
                events = sse_events(engine.engine, state.submit, greq, stream)
                return StreamingResponse(events, media_type="text/event-stream")
            return await state.submit(greq)
        except InvalidRequest as e:
            raise HTTPException(400, f"{api_field(e.field, prompt_field)}: {e.reason}") from None

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest) -> dict[str, Any] | StreamingResponse:
        engine = state.ready()
        try:
            # Off the event loop: a long text takes a while to tokenise (encode_prompt bounds it).
            greq = await asyncio.to_thread(
                to_generate_request, req, state.tokenizer, engine.engine.max_seq_len
            )
        except PromptError as e:
            raise HTTPException(400, str(e)) from None
        out = await openai_call(req, greq, "prompt")
        if isinstance(out, StreamingResponse):
            return out
        return to_completion(req, out, state.tokenizer, service.cfg.run.name, greq.input_ids)

    async def chat(req: ChatCompletionRequest, prompt_field: str) -> dict[str, Any] | StreamingResponse:
        engine = state.ready()
        try:
            greq = await asyncio.to_thread(
                to_chat_generate_request, req, state.chat_template, state.tokenizer, engine.engine.max_seq_len
            )
            name = forced_call(req)
        except PromptError as e:
            raise HTTPException(400, str(e)) from None
        forced = "" if name is None else forced_call_text(name)
        out = await openai_call(req, greq, prompt_field, forced)
        if isinstance(out, StreamingResponse):
            return out
        return to_chat_completion(req, out, state.tokenizer, service.cfg.run.name, greq.input_ids, forced)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(req: ChatCompletionRequest) -> dict[str, Any] | StreamingResponse:
        return await chat(req, "messages")

    @app.post("/v1/chat/completions/tokens", response_model=None)
    async def chat_completions_tokens(req: ChatCompletionTokensRequest) -> dict[str, Any] | StreamingResponse:
        """A chat request whose prompt is `tokens` (ids), e.g. the previous turn's prompt and
        output ids plus the new messages' rendering: multi-turn without re-tokenising."""
        return await chat(req, "tokens")

    def model_card() -> dict[str, Any]:
        eng = state.engine
        return {
            "id": service.cfg.run.name,
            "object": "model",
            "created": int(service.started),
            "owned_by": "relay",
            "version": service.version,
            "root": str(eng.engine.model_dir) if eng else None,
            "max_model_len": eng.engine.max_seq_len if eng else None,
        }

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    def model(model_id: str) -> dict[str, Any]:
        card = model_card()
        if model_id != card["id"]:
            raise HTTPException(
                404, f"model_id: unknown model {model_id!r}; this replica serves {card['id']!r}"
            )
        return card

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    def tokenize_route(req: TokenizeRequest) -> TokenizeResponse:
        engine = state.loaded()
        try:
            return tokenize(req, state.tokenizer, state.chat_template, engine.engine.max_seq_len)
        except PromptError as e:
            raise HTTPException(400, str(e)) from None

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    def detokenize_route(req: DetokenizeRequest) -> DetokenizeResponse:
        engine = state.loaded()
        try:
            return detokenize(req, state.tokenizer, engine.engine.model_config.vocab_size)
        except PromptError as e:
            raise HTTPException(400, str(e)) from None

    add_update_weights_route(app, service, state.load, WeightsError)

    @app.post("/pause")
    async def pause() -> dict[str, Any]:
        state.paused = True
        if state.engine is not None:
            await asyncio.to_thread(state.engine.pause)  # returns once no step is in flight
        log_event(service.log, "paused")
        return {"paused": True, "version": service.version}

    @app.post("/resume")
    def resume() -> dict[str, Any]:
        state.paused = False
        if state.engine is not None:
            state.engine.resume()
        log_event(service.log, "resumed")
        return {"paused": False, "version": service.version}

    return app


def main() -> None:
    _args, service = start_service("decode", "relay decode service: one inference engine replica")
    service.run(build_app(service))
