"""What every request passes before it reaches a route: the run token and a body size limit.

`Gate` is an ASGI middleware on every relay service (services/common/service.py adds it). It finds
the route a request is for, then
- answers 401 unless the request carries `Authorization: Bearer <run token>` or the route is one
  the service declared open (read-only status, metrics, health, the API docs); a path no route
  serves is treated as protected, so nothing about it is told to a client without the token;
- answers 413 when the body is over the route's limit: at once from Content-Length, or as soon as
  a streamed body passes it, so an oversized body is never held in memory.

Routes are named "METHOD /path/template" (e.g. "POST /v1/sessions/{session_id}/exec"), the same
form `open_routes` and `body_limits` use; HEAD counts as GET.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from typing import Any, NamedTuple

from fastapi import FastAPI, HTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.auth import check_bearer

# Open on every service: liveness, Prometheus scrapes, the API docs.
ALWAYS_OPEN = frozenset(
    {
        "GET /health",
        "GET /metrics",
        "GET /openapi.json",
        "GET /docs",
        "GET /docs/oauth2-redirect",
        "GET /redoc",
    }
)
SCHEME = "bearerAuth"
CONVERTER = re.compile(r"\{([^}:]+):[^}]+\}")


class BodyLimit(NamedTuple):
    bytes: int
    setting: str  # what sets it, named in the 413


# Control routes (pause, weights, sessions); services name their data routes' limits.
CONTROL_BODY_LIMIT = BodyLimit(64 << 10, "the limit of control routes")


class BodyTooLarge(HTTPException):
    """An HTTPException, so FastAPI's body reader lets it through as the 413 it is."""

    def __init__(self, size: str, limit: BodyLimit):
        super().__init__(413, f"body: {size} bytes is over {limit.bytes} ({limit.setting})")


def route_key(app: FastAPI, scope: Scope) -> str | None:
    """'METHOD /template' of the route serving this request, as the OpenAPI document writes the
    path ("/v1/models/{model_id}", without a converter); None when no route matches."""
    method = "GET" if scope["method"] == "HEAD" else scope["method"]
    for route in app.router.routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            path = CONVERTER.sub(r"{\1}", getattr(route, "path", scope["path"]))
            return f"{method} {path}"
    return None


class Gate:
    def __init__(
        self,
        app: ASGIApp,
        api: FastAPI,
        token: str,
        open_routes: Collection[str],
        body_limits: Mapping[str, BodyLimit],
    ):
        self.app, self.api, self.token = app, api, token
        self.open = ALWAYS_OPEN | frozenset(open_routes)
        self.limits = dict(body_limits)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key = route_key(self.api, scope)
        headers = dict(scope["headers"])
        if key not in self.open:
            auth = headers.get(b"authorization", b"").decode("latin-1")
            if not check_bearer(auth, self.token):
                await _reply(
                    send,
                    401,
                    "authorization: a bearer token (the run's RELAY_TOKEN) is required",
                    bearer=True,
                )
                return
        limit = self.limits.get(key or "", CONTROL_BODY_LIMIT)
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit.bytes:
            await _reply(send, 413, BodyTooLarge(declared.decode(), limit).detail)
            return
        seen = 0

        async def bounded() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit.bytes:
                    raise BodyTooLarge(f"over {seen}", limit)
            return msg

        await self.app(scope, bounded, send)


async def _reply(send: Send, status: int, detail: str, bearer: bool = False) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if bearer:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _error(description: str) -> dict[str, Any]:
    detail = {"anyOf": [{"type": "string"}, {"type": "array"}, {"type": "object"}]}
    schema = {"type": "object", "properties": {"detail": detail}, "required": ["detail"]}
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def document_security(app: FastAPI, open_routes: Collection[str]) -> None:
    """Declare the bearer scheme in the OpenAPI document (the docs' Authorize button; clients
    generated from it send the token) on every operation that needs it."""
    open_ = ALWAYS_OPEN | frozenset(open_routes)
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        comps = schema.setdefault("components", {})
        comps.setdefault("securitySchemes", {})[SCHEME] = {"type": "http", "scheme": "bearer"}
        for path, ops in schema.get("paths", {}).items():
            for method, op in ops.items():
                if f"{method.upper()} {path}" not in open_:
                    op["security"] = [{SCHEME: []}]
                    op.setdefault("responses", {}).setdefault("401", _error("no or wrong bearer token"))
                op.setdefault("responses", {}).setdefault(
                    "4XX", _error("the request cannot be served as sent; `detail` says why")
                )
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
