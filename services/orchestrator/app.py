"""Orchestrator HTTP API (OpenAPI docs at /docs): status, metrics history, pause/resume and
rollout transcripts. The rollout loop runs in the same event loop as the API."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Query
from prometheus_client import REGISTRY

from services.common.schemas import PauseRequest, RolloutGroup
from services.common.service import Service, create_app, start_service
from services.common.tokenizer import load_tokenizer
from services.orchestrator import dashboard
from services.orchestrator.browse import RolloutQuery, list_rollouts
from services.orchestrator.loop import Orchestrator
from services.orchestrator.rollout import parse_rollout_id, render_sample


def build_app(svc: Service, orch: Orchestrator) -> FastAPI:
    orch.on_version = lambda v: setattr(svc, "version", v)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async with svc.registered():
            task = svc.watch(
                asyncio.create_task(orch.run(), name="orchestrator"), "rollout loop", lambda: orch.stopping
            )
            try:
                yield
            finally:
                await orch.shutdown()
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    app = create_app(
        "relay orchestrator",
        lambda: {"paused": orch.paused},
        lifespan,
        service=svc,
        # Read-only: status, the step history and the dashboard's page, scripts and chart spec. The
        # rollout browser's routes (transcripts: training data) need the token like the rest.
        open_routes={
            "GET /v1/status",
            "GET /v1/metrics",
            "GET /dashboard",
            "GET /dashboard/static",
            "GET /v1/dashboard",
        },
    )

    dashboard.mount(app, svc.cfg)
    REGISTRY.register(dashboard.DashboardCollector(svc.cfg, orch.bus, lambda: orch.history))

    @app.get("/v1/status")
    async def status() -> dict[str, Any]:
        """Step, policy version, rollouts in flight, queue depth, last reward, live services."""
        return await orch.status()

    @app.get("/v1/metrics")
    async def metrics(
        last: int = Query(0, ge=0, description="only the last N steps (0: all)"),
        after: int = Query(0, ge=0, description="only steps after this one (the dashboard's poll)"),
    ) -> list[dict[str, Any]]:
        """Per-step history: trainer metrics merged with the orchestrator's view."""
        hist = orch.history
        if after:
            # Steps are appended in order; a restarted trainer may repeat some, which stay.
            i = len(hist)
            while i > 0 and hist[i - 1]["step"] > after:
                i -= 1
            hist = hist[i:]
        return hist[-last:] if last else hist

    @app.post("/v1/pause")
    async def pause(body: PauseRequest | None = None) -> dict[str, Any]:
        """Stop starting new rollout groups; groups in flight finish. The run's time budget stops
        with it (the launcher does not count paused time). The pause is kept in Redis, so a
        restarted orchestrator stays paused."""
        return await orch.set_paused(True, body.reason if body else "")

    @app.post("/v1/resume")
    async def resume(body: PauseRequest | None = None) -> dict[str, Any]:
        """Start rollout groups again; the time budget runs again."""
        return await orch.set_paused(False, body.reason if body else "")

    @app.get("/v1/rollouts")
    async def rollouts(q: Annotated[RolloutQuery, Query()]) -> dict[str, Any]:
        """Recent rollout groups, newest first: id, task, mean reward, version (the oldest weights
        that generated it), staleness when trained, length, and whether it was trained, dropped
        (with the reason) or is pending. Filter by task, status and version range; page with
        `limit` and the `next_cursor` of the previous page."""
        tasks = [t.env for t in orch.o.tasks]
        if q.task is not None and q.task not in tasks:
            raise HTTPException(422, f"task: unknown task {q.task!r} (this run's tasks: {', '.join(tasks)})")
        if q.version_min is not None and q.version_max is not None and q.version_max < q.version_min:
            raise HTTPException(422, f"version_max: {q.version_max} is below version_min {q.version_min}")
        return await asyncio.to_thread(list_rollouts, orch.bus, q)

    @app.get("/v1/rollouts/{rollout_id}")
    async def rollout(rollout_id: str) -> dict[str, Any]:
        """A group (by group id) or one sample (`<group_id>.<i>`): tokens, masks, text, rewards;
        `segments` splits each sample into its turns: prompt / model / env pieces with their text,
        and for model pieces each token's text, log-prob, weight version and advantage. `fate`: trained
        (at which trainer version), dropped (why) or pending."""
        try:
            group_id, idx = parse_rollout_id(rollout_id)
        except ValueError as e:
            raise HTTPException(422, f"rollout_id: {e}") from None
        raw = await asyncio.to_thread(orch.bus.r.get, orch.k.rollout(group_id))
        if raw is None:
            raise HTTPException(404, f"rollout_id: no finished rollout {rollout_id!r}")
        group = RolloutGroup.model_validate_json(raw)
        if orch.runner is not None:
            tok = orch.runner.tok
        else:  # not running yet (waiting for the first weights): the tokenizer ships with them
            latest = await asyncio.to_thread(orch.bus.latest_weights)
            if latest is None:
                raise HTTPException(503, "no weights published yet: the tokenizer is not known")
            tok = await asyncio.to_thread(load_tokenizer, latest.path)
        samples = group.samples
        if idx is not None:
            if idx >= len(samples):
                raise HTTPException(404, f"rollout_id: group {group_id} has no sample {idx}")
            samples = [samples[idx]]
        (fate,) = await asyncio.to_thread(orch.bus.fates, [group.group_id])
        return {
            "group_id": group.group_id,
            "env": group.env,
            "seed": group.seed,
            "reward": group.mean_reward,
            "min_version": group.min_version,
            "fate": fate.model_dump(),
            "samples": [
                {
                    **s.model_dump(exclude={"segments"}),
                    "segments": render_sample(s, tok),
                    "min_version": s.min_version,
                    # a trimmed episode's earlier parts (context_overflow = "trim_history")
                    "earlier_parts": [
                        {
                            "turns": seg.turns,
                            "trimmed_after_turn": seg.trimmed_after_turn,
                            "reason": seg.reason,
                            "segments": render_sample(part, tok),
                        }
                        for seg, part in zip(s.segments, s.parts(), strict=False)
                    ],
                }
                for s in samples
            ],
        }

    return app


def main() -> None:
    args, svc = start_service("orchestrator", "relay orchestrator")
    run_dir = Path(args.config).resolve().parent
    orch = Orchestrator(svc.cfg, svc.bus, run_dir)
    svc.run(build_app(svc, orch))


if __name__ == "__main__":
    main()
