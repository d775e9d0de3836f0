"""A real decode service process (`python -m services.decode`) on CPU for HTTP tests, and the
small polling / SSE helpers the tests that talk to it share."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from helpers.service_process import start_service
from services.common.auth import auth_headers
from services.common.bus import Bus
from services.common.config import EngineConfig, ModelConfig, ParallelConfig, RunConfig
from services.common.schemas import WeightsInfo

T = TypeVar("T")


@dataclass
class Server:
    url: str
    model_dir: Path
    bus: Bus
    cfg: RunConfig
    proc: subprocess.Popen[bytes]
    log: Path


def wait_for(check: Callable[[], T], timeout_s: float = 60.0, what: str = "condition") -> T:
    """Poll `check` until it returns something truthy (an HTTP error counts as not yet)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = check()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


@contextmanager
def decode_server(
    redis_url: str,
    model_dir: Path,
    model: ModelConfig,
    tmp: Path,
    *,
    prefix: str,
    max_seq_len: int,
    max_batch_size: int = 8,
    run_name: str | None = None,
    publish: bool = True,
    parallel: ParallelConfig | None = None,
    configure: Callable[[RunConfig], None] | None = None,
) -> Iterator[Server]:
    """Publish `model_dir` as weights version 0 under a fresh `<prefix>-<hex>` Redis prefix, start
    a decode process on it, wait until it is registered and has loaded the weights, and yield it;
    the process is terminated on exit (killed if it does not stop within 20 s). `parallel`: the
    engine's decode.parallel (its rank 0 in the process, the other ranks its children). With
    `publish=False` nothing is published and it is yielded once registered, still waiting for
    its first weights (the caller publishes them). `configure` edits the run config last."""
    cfg = RunConfig(model=model)
    cfg.redis.prefix = f"{prefix}-{uuid.uuid4().hex[:8]}"
    cfg.redis.heartbeat_s = 0.2
    cfg.decode.engine = EngineConfig(device="cpu", max_batch_size=max_batch_size, max_seq_len=max_seq_len)
    if parallel is not None:  # an engine over several ranks (worker processes of the service)
        cfg.decode.parallel = parallel
    if run_name is not None:
        cfg.run.name = run_name
    if configure is not None:
        configure(cfg)
    (tmp / "config.json").write_text(cfg.dump())
    bus = Bus(redis_url, cfg.redis.prefix)
    if publish:
        bus.publish_weights(WeightsInfo(version=0, path=str(model_dir)))
    log = tmp / "decode.log"
    proc = start_service("services.decode", tmp / "config.json", redis_url, log)

    def alive(check: Callable[[], T]) -> Callable[[], T]:
        # a decode that exited (e.g. rejected its config) fails the wait at once, with its log
        def checked() -> T:
            if proc.poll() is not None:
                raise RuntimeError(f"decode exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            return check()

        return checked

    try:
        info = wait_for(alive(lambda: bus.services("decode")), what=f"decode registration (log: {log})")[0]
        if publish:
            wait_for(
                alive(lambda: httpx.get(f"{info.url}/health").json()["status"] == "ok"),
                what=f"weights (log: {log})",
            )
        yield Server(info.url, model_dir, bus, cfg, proc, log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def sse_events(url: str, body: dict[str, Any]) -> list[Any]:
    """POST `body` with stream=true to `url`; the parsed `data:` events of the SSE response,
    checking the content type and the single [DONE] terminator (which is not returned)."""
    events: list[Any] = []
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60, headers=auth_headers()) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            payload = line.removeprefix("data: ")
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events and events[-1] == "[DONE]" and events.count("[DONE]") == 1
    return events[:-1]
