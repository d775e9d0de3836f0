"""The decode service as a real subprocess: registry discovery, waiting for the first weights,
every endpoint over HTTP, 4xx errors naming the field, SIGTERM exit 0."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from helpers.debug_weights import spread_debug_versions
from helpers.decode_server import decode_server, wait_for

from services.common.auth import auth_headers
from services.common.bus import Bus
from services.common.config import CONFIG_DIR, load_config
from services.common.schemas import WeightsInfo


@dataclass
class Decode:
    url: str
    bus: Bus
    proc: subprocess.Popen[bytes]
    weights: tuple[Path, Path]
    log: Path
    health_before_weights: dict[str, object]


@pytest.fixture(scope="module")
def decode(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Decode]:
    tmp = tmp_path_factory.mktemp("decode")
    m = load_config(CONFIG_DIR / "debug.toml").model
    weights = spread_debug_versions(tmp / "weights")  # the run's weights root: next to config.json
    with decode_server(
        redis_url,
        weights[0],
        m,
        tmp,
        prefix="test-decode",
        max_seq_len=64,
        run_name="relay-test",
        publish=False,
    ) as s:
        health = httpx.get(f"{s.url}/health").json()
        s.bus.publish_weights(WeightsInfo(version=0, path=str(weights[0])))
        wait_for(lambda: httpx.get(f"{s.url}/health").json()["status"] == "ok", what="weights loaded")
        yield Decode(s.url, s.bus, s.proc, weights, s.log, health)


def post(d: Decode, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{d.url}{path}", json=body, timeout=30, headers=auth_headers())


def test_waits_for_weights_then_serves(decode: Decode) -> None:
    assert decode.health_before_weights["status"] == "loading"
    assert decode.health_before_weights["version"] == -1
    health = httpx.get(f"{decode.url}/health").json()
    assert health["version"] == 0 and health["paused"] is False
    assert {"queue", "running", "idle_s"} <= set(health)
    wait_for(lambda: decode.bus.services("decode")[0].version == 0, what="registry version 0")
    assert "waiting for weights" in decode.log.read_text()


def test_generate(decode: Decode) -> None:
    body = {"input_ids": [5, 6, 7], "sampling": {"max_tokens": 5, "n": 2, "seed": 3, "ignore_eos": True}}
    r = post(decode, "/v1/generate", {**body, "request_id": "abc"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["request_id"] == "abc" and out["prompt_tokens"] == 3 and len(out["choices"]) == 2
    for ch in out["choices"]:
        assert len(ch["output_ids"]) == len(ch["logprobs"]) == 5 and ch["versions"] == [0] * 5
        assert ch["finish_reason"] == "length" and all(lp <= 0 for lp in ch["logprobs"])
    assert post(decode, "/v1/generate", body).json()["choices"] == out["choices"]  # seeded


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        ({"sampling": {"max_tokens": 3}}, 422, "input_ids"),
        ({"input_ids": []}, 422, "input_ids"),
        ({"input_ids": ["x"]}, 422, "input_ids.0"),
        ({"input_ids": [3], "sampling": {"temperature": -1}}, 422, "sampling.temperature"),
        ({"input_ids": [3], "sampling": {"temprature": 1}}, 422, "sampling.temprature"),
        ({"input_ids": [3, 64]}, 400, "input_ids: token id 64"),
        ({"input_ids": [3] * 64}, 400, "input_ids: prompt has 64 tokens"),
    ],
)
def test_generate_rejects_bad_bodies_naming_field(
    decode: Decode, body: object, status: int, field: str
) -> None:
    r = post(decode, "/v1/generate", body)
    assert r.status_code == status, r.text
    assert field in r.json()["detail"]


def test_completions(decode: Decode) -> None:
    body = {
        "model": "x",
        "prompt": "abc",
        "max_tokens": 6,
        "n": 2,
        "seed": 1,
        "logprobs": 1,
        "temperature": 1.0,
    }
    r = post(decode, "/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert (
        out["object"] == "text_completion" and out["model"] == "relay-test" and out["id"].startswith("cmpl-")
    )
    assert out["usage"]["prompt_tokens"] == 3
    assert out["usage"]["total_tokens"] == 3 + out["usage"]["completion_tokens"]
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for c in out["choices"]:
        lp = c["logprobs"]
        # Log-prob tokens carry every token's real text (special ones too, as vLLM's do); the
        # completion text skips special tokens, and ids past the tokenizer read `token_id:N`.
        specials = {"<pad>", "<eos>", "<unk>"}
        assert (
            "".join(t for t in lp["tokens"] if t not in specials and not t.startswith("token_id:"))
            == c["text"]
        )
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"])
        assert c["finish_reason"] in ("stop", "length")

    # a stop string cuts the text (greedy, so the text without it is known)
    greedy = {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}
    full = post(decode, "/v1/completions", greedy).json()["choices"][0]["text"]
    if len(full) >= 3:
        stopped = post(decode, "/v1/completions", {**greedy, "stop": [full[2:4]]}).json()["choices"][0]
        assert stopped["text"] == full[: full.find(full[2:4])] and stopped["finish_reason"] == "stop"

    for bad, field in [
        ({"prompt": ""}, "prompt"),
        ({"prompt": [3, 99]}, "prompt: token id 99"),
        ({}, "prompt"),
    ]:
        r = post(decode, "/v1/completions", bad)
        assert r.status_code in (400, 422) and field in r.json()["detail"], r.text


def test_models(decode: Decode) -> None:
    data = httpx.get(f"{decode.url}/v1/models").json()["data"]
    assert data[0]["id"] == "relay-test" and data[0]["object"] == "model" and data[0]["max_model_len"] == 64


def _weight_updates(d: Decode) -> float:
    for line in httpx.get(f"{d.url}/metrics").text.splitlines():
        if line.startswith("relay_decode_weight_updates_total "):
            return float(line.split()[1])
    raise AssertionError("no relay_decode_weight_updates_total")


def test_update_weights(decode: Decode, tmp_path: Path) -> None:
    v0, v1 = (str(p) for p in decode.weights)
    r = post(decode, "/update_weights", {"path": v0})
    assert r.status_code == 422 and "version" in r.json()["detail"]
    # Only what the trainer announced: step_1 is on disk but not announced yet.
    r = post(decode, "/update_weights", {"path": v1, "version": 1})
    assert (
        r.status_code == 400
        and r.json()["detail"] == "version: 1 has not been announced by the trainer (the newest is 0)"
    )
    decode.bus.publish_weights(WeightsInfo(version=1, path=v1))
    before = _weight_updates(decode)
    r = post(decode, "/update_weights", {"path": v1, "version": 1})
    assert r.status_code == 200 and r.json()["version"] == 1
    assert httpx.get(f"{decode.url}/health").json()["version"] == 1
    out = post(decode, "/v1/generate", {"input_ids": [5], "sampling": {"max_tokens": 3, "ignore_eos": True}})
    assert out.json()["choices"][0]["versions"] == [1, 1, 1]
    wait_for(lambda: decode.bus.services("decode")[0].version == 1, what="registry version 1")
    # The version already live, asked again (as the orchestrator does while the registry lags):
    # answered without reading or swapping the weights again.
    r = post(decode, "/update_weights", {"path": v1, "version": 1})
    assert r.status_code == 200 and r.json()["version"] == 1 and _weight_updates(decode) == before + 1

    bad = [
        # a version from the future, a directory that does not exist under that version's number
        ({"path": str(Path(v0).parent / "step_9"), "version": 9}, "version: 9 has not been announced"),
        # an announced version under another directory of the run, and one outside the run
        ({"path": v1, "version": 0}, f"path: version 0 is {v0}, not {v1}"),
        ({"path": str(tmp_path), "version": 0}, f"path: {tmp_path} is not under the run's weights directory"),
        (
            {"path": f"{Path(v0).parent}/../x", "version": 1},
            f"path: {Path(v0).parent}/../x is not under the run's",
        ),
    ]
    for body, detail in bad:
        r = post(decode, "/update_weights", body)
        assert r.status_code == 400 and r.json()["detail"].startswith(detail), (body, r.text)
    # A version announced earlier is still loadable (an older, announced policy).
    r = post(decode, "/update_weights", {"path": v0, "version": 0})
    assert r.status_code == 200 and httpx.get(f"{decode.url}/health").json()["version"] == 0
    assert post(decode, "/update_weights", {"path": v1, "version": 1}).status_code == 200
    assert _weight_updates(decode) == before + 3
    assert "weights update refused" in decode.log.read_text()


def test_pause_resume(decode: Decode) -> None:
    assert post(decode, "/pause", {}).json()["paused"] is True
    body = {"input_ids": [5, 6], "sampling": {"max_tokens": 3}}
    r = post(decode, "/v1/generate", body)
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and "paused" in r.json()["detail"]
    assert httpx.get(f"{decode.url}/health").json()["paused"] is True
    assert post(decode, "/resume", {}).json()["paused"] is False
    assert post(decode, "/v1/generate", body).status_code == 200


def test_metrics(decode: Decode) -> None:
    text = httpx.get(f"{decode.url}/metrics").text
    for name in (
        "relay_decode_requests_total",
        "relay_decode_generated_tokens_total",
        "relay_decode_batch_size_bucket",
        "relay_decode_idle_seconds_total",
        "relay_decode_weight_version 1.0",
        "relay_decode_prefix_cache_hit_tokens_total",
        "relay_decode_prefix_cache_hit_rate",
        "relay_decode_preemptions_total",
        "relay_decode_kv_blocks_used",
        "relay_decode_weight_apply_last_seconds",
        "relay_decode_weight_read_last_seconds",
        "relay_decode_weight_stage_last_seconds",
    ):
        assert name in text, name
    # Every update's bytes and seconds (three updates of the debug model so far, test_update_weights).
    values = {
        ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")
    }
    assert values["relay_decode_weight_bytes_read_total"] == 3 * sum(
        (p.stat().st_size for p in decode.weights[1].glob("*.safetensors")), 0
    ) - 3 * _header_bytes(decode.weights[1])
    assert values["relay_decode_weight_apply_seconds_total"] > 0
    assert values["relay_decode_weight_stage_seconds_total"] == 0  # stage_weights off
    # The pools' bytes: a dense model's pages, and no Mamba-2 state slots.
    assert values["relay_decode_kv_cache_bytes"] > 0
    assert values["relay_decode_state_cache_bytes"] == 0


def _header_bytes(d: Path) -> int:
    """Bytes of a weights directory's files that are not tensor data (the safetensors headers)."""
    return sum(8 + int.from_bytes(p.read_bytes()[:8], "little") for p in d.glob("*.safetensors"))


def test_sigterm_exits_cleanly(decode: Decode) -> None:
    decode.proc.send_signal(signal.SIGTERM)
    assert decode.proc.wait(20) == 0
    assert decode.bus.services("decode") == []
    assert "engine stopped" in decode.log.read_text()
