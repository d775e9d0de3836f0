"""The run token on every service and the run's Redis password (services/common/auth.py, gate.py).

Each service's routes are enumerated from its own OpenAPI document, so a route added later is
checked too: without the token every route but the declared read-only ones answers 401, with it
none does. Also: a wrong token, the KV data plane's handshake, Redis refusing a client without
the password, and the run's secrets file (mode 0600, reused by a relaunch, credentials kept out of
the URL that is written anywhere)."""

from __future__ import annotations

import re
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.routing import Mount

from services.common.auth import (
    SECRETS_FILE,
    AuthError,
    auth_headers,
    bearer,
    ensure_run_secrets,
    load_run_secrets,
    split_redis_url,
    with_credentials,
)
from services.common.bus import Bus, connect
from services.common.config import RunConfig
from services.common.service import Service

# What each service serves without the token: read-only status, metrics, health and the docs.
DOCS = {
    "GET /health",
    "GET /metrics",
    "GET /openapi.json",
    "GET /docs",
    "GET /docs/oauth2-redirect",
    "GET /redoc",
}
OPEN = {
    "decode": DOCS | {"GET /v1/models", "GET /v1/models/{model_id}"},
    "prefill": DOCS,
    "kvstore": DOCS | {"GET /v1/stats", "GET /v1/dataplane"},
    "sandbox": DOCS | {"GET /v1/envs"},
    "orchestrator": DOCS
    | {"GET /v1/status", "GET /v1/metrics", "GET /dashboard", "GET /dashboard/static", "GET /v1/dashboard"},
}


def _service(kind: str, cfg: RunConfig, redis_url: str, run_dir: Path) -> Service:
    return Service(kind, cfg, redis_url, "127.0.0.1", 0, run_dir)


def build(kind: str, redis_url: str, tmp: Path) -> FastAPI:
    """The service's real app (routes, gate, handlers), not started: its lifespan (engine
    loading, registration) does not run, so routes that need it answer 503, not 401."""
    cfg = RunConfig()
    cfg.redis.prefix = f"test-auth-{uuid.uuid4().hex[:8]}"
    cfg.kvstore.enabled = kind in ("kvstore", "prefill")
    if kind == "decode":
        from services.decode.server import build_app

        return build_app(_service(kind, cfg, redis_url, tmp))
    if kind == "prefill":
        from services.prefill.server import build_app as build_prefill

        return build_prefill(_service(kind, cfg, redis_url, tmp))
    if kind == "kvstore":
        from services.kvstore.server import build_app as build_kv

        return build_kv(_service(kind, cfg, redis_url, tmp), tmp)
    if kind == "sandbox":
        from services.sandbox.server import build_app as build_sandbox

        return build_sandbox(cfg, _service(kind, cfg, redis_url, tmp))
    from services.orchestrator.app import build_app as build_orch
    from services.orchestrator.loop import Orchestrator

    svc = _service(kind, cfg, redis_url, tmp)
    return build_orch(svc, Orchestrator(cfg, svc.bus, tmp))


def routes(app: FastAPI) -> list[tuple[str, str]]:
    """(METHOD, path) of every operation in the app's OpenAPI document, and of every route the
    app serves outside it (the docs pages, pages left out of the schema, mounted directories)."""
    out = {(m.upper(), path) for path, ops in app.openapi()["paths"].items() for m in ops}
    for r in app.router.routes:
        path = re.sub(r"\{([^}:]+):[^}]+\}", r"{\1}", r.path)
        if isinstance(r, Mount):
            out.add(("GET", path))
        else:
            out |= {(m, path) for m in getattr(r, "methods", None) or () if m != "HEAD"}
    return sorted(out)


def concrete(path: str, app: FastAPI) -> str:
    """A URL the route answers: parameters filled in, a file name under a mounted directory."""
    mounted = any(isinstance(r, Mount) and r.path == path for r in app.router.routes)
    return re.sub(r"\{[^}]+\}", "x", path) + ("/x.js" if mounted else "")


@pytest.fixture(params=sorted(OPEN))
def app(request: pytest.FixtureRequest, redis_url: str, tmp_path: Path) -> Iterator[tuple[str, FastAPI]]:
    yield request.param, build(request.param, redis_url, tmp_path)


