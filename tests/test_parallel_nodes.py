"""A decode engine over two nodes, on one host, laid out as the Slurm launcher lays out a replica
that spans nodes (slurm.decode.nodes 2, decode.replicas 1, tp 2): the service is rank 0 on "node
0", a node host (`python -m services.engine.parallel.node --node 1`) runs rank 1, and they meet at
the rendezvous rank 0 publishes in Redis. It answers as the 1-rank engine does; when rank 1 dies
the service reports it on /health and exits 1, and a restarted service forms a new group that the
same node host joins."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.debug_weights import spread_debug_versions
from helpers.decode_server import decode_server, wait_for
from helpers.parallel import worker_pids
from helpers.service_process import start_service

from services.common.auth import auth_headers
from services.common.config import CONFIG_DIR, REPO_ROOT, EngineConfig, ParallelConfig, RunConfig, load_config
from services.common.schemas import GenerateRequest, WeightsInfo
from services.engine import LLMEngine

# full: two engine starts (about 25 s of CPU); the rendering of this layout is in test_slurm.py.
pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="gloo process groups and /proc: Linux"),
    pytest.mark.full,
]

TOL = 1e-5


def two_nodes(cfg: RunConfig) -> None:
    cfg.slurm.launcher = "slurm"
    cfg.slurm.decode.nodes = 2  # one replica over both: engine_nodes("decode") == 2


def post(url: str, body: object) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/generate", json=body, timeout=60, headers=auth_headers())
    assert r.status_code == 200, r.text
    return r.json()


BODIES = [
    {"input_ids": [5, 6, 7, 8], "sampling": {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}},
    {
        "input_ids": [9, 10],
        "sampling": {"seed": 5, "n": 2, "max_tokens": 10, "ignore_eos": True, "logprobs": 2},
    },
]


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for x, y in zip(a["choices"], b["choices"], strict=True):
        assert x["output_ids"] == y["output_ids"]
        assert max(abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"], strict=True)) <= TOL


def reference(model_dir: Path) -> list[dict[str, Any]]:
    """BODIES on the single-rank engine in this process."""
    engine = LLMEngine(model_dir, EngineConfig(device="cpu", max_batch_size=8, max_seq_len=256))
    return [engine.generate([GenerateRequest.model_validate(b)])[0].model_dump() for b in BODIES]


def test_an_engine_over_two_nodes(redis_url: str, tmp_path: Path) -> None:
    run = tmp_path / "two"
    run.mkdir()
    v0 = spread_debug_versions(run / "weights")[0]
    want = reference(v0)
    m = load_config(CONFIG_DIR / "debug.toml").model
    par = ParallelConfig(tp=2)
    with decode_server(
        redis_url,
        v0,
        m,
        run,
        prefix="test-nodes2",
        max_seq_len=256,
        parallel=par,
        configure=two_nodes,
        publish=False,
    ) as two:
        argv = [
            sys.executable, "-m", "services.engine.parallel.node", "--config", str(run / "config.json"),
            "--redis-url", redis_url, "--role", "decode", "--index", "0", "--node", "1",
        ]  # fmt: skip
        with open(run / "node1.log", "wb") as log:
            host = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            two.bus.publish_weights(WeightsInfo(version=0, path=str(v0)))
            wait_for(
                lambda: httpx.get(f"{two.url}/health").json()["status"] == "ok",
                what="2-node engine",
                timeout_s=180,
            )
            assert worker_pids(two.proc.pid) == []  # rank 1 is the node host's, not the service's
            [rank1] = worker_pids(host.pid)
            for body, expected in zip(BODIES, want, strict=True):
                same(expected, post(two.url, body))

            # Rank 1 dies mid-generation: its host stops beating the group, the service answers
            # the request and /health naming it, and exits 1.
            answers: list[httpx.Response] = []
            long = {"input_ids": [5, 6], "sampling": {"max_tokens": 240, "ignore_eos": True, "n": 4}}
            asker = threading.Thread(
                target=lambda: answers.append(
                    httpx.post(f"{two.url}/v1/generate", json=long, timeout=120, headers=auth_headers())
                )
            )
            asker.start()
            wait_for(lambda: httpx.get(f"{two.url}/health").json().get("running", 0) > 0, what="generation")
            t0 = time.monotonic()
            os.kill(rank1, signal.SIGKILL)
            reasons: list[str] = []
            while two.proc.poll() is None:
                try:
                    r = httpx.get(f"{two.url}/health", timeout=5)
                    if r.status_code == 503:
                        reasons.append(r.json()["reason"])
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
            assert two.proc.returncode == 1 and time.monotonic() - t0 < 20
            why = "engine ranks failed: rank 1 on node 1 stopped (its host's beat ended)"
            assert reasons and reasons[0] == why, reasons
            asker.join(30)
            assert [(a.status_code, a.json()["detail"]) for a in answers] == [(503, why)]

            # The supervisor's restart, by hand: a new group, and the same node host joins it.
            again = start_service("services.decode", run / "config.json", redis_url, run / "decode2.log")
            try:

                def restarted() -> str | None:
                    assert again.poll() is None, (run / "decode2.log").read_text()[-3000:]
                    urls = [s.url for s in two.bus.services("decode") if s.url != two.url]
                    ok = urls and httpx.get(f"{urls[0]}/health").json()["status"] == "ok"
                    return urls[0] if ok else None

                url = wait_for(restarted, what="the restarted 2-node engine", timeout_s=180)
                for body, expected in zip(BODIES, want, strict=True):
                    same(expected, post(url, body))
                assert host.poll() is None
            finally:
                again.terminate()
                assert again.wait(30) == 0
        finally:
            host.terminate()
            assert host.wait(30) == 0, (run / "node1.log").read_text()[-3000:]
    assert (run / "node1.log").read_text().count("joining decode.0 group") == 2
