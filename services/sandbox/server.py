"""The sandbox service: environment episodes over HTTP.

    python -m services.sandbox --config RUN_DIR/config.json --redis-url redis://...

GET  /v1/envs                        registered environments (name, max_turns, description)
POST /v1/sessions                    {"env", "seed"} -> {"session_id", "env", "prompt", "max_turns"}
POST /v1/sessions/batch              {"env", "seed", "n"} -> {"sessions": [...]} (a rollout group)
GET  /v1/sessions/{id}               turns, done, idle time (debugging)
POST /v1/sessions/{id}/step[?score=true[&credit=true]]  {"action", "eos"} -> {"observation", "done", "reward", "credit"}
POST /v1/sessions/{id}/score[?keep=true][&credit=true]  -> {"reward", "info", "credit"}; closes the session unless keep
DELETE /v1/sessions/{id}             close without scoring
POST /v1/sessions/{id}/exec          {"cmd", "timeout_s"} -> {exit_code, stdout, stderr, truncated, timed_out}
GET  /v1/sessions/{id}/files?path=P  -> {"path", "content", "truncated"} (404: no such file)
PUT  /v1/sessions/{id}/files         {"path", "content"} -> {"path", "bytes"} (413: over the disk quota)
GET  /health, GET /metrics           (services.common.service)

Handlers are plain `def`s: Starlette runs them on its threadpool, so a slow plugin environment
stalls only its own request; the built-in envs take microseconds, so the cost is the threadpool
hop. Sessions live in a SessionStore (sessions.py) swept for idle ones by a background task.
Commands and file access run under bubblewrap in the session's own directory (isolation.py);
the directory is created on first use (or at reset for envs with needs_workspace) and deleted
when the session ends. More than sandbox.max_concurrent_execs commands at once: 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import Counter, Gauge, Histogram
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from services.common.config import RunConfig
from services.common.gate import BodyLimit
from services.common.schemas import (
    MAX_PATH_CHARS,
    NO_NUL,
    CreateSessionRequest,
    CreateSessionResponse,
    CreateSessionsRequest,
    CreateSessionsResponse,
    ExecRequest,
    ExecResponse,
    FileResponse,
    ScoreResponse,
    SessionStep,
    StepRequest,
    StepResponse,
    StepResult,
    StepsRequest,
    VerifiersGroupRequest,
    VerifiersGroupResponse,
    WriteFileRequest,
)
from services.common.service import Service, create_app, log_event, start_service
from services.sandbox.envs import EnvError, env_names, get_env_class, load_plugins
from services.sandbox.isolation import WorkspaceManager, enable_subreaper, reap_orphans
from services.sandbox.sessions import (
    DiskQuotaExceeded,
    EnvFailed,
    ExecsFull,
    SandboxFull,
    SessionError,
    SessionStore,
)
from services.sandbox.verifiers_host import DecodeUnavailable, VerifiersError, VerifiersHost

# Module-level: prometheus_client's default registry allows one collector per name per process.
R = TypeVar("R")

SESSIONS_CREATED = Counter("relay_sandbox_sessions_created", "Sessions created", ["env"])
SESSIONS_EXPIRED = Counter("relay_sandbox_sessions_expired", "Sessions ended by the idle sweep", ["env"])
SESSIONS_CLOSED = Counter(
    "relay_sandbox_sessions_closed", "Sessions closed by score or DELETE", ["env", "how"]
)
SESSIONS_REJECTED = Counter("relay_sandbox_sessions_rejected", "Session creations refused (sandbox full)")
STEPS = Counter("relay_sandbox_steps", "Episode steps", ["env"])
ERRORS = Counter("relay_sandbox_env_errors", "Environment code raised or broke its contract", ["env"])
SESSIONS_OPEN = Gauge("relay_sandbox_sessions_open", "Sessions open now")
EXECS = Counter("relay_sandbox_execs", "Commands run through POST .../exec", ["outcome"])
EXEC_SECONDS = Histogram(
    "relay_sandbox_exec_seconds",
    "Wall time of POST .../exec commands",
    buckets=[0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300],
)
DISK_FULL = Counter(
    "relay_sandbox_disk_quota_full",
    "Commands that left /work at the session's disk quota, and file writes refused by it",
    ["via"],
)
REWARD = Histogram(
    "relay_sandbox_reward", "Episode rewards at score time", ["env"], buckets=[i / 10 for i in range(11)]
)


class NDJSONResponse(StreamingResponse):
    """A stream of JSON lines: its media type is what the OpenAPI document states for the route."""

    media_type = "application/x-ndjson"


def env_catalog() -> list[dict[str, Any]]:
    out = []
    for name in env_names():
        cls = get_env_class(name)
        out.append({"name": name, "max_turns": cls.max_turns, "description": cls.description})
    return out


def check_tasks(cfg: RunConfig) -> None:
    """Fail at start, not mid-run, when the orchestrator's tasks name an env nobody registered."""
    known = set(env_names())
    for i, task in enumerate(cfg.orchestrator.tasks):
        if task.verifiers is not None:
            if task.env in known:
                raise EnvError(
                    f"orchestrator.tasks[{i}].env = {task.env!r} names a registered environment; "
                    "a verifiers task needs a name of its own"
                )
            continue
        if task.env not in known:
            raise EnvError(
                f"orchestrator.tasks[{i}].env = {task.env!r} is not a registered environment "
                f"(known: {', '.join(sorted(known))}); add the module that registers it to sandbox.plugins"
            )


