"""What every relay HTTP service shares: the FastAPI app with /health and /metrics, the run token
and body size limits on every route (services/common/gate.py), 4xx errors that name the bad field,
structured logs, the registry heartbeat, and graceful SIGTERM shutdown (uvicorn drains in-flight
requests, then the lifespan exit deregisters the service).

/health is what the supervisor's liveness probe reads: 200 while the service works, 503 (with
the reason) once a background task it cannot work without has died (`Service.watch`), so a
service never goes on answering "ok" around a dead loop."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import redis
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from services.common.auth import AuthError, token_from_env
from services.common.bus import Bus, Heartbeat, service_id
from services.common.config import ConfigError, EngineConfig, RunConfig, load_resolved
from services.common.gate import BodyLimit, Gate, document_security
from services.common.net import bind_socket
from services.common.schemas import ServiceInfo, UpdateWeightsRequest
from services.common.weights_gate import UpdateRefused, check_update

T = TypeVar("T")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        extra = getattr(record, "fields", None)
        if extra:
            out.update(extra)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(name: str) -> logging.Logger:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("RELAY_LOG_LEVEL", "INFO"))
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    return logging.getLogger(name)


def log_event(logger: logging.Logger, msg: str, **fields: Any) -> None:
    logger.info(msg, extra={"fields": fields})


def describe_errors(errors: list[dict[str, Any]]) -> str:
    parts = []
    for e in errors:
        loc = [str(p) for p in e.get("loc", ())]
        if loc and loc[0] in ("body", "query", "path", "header"):
            loc = loc[1:]  # where the field is, not part of its name (a field may be called "path")
        parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg')}")
    return "; ".join(parts)


# An echoed input longer than this (as JSON) is summarised, not sent back whole.
ECHO_LIMIT = 2048


def jsonable(x: Any) -> Any:
    """`x` as plain JSON: non-finite floats (a client may send NaN or Infinity) and anything
    else JSON cannot carry become strings."""
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if x is None or isinstance(x, str | int | bool):
        return x
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple | set | frozenset):
        return [jsonable(v) for v in x]
    if isinstance(x, bytes):
        return x.decode("utf-8", errors="replace")
    return str(x)


def _echo(value: Any) -> Any:
    out = jsonable(value)
    size = len(json.dumps(out))
    return out if size <= ECHO_LIMIT else f"<{size} bytes of input, not echoed>"


async def _validation_error(_req: Request, exc: RequestValidationError) -> JSONResponse:
    errors = [jsonable({**e, "input": _echo(e["input"])} if "input" in e else e) for e in exc.errors()]
    return JSONResponse(status_code=422, content={"detail": describe_errors(errors), "errors": errors})


# What a 422 from `_validation_error` looks like, for the OpenAPI documents.
VALIDATION_ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "detail": {"type": "string", "description": "every bad field: `field.path: message; ...`"},
        "errors": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "loc": {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "integer"}]}},
                    "msg": {"type": "string"},
                    "type": {"type": "string"},
                },
                "required": ["loc", "msg", "type"],
            },
        },
    },
    # `errors` comes with body, query and path validation; a handler's own 422 has `detail` only
    "required": ["detail"],
}


def document_validation_errors(app: FastAPI) -> None:
    """The OpenAPI documents describe the 422s this module sends, not FastAPI's default shape."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        schema.setdefault("components", {}).setdefault("schemas", {})["RelayValidationError"] = (
            VALIDATION_ERROR_SCHEMA
        )
        ref = {"$ref": "#/components/schemas/RelayValidationError"}
        for ops in schema.get("paths", {}).values():
            for op in ops.values():
                if "422" in op.get("responses", {}):
                    op["responses"]["422"]["content"] = {"application/json": {"schema": ref}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def token_body_limit(engine: EngineConfig, cap: BodyLimit) -> BodyLimit:
    """The body limit of a route that takes prompt token ids: a context's worth of ids as JSON
    (at most 12 bytes each) plus 1 MiB for the rest (sampling, stop strings), at most `cap`."""
    ids = engine.max_seq_len * 12 + (1 << 20)
    return cap if cap.bytes <= ids else BodyLimit(ids, "12 bytes per token of engine.max_seq_len + 1 MiB")


def create_app(
    title: str,
    health: Callable[[], dict[str, Any]],
    lifespan: Callable[[FastAPI], Any] | None = None,
    *,
    service: Service | None = None,
    token: str | None = None,
    open_routes: Collection[str] = (),
    body_limits: Mapping[str, BodyLimit] | None = None,
    failure: Callable[[], str] | None = None,
) -> FastAPI:
    """A service's app. Every route needs the run token (`token`, default the service's, else
    $RELAY_TOKEN) except /health, /metrics, the docs and `open_routes` ("GET /v1/status");
    bodies are limited by `body_limits["POST /v1/x"]`, else to 64 KiB (gate.py). /health answers
    {"status": "ok", kind, id, version} (from `service`) updated with what `health()` returns,
    or a 503 {"status": "failed", "reason"} while `failure()` (default `service.failure`) says
    why the service no longer works."""
    if failure is None:
        failure = service.failure if service is not None else lambda: ""
    app = FastAPI(title=title, lifespan=lifespan)
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    if token is None:
        token = service.token if service is not None else token_from_env()
    app.add_middleware(
        Gate,
        api=app,
        token=token,
        open_routes=open_routes,
        body_limits=body_limits or {},
    )
    document_security(app, open_routes)
    document_validation_errors(app)

    @app.get("/health", response_model=None)
    def _health() -> dict[str, Any] | JSONResponse:
        reason = failure()
        if reason:
            return JSONResponse(status_code=503, content={"status": "failed", "reason": reason})
        base: dict[str, Any] = {"status": "ok"}
        if service is not None:
            base.update(kind=service.kind, id=service.id, version=service.version)
        return {**base, **health()}

    @app.get("/metrics", response_class=PlainTextResponse)
    def _metrics() -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    return app


def service_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", required=True, help="resolved run config (RUN_DIR/config.json)")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", ""))
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--index", type=int, default=0, help="replica index")
    return p.parse_args()


