"""A prefill service whose engine spans 2 ranks (prefill.parallel.tp = 2: the service is rank 0
and the HTTP front, rank 1 its worker process) in front of a 1-rank decode, every piece a real
process (Redis, the KV store gateway, the services), on the debug model (2 KV heads: one per
rank). The prefill's exported pages are whole (each rank's KV head gathered into the single-rank
page layout): the decode takes every prompt page from it (the same-host handoff and the store)
and continues exactly as a colocated 1-rank engine generates, tokens equal and log-probs to 1e-5;
a second turn's prefill pulls the pages the decode published (each rank taking its KV head);
after a weight update both ranks serve the new version; a killed rank ends the service (503, exit 1)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from helpers.parallel import worker_pids
from test_prefill_service import (
    P1,
    Cluster,
    check_disaggregated_equals_colocated,
    colocated,
    generate,
    req,
    running_cluster,
    same,
    wait_published,
)

from services.common.auth import auth_headers
from services.common.config import ParallelConfig
from services.common.schemas import WeightsInfo
from services.kvstore.router import DISCOVERY_TTL_S

pytestmark = pytest.mark.slow  # four processes (gateway, 2 prefill ranks, decode) on two cores


@pytest.fixture(scope="module")
def cluster(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(redis_url, tmp_path_factory.mktemp("par-prefill"), ParallelConfig(tp=2)) as c:
        yield c


def test_two_rank_prefill_pages_continue_like_one_rank(cluster: Cluster) -> None:
    """The 1-rank prefill's test, word for word: the decode takes every prompt page from the 2
    ranks' whole pages and generates what a colocated 1-rank engine generates."""
    check_disaggregated_equals_colocated(cluster)


def test_two_rank_prefill_pulls_what_the_decode_published(cluster: Cluster) -> None:
    """A second turn: the decode published the 2 pages it filled while generating turn 1; the
    2-rank prefill pulls them from the store (each rank writing its KV head of them), reuses its
    own 7 from turn 1, and the decode's continuation is still the colocated one."""
    c = cluster
    turn1 = req([(7 * i + 5) % 60 for i in range(30)], temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    out1 = generate(c, turn1)
    history = turn1.input_ids + out1.choices[0].output_ids  # 38 tokens; 37 have KV (9 full pages)
    wait_published(c, 2)
    turn2 = req(
        history + [(3 * i + 1) % 60 for i in range(20)],
        temperature=1.0,
        seed=4,
        max_tokens=6,
        ignore_eos=True,
    )
    r = httpx.post(
        f"{c.url('prefill', 'prefill')}/v1/prefill",
        json={"input_ids": turn2.input_ids, "sampling": turn2.sampling.model_dump(), "request_id": "t2"},
        timeout=60,
        headers=auth_headers(),
    ).json()
    assert (r["local_tokens"], r["pulled_tokens"]) == (28, 8), r
    out2 = generate(c, turn2)
    for out, ref in zip([out1, out2], colocated(c, [turn1, turn2]), strict=True):
        same(out, ref)


def test_a_weight_update_reaches_both_prefill_ranks(cluster: Cluster) -> None:
    c = cluster
    # The prefill follows the latest published version; the decode is told (as the orchestrator does).
    c.bus.publish_weights(WeightsInfo(version=1, path=str(c.weights_v1)))
    r = httpx.post(
        f"{c.url('decode', 'decode')}/update_weights",
        json={"path": str(c.weights_v1), "version": 1},
        timeout=60,
        headers=auth_headers(),
    )
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 60
    while not all(s.version == 1 for kind in ("prefill", "decode") for s in c.bus.services(kind)):
        assert time.monotonic() < deadline, "the services never loaded version 1"
        time.sleep(0.2)
    time.sleep(DISCOVERY_TTL_S + 0.2)  # decode's view of the prefill's version
    r2 = req([(3 * i + 4) % 60 for i in range(33)], temperature=1.0, seed=9, max_tokens=6, ignore_eos=True)
    before = c.health("decode", "decode")["kv"]
    out = generate(c, r2)
    same(out, colocated(c, [r2], version=1)[0])
    assert out.choices[0].versions == [1] * 6
    assert c.health("decode", "decode")["kv"]["remote"] - before["remote"] == 1


def test_a_dead_prefill_rank_ends_the_service(cluster: Cluster) -> None:
    """Last in this module: it ends the 2-rank prefill. With its worker killed, /health turns 503
    naming the rank, /v1/prefill answers 503 (the decode computes the prompt itself), and the
    service exits 1 within seconds, for its supervisor to restart the group."""
    c = cluster
    url = c.url("prefill", "prefill")
    proc = c.procs["prefill"]
    [worker] = worker_pids(proc.pid)
    os.kill(worker, signal.SIGKILL)
    health: dict[str, Any] = {}
    refused: httpx.Response | None = None
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/health", timeout=5)
            if r.status_code == 503 and not health:
                health = r.json()
                body = {"input_ids": P1, "sampling": {"max_tokens": 1}}
                refused = httpx.post(f"{url}/v1/prefill", json=body, timeout=10, headers=auth_headers())
        except httpx.HTTPError:
            pass  # exited meanwhile
        time.sleep(0.05)
    assert proc.wait(30) == 1
    c.procs.pop("prefill")
    assert health.get("status") == "failed" and "rank 1 exited with -9" in health["reason"], health
    assert refused is not None and refused.status_code == 503, refused
    # The decode still answers, computing the prompt itself (the prefill is gone).
    out = generate(c, req(P1[::-1], temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out.choices[0].output_ids) == 3