def build_app(
    cfg: RunConfig, service: Service | None = None, replica: int = 0, verifiers: VerifiersHost | None = None
) -> FastAPI:
    """`verifiers`: the run's verifiers environments, loaded (main() loads them before serving)."""
    sec = cfg.sandbox
    vf_host = verifiers if verifiers is not None else VerifiersHost()
    workspaces = WorkspaceManager.from_config(sec, replica)
    store = SessionStore(
        sec.max_sessions, sec.session_ttl_s, workspaces=workspaces, file_max_bytes=sec.file_max_bytes
    )
    # Sweep often enough that a session outlives its ttl by at most ~25%, but not busily.
    sweep_every = min(max(sec.session_ttl_s / 4, 0.05), 5.0)

    def sweep_once() -> None:
        reap_orphans()  # stragglers of finished commands (no-op unless enable_subreaper ran)
        gone = store.sweep()
        for s in gone:
            SESSIONS_EXPIRED.labels(s.env_name).inc()
        if gone:
            SESSIONS_OPEN.set(len(store))
            if service is not None:
                log_event(service.log, "sessions expired", count=len(gone), open=len(store))

    async def sweeper() -> None:
        while True:
            await asyncio.sleep(sweep_every)
            try:
                sweep_once()
            except Exception:  # a dead sweeper would leak every session from here on
                if service is not None:
                    service.log.exception("session sweep failed")

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            if service is not None:
                await stack.enter_async_context(service.registered())
                limits = await asyncio.to_thread(workspaces.setup_cgroups)
                log_event(
                    service.log,
                    "workspaces",
                    disk_quota_mb=sec.disk_quota_mb,
                    disk_quota_backend=sec.disk_quota_backend,
                    disk_quota_enforced=workspaces.quota_enforced,
                    session_limits=limits,
                )
                if sec.disk_quota_mb and not workspaces.quota_enforced:
                    service.log.warning(
                        "sandbox.disk_quota_mb is set but not enforced: mounting the per-session "
                        "filesystem needs root; session directories are plain directories"
                    )
                if workspaces.cgroups is None:
                    service.log.warning(f"per-session memory/process/CPU limits are off: {limits}")
            task = asyncio.create_task(sweeper(), name="session-sweeper")
            if service is not None:
                service.watch(task, "session sweeper")
            try:
                yield
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                store.close_all()
                workspaces.shutdown()

    def health() -> dict[str, Any]:
        return {
            **store.stats(),
            "envs": env_names(),
            "disk_quota_mb": sec.disk_quota_mb if workspaces.quota_enforced else 0,
            "disk_quota_backend": sec.disk_quota_backend,
            "session_limits": workspaces.cgroups.kind if workspaces.cgroups is not None else "rlimits only",
        }

    data = BodyLimit(sec.max_request_bytes, "sandbox.max_request_bytes")
    app = create_app(
        "relay sandbox",
        health,
        lifespan,
        service=service,
        open_routes={"GET /v1/envs"},
        body_limits={
            "POST /v1/sessions/{session_id}/step": data,
            "POST /v1/sessions/steps": data,
            "POST /v1/sessions/{session_id}/exec": data,
            "PUT /v1/sessions/{session_id}/files": data,
        },
    )
    app.state.store = store

    def count_failure(exc: SessionError) -> None:
        if isinstance(exc, EnvFailed):
            ERRORS.labels(exc.env).inc()
            if service is not None:
                service.log.error(exc.message)

    @app.exception_handler(SessionError)
    async def _session_error(_req: Request, exc: SessionError) -> JSONResponse:
        headers = {"Retry-After": "1"} if isinstance(exc, SandboxFull | ExecsFull) else None
        count_failure(exc)
        content: dict[str, Any] = {"detail": exc.message}
        field = getattr(exc, "field", None)
        if field:  # same shape as the 422s FastAPI produces for invalid bodies
            content["errors"] = [{"type": "value_error", "loc": ["body", field], "msg": exc.message}]
        return JSONResponse(status_code=exc.status, content=content, headers=headers)

    @app.get("/v1/envs")
    def list_envs() -> dict[str, list[dict[str, Any]]]:
        return {"envs": env_catalog() + [vf_host.describe(n) for n in vf_host.names()]}

    @app.post("/v1/verifiers/{env}/group")
    async def verifiers_group(env: str, req: VerifiersGroupRequest) -> VerifiersGroupResponse:
        """One group of a verifiers environment's rollouts against decode (verifiers_host.py)."""
        if env not in vf_host.envs:
            known = ", ".join(vf_host.names()) or "none"
            return JSONResponse(  # type: ignore[return-value]
                status_code=404, content={"detail": f"env: no verifiers environment {env!r}; loaded: {known}"}
            )
        try:
            out = await vf_host.run_group(env, req)
        except DecodeUnavailable as e:
            return JSONResponse(status_code=503, content={"detail": f"env {env!r}: {e}"})  # type: ignore[return-value]
        except VerifiersError as e:
            ERRORS.labels(env).inc()
            return JSONResponse(status_code=500, content={"detail": f"env {env!r}: {e}"})  # type: ignore[return-value]
        for r in out.rollouts:
            REWARD.labels(env).observe(r.reward)
        return out

    # Starts get their own threads (sandbox.session_start_threads): a start takes milliseconds,
    # but on the shared request threadpool it waits for a free thread, and under load every one
    # may be running a step that lasts a whole test suite: a start would wait for a suite to end.
    start_limiter = anyio.CapacityLimiter(sec.session_start_threads) if sec.session_start_threads else None

    async def off_loop(fn: Callable[..., R], *args: Any) -> R:
        if start_limiter is None:
            return await run_in_threadpool(fn, *args)
        return await anyio.to_thread.run_sync(fn, *args, limiter=start_limiter)

    @app.post("/v1/sessions")
    async def create_session(req: CreateSessionRequest) -> CreateSessionResponse:
        try:
            s, prompt = await off_loop(store.create, req.env, req.seed)
        except SandboxFull:
            SESSIONS_REJECTED.inc()
            raise
        SESSIONS_CREATED.labels(s.env_name).inc()
        SESSIONS_OPEN.set(len(store))
        return CreateSessionResponse(session_id=s.id, env=s.env_name, prompt=prompt, max_turns=s.max_turns)

    @app.post("/v1/sessions/batch")
    async def create_sessions(req: CreateSessionsRequest) -> CreateSessionsResponse:
        """n episodes of one task (a rollout group): one round trip instead of n. All or none:
        a 429 (no room for all n) or a failed start keeps none of them."""
        try:
            made = await off_loop(store.create_many, req.env, req.seed, req.n)
        except SandboxFull:
            SESSIONS_REJECTED.inc()
            raise
        SESSIONS_CREATED.labels(req.env).inc(len(made))
        SESSIONS_OPEN.set(len(store))
        return CreateSessionsResponse(
            sessions=[
                CreateSessionResponse(session_id=s.id, env=s.env_name, prompt=p, max_turns=s.max_turns)
                for s, p in made
            ]
        )

    @app.get("/v1/sessions/{session_id}")
    def get_session(session_id: str) -> dict[str, Any]:
        return store.get(session_id)

    @app.post("/v1/sessions/{session_id}/step")
    def step(
        session_id: str,
        req: StepRequest,
        score: bool = Query(False, description="if the step ends the episode, score and close it too"),
        credit: bool = Query(False, description="with score: include the env's per-character credit"),
    ) -> StepResponse:
        s, observation, done = store.step(session_id, req.action, req.eos)
        STEPS.labels(s.env_name).inc()
        if score and done:
            scored = score_session(session_id, False, credit)
            return StepResponse(
                observation=observation, done=done, reward=scored.reward, credit=scored.credit
            )
        return StepResponse(observation=observation, done=done)

    @app.post(
        "/v1/sessions/steps",
        response_class=NDJSONResponse,
        responses={200: {"model": StepResult, "description": "one StepResult per line, as the steps finish"}},
    )
    async def step_many(
        req: StepsRequest,
        score: bool = Query(False, description="score and close each session its step ends"),
        credit: bool = Query(False, description="with score: include the env's per-character credit"),
    ) -> StreamingResponse:
        """Several sessions' steps in one round trip (a group's turn: the orchestrator batches
        the steps its samples send together). The steps run concurrently, as separate calls would,
        and each result is streamed as soon as its step is done (one JSON line, a StepResult with
        its index `i`), so a slow step does not hold the others back. A result is the step's
        response, or the status and detail its own call would have got."""

        def one(i: int, item: SessionStep) -> StepResult:
            try:
                out = step(item.session_id, StepRequest(action=item.action, eos=item.eos), score, credit)
            except SessionError as e:
                count_failure(e)
                return StepResult(i=i, status=e.status, detail=e.message)
            return StepResult(i=i, response=out)

        async def results() -> AsyncIterator[bytes]:
            pending = [asyncio.ensure_future(run_in_threadpool(one, i, x)) for i, x in enumerate(req.steps)]
            for done in asyncio.as_completed(pending):
                yield (await done).model_dump_json().encode() + b"\n"

        return NDJSONResponse(results())

    @app.post("/v1/sessions/{session_id}/score")
    def score_session(
        session_id: str,
        keep: bool = Query(False, description="leave the session open after scoring"),
        credit: bool = Query(False, description="include the env's per-character credit (token credit)"),
    ) -> ScoreResponse:
        s, reward, info, chars = store.score(session_id, keep, credit)
        REWARD.labels(s.env_name).observe(reward)
        if not keep:
            SESSIONS_CLOSED.labels(s.env_name, "score").inc()
            SESSIONS_OPEN.set(len(store))
        info = {"turns": s.turns, "done": s.done, **info}
        return ScoreResponse(reward=reward, info=info, credit=chars)

    @app.delete("/v1/sessions/{session_id}")
    def delete_session(session_id: str) -> dict[str, Any]:
        s = store.delete(session_id)
        SESSIONS_CLOSED.labels(s.env_name, "delete").inc()
        SESSIONS_OPEN.set(len(store))
        return {"session_id": s.id, "closed": True}

    @app.post("/v1/sessions/{session_id}/exec")
    def exec_command(session_id: str, req: ExecRequest) -> ExecResponse:
        try:
            r = store.exec(session_id, req.cmd, req.timeout_s)
        except ExecsFull:
            EXECS.labels("busy").inc()
            raise
        EXECS.labels("timed_out" if r.timed_out else "ok" if r.exit_code == 0 else "nonzero").inc()
        if r.disk_full:
            DISK_FULL.labels("exec").inc()
        EXEC_SECONDS.observe(r.duration_s)
        return ExecResponse(**r.as_dict())

    @app.get("/v1/sessions/{session_id}/files")
    def read_file(
        session_id: str,
        path: str = Query(
            ..., min_length=1, max_length=MAX_PATH_CHARS, pattern=NO_NUL, description="relative to /work"
        ),
    ) -> FileResponse:
        content, truncated = store.read_file(session_id, path)
        return FileResponse(path=path, content=content, truncated=truncated, bytes=len(content.encode()))

    @app.put("/v1/sessions/{session_id}/files")
    def write_file(session_id: str, req: WriteFileRequest) -> FileResponse:
        try:
            n = store.write_file(session_id, req.path, req.content)
        except DiskQuotaExceeded:
            DISK_FULL.labels("write_file").inc()
            raise
        return FileResponse(path=req.path, bytes=n)

    return app


def main() -> None:
    args, svc = start_service("sandbox", "relay sandbox: environment episodes over HTTP")
    cfg, sec = svc.cfg, svc.cfg.sandbox
    try:
        load_plugins(sec.plugins)
        check_tasks(cfg)
        vf_host = VerifiersHost.from_tasks(cfg.orchestrator.tasks)
    except (EnvError, VerifiersError) as e:
        svc.log.error(str(e))
        svc.sock.close()
        sys.exit(2)
    log_event(
        svc.log,
        "environments",
        envs=env_names(),
        verifiers=vf_host.names(),
        plugins=sec.plugins,
        subreaper=enable_subreaper(),
    )
    svc.run(build_app(cfg, svc, replica=args.index, verifiers=vf_host))


if __name__ == "__main__":
    main()