def test_every_route_needs_the_token_but_the_read_only_ones(app: tuple[str, FastAPI]) -> None:
    kind, api = app
    found = routes(api)
    assert len(found) > len(OPEN[kind]), f"{kind}: no protected route found in its OpenAPI document"
    client = TestClient(api, raise_server_exceptions=False)
    answered_without = set()
    for method, path in found:
        url = concrete(path, api)
        anon = client.request(method, url, json={})
        if anon.status_code != 401:
            answered_without.add(f"{method} {path}")
        else:
            assert anon.headers["www-authenticate"] == "Bearer"
            assert "bearer token" in anon.json()["detail"]
        wrong = client.request(method, url, json={}, headers=bearer("not-the-token" * 3))
        assert wrong.status_code == 401 or f"{method} {path}" in OPEN[kind], f"{kind} {method} {path}"
        ok = client.request(method, url, json={}, headers=auth_headers())
        assert ok.status_code != 401, f"{kind} {method} {path} refused the run token: {ok.text}"
    assert answered_without == OPEN[kind]
    # The document says so too: the docs' Authorize button and generated clients know the scheme.
    doc = api.openapi()
    assert doc["components"]["securitySchemes"]["bearerAuth"] == {"type": "http", "scheme": "bearer"}
    for path, ops in doc["paths"].items():
        for m, op in ops.items():
            assert ("security" in op) == (f"{m.upper()} {path}" not in OPEN[kind]), f"{m} {path}"


def test_unknown_paths_need_the_token_too(redis_url: str, tmp_path: Path) -> None:
    client = TestClient(build("sandbox", redis_url, tmp_path))
    assert client.get("/v1/nothing-here").status_code == 401
    assert client.get("/v1/nothing-here", headers=auth_headers()).status_code == 404


def test_kv_data_plane_refuses_a_connection_without_the_token() -> None:
    from services.kvstore.dataplane import DataPlaneConnection, DataPlaneError, DataPlaneServer
    from services.kvstore.tiers import MemoryTier, TieredStore

    store = TieredStore([MemoryTier(1 << 20)])
    server = DataPlaneServer(lambda: store, "127.0.0.1", 1 << 20).start()
    try:
        with pytest.raises(DataPlaneError, match="401: token"):
            DataPlaneConnection("127.0.0.1", server.port, 5.0, token="wrong" * 8)
        conn = DataPlaneConnection("127.0.0.1", server.port, 5.0)  # the run's token
        conn.close()
    finally:
        server.close()
        store.close()


def test_redis_refuses_a_client_without_the_password(redis_url: str) -> None:
    assert split_redis_url(redis_url)[2] == ""  # the URL the tests pass around names no password
    anon = redis.Redis.from_url(redis_url, socket_timeout=5)
    with pytest.raises(redis.RedisError, match="(?i)auth"):
        anon.ping()
    with pytest.raises(redis.RedisError, match="(?i)auth|pass"):
        anon.set("x", "1")
    assert connect(redis_url).ping()  # the password from the environment
    assert connect(redis_url).config_get("protected-mode") == {"protected-mode": "yes"}


def test_run_secrets_file(tmp_path: Path, redis_url: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    secrets, url = ensure_run_secrets(run)
    path = run / SECRETS_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert url == "" and secrets.redis_password == secrets.token  # the launcher's own Redis
    again, _ = ensure_run_secrets(run)
    assert again == secrets  # a relaunch on the same directory keeps them
    # A user-supplied URL with credentials: they go to the secrets file, not to what is written.
    user, _ = ensure_run_secrets(run, "redis://alice:s3cr%40t@db.example:6380/2")
    assert user.token == secrets.token and (user.redis_username, user.redis_password) == ("alice", "s3cr@t")
    assert _ == "redis://db.example:6380/2"
    assert with_credentials(_, user) == "redis://alice:s3cr%40t@db.example:6380/2"
    assert load_run_secrets(run) == user
    path.chmod(0o644)
    with pytest.raises(AuthError, match="chmod 600"):
        load_run_secrets(run)


def test_a_user_supplied_redis_url_with_credentials_works(redis_url: str) -> None:
    """What a run given `REDIS_URL=redis://:<password>@host:port/0` does: the URL's own password."""
    import os

    from services.common.auth import REDIS_PASSWORD_ENV

    public, _, _ = split_redis_url(redis_url)
    url = public.replace("redis://", f"redis://:{os.environ[REDIS_PASSWORD_ENV]}@")
    bus = Bus(url, f"test-auth-{uuid.uuid4().hex[:8]}")
    bus.r.set(bus.k.control_stop, "x")
    assert bus.r.get(bus.k.control_stop) == "x"
