"""A decode service whose engine spans 2 ranks (decode.parallel.tp = 2: the service is rank 0, rank
1 its worker process) answers /v1/generate and /v1/chat/completions as the 1-rank service does
(tokens equal, log-probs to 1e-5), and exits non-zero when its worker dies, for its supervisor
to restart the group."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.decode_server import Server, decode_server

from services.common.auth import auth_headers
from services.common.config import CONFIG_DIR, ParallelConfig, load_config
from trainer.model import build_model, save_weights_dir

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="gloo process groups and /proc: Linux")

TOL = 1e-5
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def pair(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    tmp = tmp_path_factory.mktemp("par-decode")
    m = load_config(CONFIG_DIR / "debug.toml").model  # 4 heads, 2 KV heads, vocabulary 64
    state = build_model(m, seed=4).state_dict()
    state["norm.weight"] = state["norm.weight"] * 0.3  # spread-out distributions: draws differ
    d = save_weights_dir(m, state, tmp / "step_0", {"version": 0})
    tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "chat_template": TEMPLATE}))
    (tmp / "one").mkdir()
    (tmp / "two").mkdir()
    with (
        decode_server(redis_url, d, m, tmp / "one", prefix="test-par1", max_seq_len=64) as one,
        decode_server(
            redis_url, d, m, tmp / "two", prefix="test-par2", max_seq_len=64, parallel=ParallelConfig(tp=2)
        ) as two,
    ):
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


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat[1]) == pid and b"services.engine.parallel.worker" in cmd:
                out.append(int(d.name))
    return out


def test_a_dead_rank_takes_the_service_down(pair: tuple[Server, Server]) -> None:
    """Last in this module: it ends the 2-rank service."""
    _one, two = pair
    [worker] = _children(two.proc.pid)
    os.kill(worker, signal.SIGKILL)
    assert two.proc.wait(timeout=60) == 1
    assert "engine ranks failed" in two.log.read_text()


def test_sigterm_stops_every_rank(redis_url: str, tmp_path: Path) -> None:
    """A clean stop: the service releases its worker (exit 0) and exits 0 itself."""
    m = load_config(CONFIG_DIR / "debug.toml").model
    d = save_weights_dir(m, build_model(m, seed=5).state_dict(), tmp_path / "step_0", {"version": 0})
    with decode_server(
        redis_url, d, m, tmp_path, prefix="test-par-stop", max_seq_len=64, parallel=ParallelConfig(tp=2)
    ) as s:
        [worker] = _children(s.proc.pid)
        post(s, "/v1/generate", {"input_ids": [5, 6], "sampling": {"max_tokens": 3}})
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=60) == 0
        assert (
            not Path(f"/proc/{worker}").exists() or "Z" in Path(f"/proc/{worker}/stat").read_text().split()[2]
        )
