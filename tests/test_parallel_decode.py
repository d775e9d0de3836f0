"""A decode service whose engine spans 2 ranks (decode.parallel.tp = 2: the service is rank 0, rank
1 its worker process) answers /v1/generate, /v1/completions and /v1/chat/completions as the 1-rank
service does (tokens equal, log-probs to 1e-5), applies a weight update on both ranks, and when its
worker is killed answers the requests it held and /health with a 503 naming the rank, then exits 1
for its supervisor to restart the group."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.debug_weights import random_model_dir, spread_debug_versions
from helpers.decode_server import Server, decode_server, wait_for
from helpers.parallel import tiny_moe, worker_pids

from services.common.auth import auth_headers
from services.common.config import CONFIG_DIR, ModelConfig, ParallelConfig, load_config
from services.common.schemas import WeightsInfo
from trainer.model import build_model, save_weights_dir

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="gloo process groups and /proc: Linux")

TOL = 1e-5
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"


def run_weights(run_dir: Path) -> tuple[Path, Path]:
    """Versions 0 and 1 of the debug model under run_dir/weights (where POST /update_weights
    accepts them), with a chat template."""
    dirs = spread_debug_versions(run_dir / "weights")
    for d in dirs:
        tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
        (d / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "chat_template": TEMPLATE}))
    return dirs


@contextmanager
def one_and_split(
    redis_url: str,
    weights: tuple[Path, Path],
    m: ModelConfig,
    tmp: tuple[Path, Path],
    prefix: str,
    max_seq_len: int,
    parallel: ParallelConfig,
) -> Iterator[tuple[Server, Server]]:
    """A 1-rank decode service and one over `parallel`'s ranks, on their own weights and dirs."""
    with (
        decode_server(redis_url, weights[0], m, tmp[0], prefix=f"{prefix}1", max_seq_len=max_seq_len) as one,
        decode_server(
            redis_url, weights[1], m, tmp[1], prefix=f"{prefix}2", max_seq_len=max_seq_len, parallel=parallel
        ) as split,
    ):
        yield one, split


@pytest.fixture(scope="module")
def pair(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    tmp = tmp_path_factory.mktemp("par-decode")
    m = load_config(CONFIG_DIR / "debug.toml").model  # 4 heads, 2 KV heads, vocabulary 64
    (tmp / "one").mkdir()
    (tmp / "two").mkdir()
    weights = run_weights(tmp / "one")[0], run_weights(tmp / "two")[0]
    dirs = tmp / "one", tmp / "two"
    with one_and_split(redis_url, weights, m, dirs, "test-par", 256, ParallelConfig(tp=2)) as (one, two):
        yield one, two


def post(s: Server, path: str, body: object) -> dict[str, Any]:
    r = httpx.post(f"{s.url}{path}", json=body, timeout=60, headers=auth_headers())
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, "logprobs": 2},
        {"temperature": 1.0, "seed": 7, "n": 2, "max_tokens": 12, "ignore_eos": True},
    ],
)
def test_generate_equals_one_rank(pair: tuple[Server, Server], sampling: dict[str, Any]) -> None:
    one, two = pair
    body = {"input_ids": [5, 6, 7, 8, 9, 10], "sampling": sampling}
    a, b = post(one, "/v1/generate", body), post(two, "/v1/generate", body)
    assert len(a["choices"]) == len(b["choices"]) == sampling.get("n", 1)
    for x, y in zip(a["choices"], b["choices"], strict=True):
        assert x["output_ids"] == y["output_ids"] and x["finish_reason"] == y["finish_reason"]
        assert max(abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"], strict=True)) <= TOL
        assert x["top_logprobs"] is None or [[t for t, _ in r] for r in x["top_logprobs"]] == [
            [t for t, _ in r] for r in y["top_logprobs"]
        ]
    if sampling["temperature"] > 0:
        assert a["choices"][0]["output_ids"] != a["choices"][1]["output_ids"]


def test_chat_equals_one_rank(pair: tuple[Server, Server]) -> None:
    one, two = pair
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 10,
        "seed": 3,
        "n": 2,
        "logprobs": True,
    }
    a, b = post(one, "/v1/chat/completions", body), post(two, "/v1/chat/completions", body)
    for x, y in zip(a["choices"], b["choices"], strict=True):
        assert x["message"]["content"] == y["message"]["content"]
        lx = [t["logprob"] for t in x["logprobs"]["content"]]
        ly = [t["logprob"] for t in y["logprobs"]["content"]]
        assert max(abs(p - q) for p, q in zip(lx, ly, strict=True)) <= TOL
    assert a["usage"] == b["usage"]


