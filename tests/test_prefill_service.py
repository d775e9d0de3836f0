"""Prefill/decode disaggregation with every piece a real process: Redis, the KV store gateway, a
prefill service and decode replicas (kvstore.enabled), weights published through Redis.

- a disaggregated generation gives the same tokens as a colocated engine for the same seed;
- a second turn prefills only its new tokens (the first turn's pages come from the store);
- pages survive a decode restart through the gateway;
- with the gateway killed, generation still succeeds (same tokens, computed locally)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.common.auth import auth_headers
from services.common.bus import Bus
from services.common.config import (
    REPO_ROOT,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    load_config,
)
from services.common.schemas import GenerateRequest, GenerateResponse, SamplingParams, WeightsInfo
from services.engine import LLMEngine
from services.kvstore.router import DISCOVERY_TTL_S
from trainer.model import build_model, save_weights_dir

ENGINE = EngineConfig(device="cpu", max_batch_size=8, max_seq_len=128, block_size=4)
pytestmark = pytest.mark.slow  # four service processes on two cores: ~30-60 s for the module


@dataclass
class Cluster:
    tmp: Path
    redis_url: str
    cfg: RunConfig
    bus: Bus
    weights: Path
    weights_v1: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, module: str, cfg: RunConfig | None = None) -> None:
        path = self.tmp / f"{name}.json"
        path.write_text((cfg or self.cfg).dump())
        with open(self.tmp / f"{name}.log", "ab") as out:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", module, "--config", str(path), "--redis-url", self.redis_url],
                cwd=REPO_ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def stop(self, name: str, sig: int = signal.SIGTERM) -> int:
        p = self.procs.pop(name)
        p.send_signal(sig)
        return p.wait(30)

    def url(self, kind: str, name: str) -> str:
        """The registered URL of process `name` (a service of `kind`), once it reports ready."""
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            proc = self.procs[name]
            assert proc.poll() is None, f"{name} died: {(self.tmp / f'{name}.log').read_text()[-3000:]}"
            for s in self.bus.services(kind):
                if s.pid == proc.pid and s.version >= 0:
                    return s.url
            time.sleep(0.1)
        raise TimeoutError(f"{name} not ready")

    def health(self, kind: str, name: str) -> dict[str, Any]:
        return httpx.get(f"{self.url(kind, name)}/health", timeout=10).json()


@contextmanager
def running_cluster(
    redis_url: str,
    tmp: Path,
    prefill_parallel: ParallelConfig | None = None,
    decode_parallel: ParallelConfig | None = None,
    model: ModelConfig | None = None,
) -> Iterator[Cluster]:
    """Redis, the gateway, a prefill service (over `prefill_parallel` ranks) and a decode (over
    `decode_parallel` ranks) on the debug model's (or `model`'s) versions 0 and 1 (0 published),
    decode routing long prompts to the prefill."""
    m = model or load_config("debug").model
    state = build_model(m, seed=0).state_dict()
    state["norm.weight"] = state["norm.weight"] * 0.3  # spread-out distributions
    weights = save_weights_dir(m, state, tmp / "weights" / "step_0", {"version": 0})
    state1 = build_model(m, seed=1).state_dict()
    state1["norm.weight"] = state1["norm.weight"] * 0.3
    weights_v1 = save_weights_dir(m, state1, tmp / "weights" / "step_1", {"version": 1})
    cfg = RunConfig(model=m)
    cfg.redis.prefix = f"test-disagg-{uuid.uuid4().hex[:8]}"
    cfg.redis.heartbeat_s = 0.2
    cfg.decode.engine = ENGINE
    cfg.prefill.parallel = prefill_parallel
    cfg.decode.parallel = decode_parallel or ParallelConfig()
    cfg.kvstore.enabled = True
    cfg.kvstore.retry_after_s = 0.5
    cfg.prefill.min_new_tokens = 16  # prompts with >= 16 uncached tokens go to the prefill service
    # These tests are about the pull mechanics: pull whatever the store has. (With the cost model,
    # recomputing this 2-layer debug model's pages is cheaper than a pull: tests/test_kv_pull_policy.py.)
    cfg.kvstore.pull.mode = "always"
    c = Cluster(tmp, redis_url, cfg, Bus(redis_url, cfg.redis.prefix), weights, weights_v1)
    c.bus.publish_weights(WeightsInfo(version=0, path=str(weights)))
    c.start("kvstore", "services.kvstore")
    c.start("prefill", "services.prefill")
    c.start("decode", "services.decode")
    # The tests expect decode to route long prompts to the prefill service: wait until it is
    # registered and decode's cached view of the registry (DISCOVERY_TTL_S) can include it. On a
    # loaded machine the prefill came up after decode's first requests, which then prefilled
    # locally (remote 0; the second turn found nothing in the prefill's cache).
    c.url("prefill", "prefill")
    c.url("decode", "decode")
    time.sleep(DISCOVERY_TTL_S + 0.2)
    try:
        yield c
    finally:
        for name in list(c.procs):
            assert c.stop(name) == 0, f"{name} did not exit cleanly"


@pytest.fixture(scope="module")
def cluster(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(redis_url, tmp_path_factory.mktemp("disagg")) as c:
        yield c


def generate(c: Cluster, req: GenerateRequest, name: str = "decode") -> GenerateResponse:
    r = httpx.post(
        f"{c.url('decode', name)}/v1/generate",
        json=req.model_dump(mode="json"),
        timeout=120,
        headers=auth_headers(),
    )
    assert r.status_code == 200, r.text
    return GenerateResponse.model_validate_json(r.content)


def colocated(c: Cluster, reqs: list[GenerateRequest], version: int = 0) -> list[GenerateResponse]:
    eng = LLMEngine(c.weights_v1 if version else c.weights, ENGINE, version=version)
    return [eng.generate([r])[0] for r in reqs]


def same(a: GenerateResponse, b: GenerateResponse) -> None:
    assert [ch.output_ids for ch in a.choices] == [ch.output_ids for ch in b.choices]
    for x, y in zip(a.choices, b.choices, strict=True):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
        assert x.versions == y.versions and x.finish_reason == y.finish_reason


def req(prompt: list[int], **sampling: Any) -> GenerateRequest:
    return GenerateRequest(input_ids=prompt, sampling=SamplingParams(**sampling))


def wait_published(c: Cluster, at_least: int) -> None:
    deadline = time.monotonic() + 30
    while c.health("decode", "decode")["kv"]["published_pages"] < at_least:
        assert time.monotonic() < deadline, "decode never published its pages"
        time.sleep(0.1)


P1 = [(5 * i + 2) % 60 for i in range(41)]


def test_disaggregated_equals_colocated(cluster: Cluster) -> None:
    check_disaggregated_equals_colocated(cluster)


def check_disaggregated_equals_colocated(c: Cluster) -> None:
    """Two prompts through decode: prefilled by the prefill service, every prompt page taken from
    it, the tokens and log-probs a colocated 1-rank engine gives."""
    reqs = [
        req(P1, temperature=1.0, seed=7, n=3, max_tokens=8, ignore_eos=True),
        req(P1[::-1], temperature=0.0, max_tokens=5, ignore_eos=True),
    ]
    before = c.health("decode", "decode")["kv"]
    outs = [generate(c, r) for r in reqs]
    for out, ref in zip(outs, colocated(c, reqs), strict=True):
        same(out, ref)
    kv = c.health("decode", "decode")["kv"]
    assert kv["remote"] - before["remote"] == 2  # both prompts were prefilled by the service
    assert kv["pulled_pages"] - before["pulled_pages"] == 2 * 10  # ... and their pages pulled
    prefill = c.health("prefill", "prefill")
    assert prefill["served"] >= 2 and prefill["published_pages"] >= 20
    # Decode computed no prompt token (the same-host handoff carries the partial last page too):
    # per sample the prefilled token, then decodes.
    assert kv["computed_tokens"] - before["computed_tokens"] == 3 * 7 + 1 * 4


def test_second_turn_prefills_only_new_tokens(cluster: Cluster) -> None:
    c = cluster
    turn1 = req([(7 * i + 5) % 60 for i in range(30)], temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    out1 = generate(c, turn1)
    history = turn1.input_ids + out1.choices[0].output_ids  # 38 tokens; 37 have KV (9 full pages)
    wait_published(c, 2)  # the 2 pages decode completed while generating (7 came from prefill)
    observation = [(3 * i + 1) % 60 for i in range(20)]
    turn2 = req(history + observation, temperature=1.0, seed=4, max_tokens=6, ignore_eos=True)

    r = httpx.post(
        f"{c.url('prefill', 'prefill')}/v1/prefill",
        json={
            "input_ids": turn2.input_ids,
            "sampling": turn2.sampling.model_dump(),
            "request_id": "t2-probe",
        },
        timeout=60,
        headers=auth_headers(),
    ).json()
    # The previous turn's 9 full pages were reused: the 7 prompt pages this service computed in
    # turn 1 from its own cache, the 2 pages decode filled while generating from the store.
    assert (r["local_tokens"], r["pulled_tokens"]) == (28, 8)
    assert r["computed_tokens"] == len(turn2.input_ids) - 36 == len(observation) + 2
    assert r["pages_stored"] == len(turn2.input_ids) // 4 - 9

    before = c.health("decode", "decode")["kv"]
    out2 = generate(c, turn2)
    kv = c.health("decode", "decode")["kv"]
    # Decode had the pages locally and the observation is >= 16 new tokens: prefilled remotely.
    assert kv["remote"] - before["remote"] == 1
    # The prompt's partial last page (2 tokens) came with the handoff: the prefilled token, then
    # 4 decode steps.
    assert kv["computed_tokens"] - before["computed_tokens"] == 1 + 4
    for out, ref in zip([out1, out2], colocated(c, [turn1, turn2]), strict=True):
        same(out, ref)


def test_pages_survive_a_decode_restart(cluster: Cluster) -> None:
    c = cluster
    r = req(P1, temperature=1.0, seed=21, max_tokens=6, ignore_eos=True)
    first = generate(c, r)
    assert c.stop("decode") == 0
    local = c.cfg.model_copy(deep=True)
    local.prefill.min_new_tokens = 10_000  # the restarted replica prefills locally: pulls, no prefill call
    c.start("decode2", "services.decode", local)
    again = generate(c, r, "decode2")
    same(again, first)
    kv = c.health("decode", "decode2")["kv"]
    assert kv["remote"] == 0 and kv["imported_pages"] == 10
    assert kv["prefix_hit_tokens"] == 40
    assert kv["computed_tokens"] == 1 + 5  # the last prompt token, then 5 decode steps


def test_weight_update_never_uses_stale_pages(cluster: Cluster) -> None:
    """decode2 has P1's version-0 pages locally and the store has them too; after a weight update
    neither is used: everything is computed with the new weights."""
    c = cluster
    url = c.url("decode", "decode2")
    # Announced as the trainer does, but not made the latest: the prefill service stays on 0.
    info = WeightsInfo(version=1, path=str(c.weights_v1))
    c.bus.r.hset(c.bus.k.weights_announced, "1", info.model_dump_json())
    r = httpx.post(
        f"{url}/update_weights",
        json={"path": str(c.weights_v1), "version": 1},
        timeout=60,
        headers=auth_headers(),
    )
    assert r.status_code == 200, r.text
    before = c.health("decode", "decode2")["kv"]
    req1 = req(P1, temperature=1.0, seed=21, max_tokens=6, ignore_eos=True)
    out = generate(c, req1, "decode2")
    same(out, colocated(c, [req1], version=1)[0])
    assert out.choices[0].versions == [1] * 6
    kv = c.health("decode", "decode2")["kv"]
    assert kv["prefix_hit_tokens"] == before["prefix_hit_tokens"]  # no stale local page ...
    assert kv["pulled_pages"] == before["pulled_pages"]  # ... and none from the store
    assert kv["computed_tokens"] - before["computed_tokens"] == len(P1) + 5


def test_generation_succeeds_with_the_gateway_killed(cluster: Cluster) -> None:
    c = cluster
    c.start("decode3", "services.decode")  # routes long prompts to the prefill service again
    c.url("decode", "decode3")
    assert c.stop("kvstore", signal.SIGKILL) == -signal.SIGKILL
    reqs = [
        req(
            [(11 * i + 7) % 60 for i in range(45)],
            temperature=1.0,
            seed=8,
            n=2,
            max_tokens=5,
            ignore_eos=True,
        ),
        req(P1[3:], temperature=0.0, max_tokens=4, ignore_eos=True),
    ]
    # decode3 (version 0) via the prefill service; decode2 (version 1 since the last test) locally.
    for name, version in (("decode3", 0), ("decode2", 1)):
        before = c.health("decode", name)["kv"]
        outs = [generate(c, r, name) for r in reqs]
        for out, ref in zip(outs, colocated(c, reqs, version), strict=True):
            same(out, ref)
        kv = c.health("decode", name)["kv"]
        # Nothing came from the store: every page decode took arrived by the same-host handoff
        # from the prefill's shared memory (docs/kv.md), which needs no gateway ...
        pulled = kv["pulled_pages"] - before["pulled_pages"]
        assert pulled == kv["handoff_pages_copied"] - before["handoff_pages_copied"]
        assert kv["store_failures"] > before["store_failures"]  # ... it was tried and failed fast
    assert c.health("decode", "decode3")["kv"]["remote"] >= 2  # prefill still served the first tokens
