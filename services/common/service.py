"""What every relay HTTP service shares: the FastAPI app with /health and /metrics, 4xx errors
that name the bad field, structured logs, the registry heartbeat, and graceful SIGTERM shutdown
(uvicorn drains in-flight requests, then the lifespan exit deregisters the service)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from services.common.bus import Bus, Heartbeat, service_id
from services.common.config import ConfigError, RunConfig, load_resolved
from services.common.net import bind_socket
from services.common.schemas import ServiceInfo


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
        loc = [str(p) for p in e.get("loc", ()) if p not in ("body", "query", "path")]
        parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg')}")
    return "; ".join(parts)


async def _validation_error(_req: Request, exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    return JSONResponse(
        status_code=422,
        content={"detail": describe_errors(errors), "errors": json.loads(json.dumps(errors, default=str))},
    )


def create_app(
    title: str,
    health: Callable[[], dict[str, Any]],
    lifespan: Callable[[FastAPI], Any] | None = None,
) -> FastAPI:
    app = FastAPI(title=title, lifespan=lifespan)
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]

    @app.get("/health")
    def _health() -> dict[str, Any]:
        return {"status": "ok", **health()}

    @app.get("/metrics")
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

    def __init__(self, kind: str, cfg: RunConfig, redis_url: str, host: str, port: int):
        self.kind = kind
        self.cfg = cfg
        self.sock = bind_socket(host, port)
        self.port = self.sock.getsockname()[1]
        advertise = host if host not in ("0.0.0.0", "") else socket.gethostname()
        self.url = f"http://{advertise}:{self.port}"
        self.id = service_id(kind, self.port)
        self.bus = Bus(redis_url, cfg.redis.prefix)
        self.started = time.time()
        self.version = -1
        self.log = setup_logging(kind)

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
    sec = getattr(cfg, kind)
    host = args.host or sec.host
    # Replicas on a fixed port get consecutive ports; port 0 lets each pick a free one.
    port = args.port if args.port is not None else (sec.port + args.index if sec.port else 0)
    return args, Service(kind, cfg, redis_url, host, port)