def metric(s: Server, name: str) -> float:
    for line in httpx.get(f"{s.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in {s.url}/metrics")


def test_completions_health_and_metrics(pair: tuple[Server, Server]) -> None:
    one, two = pair
    body = {"model": "m", "prompt": "abc", "max_tokens": 8, "seed": 11, "n": 2, "logprobs": 2}
    a, b = post(one, "/v1/completions", body), post(two, "/v1/completions", body)
    for x, y in zip(a["choices"], b["choices"], strict=True):
        assert x["text"] == y["text"] and x["finish_reason"] == y["finish_reason"]
        lx, ly = x["logprobs"]["token_logprobs"], y["logprobs"]["token_logprobs"]
        assert max(abs(p - q) for p, q in zip(lx, ly, strict=True)) <= TOL
    assert a["usage"] == b["usage"]
    health = httpx.get(f"{two.url}/health").json()
    assert health["status"] == "ok" and health["kind"] == "decode" and health["version"] == 0
    assert metric(two, "relay_decode_generated_tokens_total") >= 16
    assert metric(two, "relay_decode_weight_version") == 0


def test_a_weight_update_reaches_every_rank(pair: tuple[Server, Server]) -> None:
    """After POST /update_weights both engines generate with version 1: had rank 1 kept its
    version-0 slices, the 2-rank logits would mix the versions and differ from the 1-rank ones."""
    body = {"input_ids": [5, 6, 7, 8], "sampling": {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}}
    before = post(pair[1], "/v1/generate", body)["choices"][0]
    for s in pair:
        v1 = s.model_dir.parent / "step_1"
        s.bus.publish_weights(WeightsInfo(version=1, path=str(v1)))
        assert post(s, "/update_weights", {"path": str(v1), "version": 1})["version"] == 1
    a, b = (post(s, "/v1/generate", body)["choices"][0] for s in pair)
    assert a["versions"] == b["versions"] == [1] * 10
    assert a["output_ids"] == b["output_ids"]
    assert max(abs(p - q) for p, q in zip(a["logprobs"], b["logprobs"], strict=True)) <= TOL
    assert max(abs(p - q) for p, q in zip(b["logprobs"], before["logprobs"], strict=True)) > 1e-3
    assert metric(pair[1], "relay_decode_weight_version") == 1


def test_a_dead_rank_fails_requests_and_health_then_exits(pair: tuple[Server, Server]) -> None:
    """Last in this module: it ends the 2-rank service. Requests in flight when the worker is
    killed get a 503 naming the rank (the orchestrator retries their rollouts), /health turns 503
    naming it, and the service exits 1 within seconds (no hang on the dead peer)."""
    _one, two = pair
    [worker] = worker_pids(two.proc.pid)
    answers: list[httpx.Response] = []
    long = {"input_ids": [5, 6, 7], "sampling": {"max_tokens": 240, "ignore_eos": True, "n": 4, "seed": 1}}

    def ask() -> None:
        answers.append(httpx.post(f"{two.url}/v1/generate", json=long, timeout=60, headers=auth_headers()))

    asker = threading.Thread(target=ask)
    asker.start()
    wait_for(lambda: httpx.get(f"{two.url}/health").json().get("running", 0) > 0, what="running request")
    t0 = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    health: dict[str, Any] = {}
    while not health and two.proc.poll() is None:
        try:
            r = httpx.get(f"{two.url}/health", timeout=5)
        except httpx.HTTPError:
            break  # exited meanwhile
        if r.status_code == 503:
            health = r.json()
            try:
                late = httpx.post(f"{two.url}/v1/generate", json=long, timeout=10, headers=auth_headers())
            except httpx.HTTPError:
                break  # it exited in between: nothing left to ask
            assert late.status_code == 503 and "rank 1 exited" in late.json()["detail"], late.text
        time.sleep(0.02)
    asker.join(30)
    assert health["status"] == "failed" and "rank 1 exited with -9" in health["reason"], health
    [answer] = answers
    assert answer.status_code == 503, answer.text
    assert answer.json()["detail"] == "engine ranks failed: rank 1 exited with -9"
    assert two.proc.wait(timeout=30) == 1
    assert time.monotonic() - t0 < 15
    assert "engine ranks failed" in two.log.read_text()