class Service:
    """Runs one FastAPI app on a pre-bound socket and keeps it registered while it serves."""

    def __init__(
        self, kind: str, cfg: RunConfig, redis_url: str, host: str, port: int, run_dir: Path, index: int = 0
    ):
        self.kind = kind
        self.index = index  # the replica's index: its launcher name is <kind>.<index>
        self.cfg = cfg
        self.run_dir = run_dir  # where the launcher put config.json: RUN_DIR (weights/ is under it)
        self.sock = bind_socket(host, port)
        self.port = self.sock.getsockname()[1]
        advertise = host if host not in ("0.0.0.0", "") else socket.gethostname()
        self.url = f"http://{advertise}:{self.port}"
        self.id = service_id(kind, self.port)
        self.bus = Bus(redis_url, cfg.redis.prefix)
        self.token = token_from_env()
        self.started = time.time()
        self.version = -1
        self.log = setup_logging(kind)
        self.failed = ""  # why the service no longer works (a watched task died): /health says so

    def failure(self) -> str:
        return self.failed

    def watch(
        self, task: asyncio.Task[Any], what: str, ended_ok: Callable[[], bool] = lambda: False
    ) -> asyncio.Task[Any]:
        """`task` is one the service cannot work without: if it raises, or returns while
        `ended_ok()` is false, /health turns 503 naming it (the supervisor's probe then restarts
        the process). Cancelling it (shutdown) is not a failure."""

        def done(t: asyncio.Task[Any]) -> None:
            if t.cancelled():
                return
            err = t.exception()
            if err is None and ended_ok():
                return
            self.failed = f"{what} died: {type(err).__name__}: {err}" if err else f"{what} ended"
            self.log.error(self.failed, exc_info=err)

        task.add_done_callback(done)
        return task

    def info(self) -> ServiceInfo:
        return ServiceInfo(
            kind=self.kind,
            id=self.id,
            url=self.url,
            version=self.version,
            started=self.started,
            host=socket.gethostname(),
            pid=os.getpid(),
        )

    @asynccontextmanager
    async def registered(self) -> AsyncIterator[None]:
        hb = Heartbeat(self.bus, self.info, self.cfg.redis.heartbeat_s, self.cfg.redis.ttl_s).start()
        log_event(self.log, "registered", kind=self.kind, id=self.id, url=self.url)
        try:
            yield
        finally:
            hb.stop()
            log_event(self.log, "deregistered", kind=self.kind, id=self.id)

    def run(self, app: FastAPI) -> None:
        log_event(self.log, "config", config=json.loads(self.cfg.dump()), url=self.url)
        config = uvicorn.Config(app, log_config=None, timeout_graceful_shutdown=10, access_log=False)
        # uvicorn drains on SIGTERM, then re-raises the signal under the handler it found at
        # start; with the default handler the process would die by signal (-15) after a clean
        # shutdown. This handler turns that re-raise (or a SIGTERM before uvicorn takes over)
        # into exit 0.
        signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(0))
        uvicorn.Server(config).run(sockets=[self.sock])


