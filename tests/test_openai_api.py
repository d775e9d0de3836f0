"""The decode service's OpenAI surface over real HTTP (a decode subprocess on the debug model, whose
directory carries a chat template): /v1/completions and /v1/chat/completions, whole and streamed
(SSE), stop strings, top-n log-probs, usage, /v1/models, and 4xx errors naming the field."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from helpers.decode_server import Server, decode_server, sse_events, wait_for

from services.common.auth import auth_headers
from services.common.chat import ChatTemplate
from services.common.config import CONFIG_DIR, load_config
from services.common.tokenizer import load_tokenizer
from trainer.model import build_model, save_weights_dir

# Only characters the debug (char) tokenizer knows.
TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if tools %}<tools>{{ tools | length }}\n{% endif %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
MAX_LEN = 96


@pytest.fixture(scope="module")
def server(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("openai")
    m = load_config(CONFIG_DIR / "debug.toml").model
    state = build_model(m, seed=4).state_dict()
    state["norm.weight"] = state["norm.weight"] * 0.3  # spread-out distributions (see test_engine)
    d = save_weights_dir(m, state, tmp / "step_0", {"version": 0})
    tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "chat_template": TEMPLATE}))
    with decode_server(
        redis_url, d, m, tmp, prefix="test-openai", max_seq_len=MAX_LEN, run_name="relay-openai"
    ) as s:
        yield s


def post(s: Server, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{s.url}{path}", json=body, timeout=60, headers=auth_headers())


def stream(s: Server, path: str, body: dict[str, Any]) -> list[Any]:
    """The parsed `data:` events of an SSE response from `path`, without the [DONE] terminator."""
    return sse_events(f"{s.url}{path}", body)


def joined(events: list[dict[str, Any]], n: int, chat: bool) -> tuple[list[str], list[str | None]]:
    texts, finish = [""] * n, [None] * n
    for ev in events:
        for c in ev["choices"]:
            texts[c["index"]] += (c["delta"].get("content") or "") if chat else c["text"]
            if c["finish_reason"] is not None:
                assert finish[c["index"]] is None, "a choice finished twice"
                finish[c["index"]] = c["finish_reason"]
    return texts, finish  # type: ignore[return-value]


# ------------------------------------------------------------------ completions


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0, "max_tokens": 30, "ignore_eos": True},
        {"temperature": 1.0, "seed": 7, "max_tokens": 25, "n": 3},
        {"temperature": 0.9, "top_k": 10, "min_p": 0.05, "seed": 2, "max_tokens": 20, "n": 2},
    ],
)
def test_completion_stream_equals_whole(server: Server, sampling: dict[str, Any]) -> None:
    body = {"prompt": "the cat sat ", **sampling}
    whole = post(server, "/v1/completions", body)
    assert whole.status_code == 200, whole.text
    out = whole.json()
    events = stream(server, "/v1/completions", body)
    n = sampling.get("n", 1)
    texts, finish = joined(events, n, chat=False)
    assert texts == [c["text"] for c in out["choices"]]
    assert finish == [c["finish_reason"] for c in out["choices"]]
    assert all(e["object"] == "text_completion" and e["id"].startswith("cmpl-") for e in events)
    assert len(events) > n  # really incremental, not one chunk per choice
    if sampling.get("ignore_eos"):
        assert len(out["choices"][0]["text"]) == 30 and out["choices"][0]["finish_reason"] == "length"


def test_completion_usage_counts(server: Server) -> None:
    tok = load_tokenizer(server.model_dir)
    prompt = "count me: 12345"
    out = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 9, "n": 2, "seed": 1}).json()
    ids = tok.encode(prompt, add_special_tokens=False).ids
    u = out["usage"]
    assert u["prompt_tokens"] == len(ids)
    assert 2 <= u["completion_tokens"] <= 18  # one finish may be an early EOS
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    events = stream(
        server,
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 9, "n": 2, "seed": 1, "stream_options": {"include_usage": True}},
    )
    assert events[-1]["choices"] == [] and events[-1]["usage"] == u


def test_completion_stop_strings_whole_and_streamed(server: Server) -> None:
    greedy = {"prompt": "a: ", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    full = post(server, "/v1/completions", greedy).json()["choices"][0]["text"]
    assert len(full) == 40
    for stop in (full[12:14], full[20:23]):  # spanning two and three tokens
        cut = full.find(stop)
        body = {**greedy, "stop": [stop, "~~~"]}
        ch = post(server, "/v1/completions", body).json()["choices"][0]
        assert ch["text"] == full[:cut] and ch["finish_reason"] == "stop"
        texts, finish = joined(stream(server, "/v1/completions", body), 1, chat=False)
        assert texts == [full[:cut]] and finish == ["stop"]


def test_completion_top_logprobs(server: Server) -> None:
    body = {
        "prompt": "xyz",
        "max_tokens": 8,
        "temperature": 0.7,
        "seed": 5,
        "logprobs": 4,
        "ignore_eos": True,
    }
    ch = post(server, "/v1/completions", body).json()["choices"][0]
    lp = ch["logprobs"]
    # Special tokens show their own text ("<eos>", or "token_id:N" past the tokenizer's vocabulary,
    # as vLLM does) but add nothing to the returned text; the others join to exactly the text.
    specials = {"<pad>", "<eos>", "<unk>"}
    assert (
        "".join(t for t in lp["tokens"] if t not in specials and not t.startswith("token_id:")) == ch["text"]
    )
    assert (
        len(lp["tokens"])
        == len(lp["token_logprobs"])
        == len(lp["top_logprobs"])
        == len(lp["text_offset"])
        == 8
    )
    for top in lp["top_logprobs"]:
        values = list(top.values())
        # the 4 most likely tokens of the char tokenizer decode to 4 distinct strings (top-n
        # log-probs are the model's, before temperature: docs/serving.md)
        assert len(values) == 4 and values == sorted(values, reverse=True), top
        assert all(v <= 0 for v in values) and sum(math.exp(v) for v in values) <= 1 + 1e-5
    # streamed chunks carry the same per-token log-probs
    events = stream(server, "/v1/completions", body)
    streamed = [
        v for e in events for c in e["choices"] if c["logprobs"] for v in c["logprobs"]["token_logprobs"]
    ]
    assert streamed == pytest.approx(lp["token_logprobs"], abs=1e-6)


# ------------------------------------------------------------------ chat


def chat_body(**kw: Any) -> dict[str, Any]:
    return {
        "model": "whatever",
        "messages": [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hello there"}],
        **kw,
    }


def test_chat_prompt_is_the_rendered_template(server: Server) -> None:
    tok = load_tokenizer(server.model_dir)
    tpl = ChatTemplate.from_model_dir(server.model_dir)
    assert tpl is not None
    body = chat_body(max_tokens=5, seed=3)
    out = post(server, "/v1/chat/completions", body).json()
    rendered = tpl.render(body["messages"])
    assert rendered == "<system>be nice\n<user>hello there\n<assistant>"
    assert out["usage"]["prompt_tokens"] == len(tok.encode(rendered, add_special_tokens=False).ids)
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    assert out["model"] == "relay-openai"
    msg = out["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    # tools reach the template; content parts are joined
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    parts = [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]
    body2 = {**body, "tools": tools, "messages": [body["messages"][0], {"role": "user", "content": parts}]}
    out2 = post(server, "/v1/chat/completions", body2).json()
    assert out2["usage"]["prompt_tokens"] == out["usage"]["prompt_tokens"] + len("<tools>1\n")


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0, "max_tokens": 24, "ignore_eos": True},
        {"temperature": 1.0, "seed": 11, "max_completion_tokens": 20, "n": 2},
    ],
)
def test_chat_stream_equals_whole(server: Server, sampling: dict[str, Any]) -> None:
    body = chat_body(**sampling)
    out = post(server, "/v1/chat/completions", body).json()
    events = stream(server, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    n = sampling.get("n", 1)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    first = [e for e in events if e["choices"] and "role" in e["choices"][0]["delta"]]
    assert sorted(e["choices"][0]["index"] for e in first) == list(range(n))
    texts, finish = joined(events[:-1], n, chat=True)
    assert texts == [c["message"]["content"] for c in out["choices"]]
    assert finish == [c["finish_reason"] for c in out["choices"]]
    assert events[-1]["usage"] == out["usage"]


def test_chat_stop_and_logprobs(server: Server) -> None:
    base = chat_body(temperature=0, max_tokens=30, ignore_eos=True)
    full = post(server, "/v1/chat/completions", base).json()["choices"][0]["message"]["content"]
    stop = full[9:11]
    body = {**base, "stop": stop, "logprobs": True, "top_logprobs": 3}
    ch = post(server, "/v1/chat/completions", body).json()["choices"][0]
    assert ch["message"]["content"] == full[: full.find(stop)] and ch["finish_reason"] == "stop"
    content = ch["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == ch["message"]["content"]
    for c in content:
        assert len(c["top_logprobs"]) == 3 and c["bytes"] == list(c["token"].encode())
        # greedy: the chosen token is the most likely one
        assert c["top_logprobs"][0]["logprob"] == pytest.approx(c["logprob"], abs=1e-5)
    texts, finish = joined(stream(server, "/v1/chat/completions", body), 1, chat=True)
    assert texts == [ch["message"]["content"]] and finish == ["stop"]


def generated_tokens(s: Server) -> float:
    text = httpx.get(f"{s.url}/metrics").text
    line = next(ln for ln in text.splitlines() if ln.startswith("relay_decode_generated_tokens_total"))
    return float(line.split()[-1])


def test_client_disconnect_aborts_the_stream(server: Server) -> None:
    """A client that goes away mid-stream frees its slots instead of generating to max_tokens: 8
    samples to the end of the context would be about 8 * MAX_LEN tokens; the client leaves after
    the first content chunk and the replica stops far short of that."""
    before = generated_tokens(server)
    body = chat_body(max_tokens=MAX_LEN, n=8, ignore_eos=True, stream=True, logprobs=True, top_logprobs=5)
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json=body, timeout=30, headers=auth_headers()
    ) as r:
        assert r.status_code == 200
        lines = (json.loads(line.removeprefix("data: ")) for line in r.iter_lines() if line)
        assert next(lines)["choices"][0]["delta"]["role"] == "assistant"
        next(ev for ev in lines if ev["choices"] and ev["choices"][0]["delta"].get("content"))
        # leaving the block closes the connection mid-generation
    wait_for(
        lambda: (h := httpx.get(f"{server.url}/health").json())["queue"] == 0 and h["running"] == 0,
        what="aborted request gone",
    )
    time.sleep(0.3)  # a request that kept running would keep adding tokens
    made = generated_tokens(server) - before
    assert 0 < made < 8 * MAX_LEN // 2, made


def test_paused_replica_answers_503(server: Server) -> None:
    """New requests to a paused replica get 503 with Retry-After on every generation route (the
    caller retries, or another replica serves them); /resume lets them in again."""
    assert post(server, "/pause", {}).json()["paused"] is True
    try:
        for path, body in (
            ("/v1/completions", {"prompt": "abc", "max_tokens": 2}),
            ("/v1/chat/completions", chat_body(max_tokens=2)),
            ("/v1/chat/completions", chat_body(max_tokens=2, stream=True)),
            ("/v1/generate", {"input_ids": [5, 6], "sampling": {"max_tokens": 2}}),
        ):
            r = post(server, path, body)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", (path, r.text)
            assert "paused" in r.json()["detail"]
        assert httpx.get(f"{server.url}/health").json()["paused"] is True
    finally:
        assert post(server, "/resume", {}).json()["paused"] is False
    assert post(server, "/v1/completions", {"prompt": "abc", "max_tokens": 2}).status_code == 200


# ------------------------------------------------------------------ models and errors


def test_models(server: Server) -> None:
    data = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert data[0]["id"] == "relay-openai" and data[0]["max_model_len"] == MAX_LEN


@pytest.mark.parametrize(
    ("path", "body", "status", "field"),
    [
        ("/v1/completions", {"prompt": "a", "temperature": -1}, 422, "temperature"),
        ("/v1/completions", {"prompt": "a", "min_p": 2}, 422, "min_p"),
        ("/v1/completions", {"prompt": "a", "logprobs": 50}, 422, "logprobs"),
        ("/v1/completions", {"prompt": [3, 999]}, 400, "prompt: token id 999"),
        ("/v1/completions", {"prompt": "a" * MAX_LEN}, 400, "prompt: prompt has"),
        ("/v1/completions", {"prompt": "a", "stream": True, "max_tokens": 0}, 422, "max_tokens"),
        ("/v1/completions", {"prompt": [3] * MAX_LEN, "stream": True}, 400, "prompt: prompt has"),
        ("/v1/chat/completions", {"messages": []}, 422, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 422, "messages.0.role"),
        ("/v1/chat/completions", chat_body(top_logprobs=2), 422, "top_logprobs"),
        ("/v1/chat/completions", chat_body(top_p=0), 422, "top_p"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            400,
            "messages.0.content",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * MAX_LEN}]}, 400, "messages"),
        # The engine's limits hold on every route (one schema: services/common/schemas.py).
        ("/v1/completions", {"prompt": "a", "stop": [f"s{i}" for i in range(17)]}, 422, "stop"),
        ("/v1/chat/completions", chat_body(stop=[f"s{i}" for i in range(17)]), 422, "stop"),
        ("/v1/completions", {"prompt": "a", "stop": "x" * 1025}, 422, "stop"),
        ("/v1/generate", {"input_ids": [3], "sampling": {"stop": [f"s{i}" for i in range(17)]}}, 422, "stop"),
        # The request's own template variables cannot come in again as template kwargs.
        *(
            ("/v1/chat/completions", chat_body(chat_template_kwargs={k: 1}), 422, "chat_template_kwargs")
            for k in ("messages", "tools", "add_generation_prompt")
        ),
        ("/tokenize", {"prompt": "a", "chat_template_kwargs": {"messages": []}}, 422, "chat_template_kwargs"),
    ],
)
def test_bad_input_is_4xx_naming_the_field(
    server: Server, path: str, body: dict[str, Any], status: int, field: str
) -> None:
    r = post(server, path, body)
    assert r.status_code == status, r.text
    assert field in r.json()["detail"], r.text


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/completions", '{"prompt": "a", "temperature": NaN}', "temperature"),
        ("/v1/completions", '{"prompt": "a", "top_p": Infinity}', "top_p"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "a"}], "min_p": -Infinity}',
            "min_p",
        ),
        ("/v1/generate", '{"input_ids": [3], "sampling": {"temperature": Infinity}}', "sampling.temperature"),
        ("/v1/generate", '{"input_ids": [NaN]}', "input_ids.0"),
    ],
)
def test_non_finite_numbers_are_a_422_naming_the_field(
    server: Server, path: str, body: str, field: str
) -> None:
    """Python's JSON parser takes NaN and Infinity; they are refused, and the 422 that echoes them
    back is itself valid JSON (non-finite numbers as strings)."""
    r = httpx.post(
        f"{server.url}{path}",
        content=body,
        headers={"content-type": "application/json", **auth_headers()},
        timeout=30,
    )
    assert r.status_code == 422, r.text
    out = json.loads(r.text)  # strict JSON: no NaN literal in the answer
    assert field in out["detail"], out
    assert any(str(e.get("input")) in ("nan", "inf", "-inf") for e in out["errors"]), out


def test_max_tokens_past_the_context_ends_with_length(server: Server) -> None:
    """A max_tokens far past the context is clamped to what the context leaves: the choice ends
    there with finish_reason "length". (1e30, a float, is no integer: a 422 naming max_tokens.)"""
    huge = 10**30
    for path, body in (
        ("/v1/completions", {"prompt": "abc", "max_tokens": huge, "ignore_eos": True}),
        ("/v1/chat/completions", chat_body(max_tokens=huge, ignore_eos=True)),
        ("/v1/chat/completions", chat_body(max_completion_tokens=huge, ignore_eos=True, stream=True)),
    ):
        if body.get("stream"):
            texts, finish = joined(stream(server, path, body), 1, chat=True)
            assert finish == ["length"]
            continue
        r = post(server, path, body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["choices"][0]["finish_reason"] == "length"
        assert out["usage"]["total_tokens"] == MAX_LEN
    gen = post(
        server, "/v1/generate", {"input_ids": [3, 4], "sampling": {"max_tokens": huge, "ignore_eos": True}}
    )
    assert gen.status_code == 200, gen.text
    ch = gen.json()["choices"][0]
    assert ch["finish_reason"] == "length" and len(ch["output_ids"]) == MAX_LEN - 2
    r = httpx.post(
        f"{server.url}/v1/completions",
        content='{"prompt": "a", "max_tokens": 1e30}',
        headers={"content-type": "application/json", **auth_headers()},
    )
    assert r.status_code == 422 and "max_tokens" in r.json()["detail"]


def test_a_huge_prompt_is_refused_before_it_is_tokenised(server: Server) -> None:
    """A text many times the context is refused after tokenising a few pieces of it, off the event
    loop: /health answers meanwhile, and the answer comes long before a full tokenisation."""
    prompt = "ab " * 2_000_000  # 6 MB
    done: dict[str, httpx.Response] = {}
    t0 = time.monotonic()
    worker = threading.Thread(
        target=lambda: done.setdefault(
            "r", post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
        )
    )
    worker.start()
    health_s = []
    while worker.is_alive():
        h0 = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        health_s.append(time.monotonic() - h0)
    worker.join()
    took = time.monotonic() - t0
    r = done["r"]
    assert r.status_code == 400 and r.json()["detail"].startswith("prompt: over"), r.text[:300]
    assert took < 10, took
    assert max(health_s) < 2.0, health_s
    big = post(server, "/v1/completions", {"prompt": "a" * (17 << 20), "max_tokens": 1})
    assert big.status_code == 413 and "decode.max_request_bytes" in big.json()["detail"]