def test_sigterm_stops_every_rank(redis_url: str, tmp_path: Path) -> None:
    """A clean stop: the service releases its worker (exit 0) and exits 0 itself."""
    m = load_config(CONFIG_DIR / "debug.toml").model
    d = save_weights_dir(m, build_model(m, seed=5).state_dict(), tmp_path / "step_0", {"version": 0})
    with decode_server(
        redis_url, d, m, tmp_path, prefix="test-par-stop", max_seq_len=64, parallel=ParallelConfig(tp=2)
    ) as s:
        [worker] = worker_pids(s.proc.pid)
        post(s, "/v1/generate", {"input_ids": [5, 6], "sampling": {"max_tokens": 3}})
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=60) == 0
        assert (
            not Path(f"/proc/{worker}").exists() or "Z" in Path(f"/proc/{worker}/stat").read_text().split()[2]
        )


@pytest.mark.full
def test_data_parallel_attention_decode_equals_one_rank(redis_url: str, tmp_path: Path) -> None:
    """A decode service over 2 attention groups (dp_attention = ep = 2, a tiny Qwen3-MoE) answers
    concurrent /v1/generate requests as the 1-rank service does: tokens, log-probs and routed
    expert ids (a request arriving while group 0 has work goes to group 1, whose ids come back to
    rank 0)."""
    m = tiny_moe(128)
    weights = random_model_dir(m, tmp_path / "weights" / "step_0", std=0.2)
    (tmp_path / "one").mkdir()
    (tmp_path / "dp").mkdir()
    bodies = [
        {
            "input_ids": [3 + i, 17, 5, 9, 30, 2, 11][: 4 + i],
            "sampling": {
                "temperature": 1.0 if i % 2 else 0.0,
                "seed": i,
                "max_tokens": 20,
                "ignore_eos": True,
            },
            "return_routed_experts": True,
        }
        for i in range(4)
    ]
    got: dict[str, list[dict[str, Any]]] = {}
    dirs = tmp_path / "one", tmp_path / "dp"
    dp2 = ParallelConfig(dp_attention=2, ep=2)
    with one_and_split(redis_url, (weights, weights), m, dirs, "test-dp", 128, dp2) as (one, dp):
        for name, s in (("one", one), ("dp", dp)):
            out: list[dict[str, Any]] = [{} for _ in bodies]

            def ask(i: int, s: Server = s, out: list[dict[str, Any]] = out) -> None:
                out[i] = post(s, "/v1/generate", bodies[i])

            threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(bodies))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            got[name] = out
        assert metric(dp, "relay_decode_kv_blocks") == 2 * metric(one, "relay_decode_kv_blocks")
    for a, b in zip(got["one"], got["dp"], strict=True):
        x, y = a["choices"][0], b["choices"][0]
        assert x["output_ids"] == y["output_ids"] and len(x["output_ids"]) == 20
        assert max(abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"], strict=True)) <= TOL
        assert x["routed_experts"] is not None and x["routed_experts"] == y["routed_experts"]