def loaded(engine: T | None) -> T:
    """A service's engine, or the 503 (Retry-After) of a service still waiting for its first
    weights (decode, prefill)."""
    if engine is None:
        raise HTTPException(503, "loading: waiting for the first weights", headers={"Retry-After": "1"})
    return engine


async def authorize_update(service: Service, req: UpdateWeightsRequest) -> None:
    """POST /update_weights: 400 naming the field unless `req` is a version the trainer announced,
    its directory under this run's weights root (services/common/weights_gate.py); 503 while
    Redis cannot say."""
    try:
        await asyncio.to_thread(check_update, service.bus, service.run_dir, req.path, req.version)
    except UpdateRefused as e:
        log_event(service.log, "weights update refused", path=req.path, version=req.version, reason=str(e))
        raise HTTPException(400, str(e)) from None
    except redis.RedisError as e:
        raise HTTPException(
            503, f"cannot check the announced weights: {e}", headers={"Retry-After": "1"}
        ) from None


def add_update_weights_route(
    app: FastAPI,
    service: Service,
    load: Callable[[str, int], Awaitable[int]],
    refused: type[Exception],
) -> None:
    """POST /update_weights of a service that serves weights (decode, prefill): authorised as
    `authorize_update` says, then `load(path, version)`; a load raising `refused` (the directory
    cannot be served) is a 400 naming the path."""

    @app.post("/update_weights")
    async def update_weights(req: UpdateWeightsRequest) -> dict[str, Any]:
        await authorize_update(service, req)
        try:
            version = await load(req.path, req.version)
        except refused as e:
            raise HTTPException(400, f"path: {e}") from None
        return {"version": version, "path": req.path}


def load_service_config(args: argparse.Namespace) -> RunConfig:
    return load_resolved(args.config)


def start_service(kind: str, description: str) -> tuple[argparse.Namespace, Service]:
    """What every service's main() does first: parse its command line, read the resolved config
    (a bad one exits naming the key), check Redis is named, bind the port of `cfg.<kind>`."""
    args = service_args(description)
    try:
        cfg = load_service_config(args)
    except ConfigError as e:
        sys.exit(f"{kind}: {e}")
    redis_url = args.redis_url or cfg.redis.url
    if not redis_url:
        sys.exit(f"{kind}: no Redis URL; pass --redis-url or set REDIS_URL")
    try:
        token_from_env()
    except AuthError as e:
        sys.exit(f"{kind}: {e}")
    sec = getattr(cfg, kind)
    host = args.host or sec.host
    # Replicas on a fixed port get consecutive ports; port 0 lets each pick a free one.
    port = args.port if args.port is not None else (sec.port + args.index if sec.port else 0)
    return args, Service(kind, cfg, redis_url, host, port, Path(args.config).resolve().parent, args.index)
