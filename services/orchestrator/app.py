"""Orchestrator HTTP API (OpenAPI docs at /docs): status, metrics history, pause/resume and
rollout transcripts. The rollout loop runs in the same event loop as the API."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Query

from services.common.schemas import PauseRequest, RolloutGroup
from services.common.service import Service, create_app, start_service
from services.common.tokenizer import load_tokenizer
from services.orchestrator.loop import Orchestrator
from services.orchestrator.rollout import render_sample


def build_app(svc: Service, orch: Orchestrator) -> FastAPI:
    orch.on_version = lambda v: setattr(svc, "version", v)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async with svc.registered():
            task = asyncio.create_task(orch.run(), name="orchestrator")
            try:
                yield
            finally:
                await orch.shutdown()
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    app = create_app("relay orchestrator", lambda: {"version": orch.version, "paused": orch.paused}, lifespan)

    @app.get("/v1/status")
    async def status() -> dict[str, Any]:
        """Step, policy version, rollouts in flight, queue depth, last reward, live services."""
        return await orch.status()

    @app.get("/v1/metrics")
    async def metrics(
        last: int = Query(0, ge=0, description="only the last N steps (0: all)"),
    ) -> list[dict[str, Any]]:
        """Per-step history: trainer metrics merged with the orchestrator's view."""
        return orch.history[-last:] if last else orch.history

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

    @app.get("/v1/rollouts/{rollout_id}")
    async def rollout(rollout_id: str) -> dict[str, Any]:
        """A group (by group id) or one sample (`<group_id>.<i>`): tokens, masks, text, rewards;
        `segments` splits each sample into prompt / model / env pieces with their text, and for model
        pieces the log-probs, weight versions and (token credit) each token's advantage."""
        group_id, _, idx = rollout_id.partition(".")
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
        if idx:
            if not idx.isdigit() or int(idx) >= len(samples):
                raise HTTPException(404, f"rollout_id: group {group_id} has no sample {idx!r}")
            samples = [samples[int(idx)]]
        return {
            "group_id": group.group_id,
            "env": group.env,
            "seed": group.seed,
            "samples": [
                {**s.model_dump(), "segments": render_sample(s, tok), "min_version": s.min_version}
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
