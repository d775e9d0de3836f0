"""The OpenAI API as RL clients use it, through the official `openai` package against a real decode
service (a subprocess over HTTP): vLLM's `return_token_ids` on completions and chat completions
(whole and streamed), `/tokenize` and `/detokenize` in vLLM's shapes, `/v1/chat/completions/tokens`,
`models.retrieve`, `tool_choice` (a named function or "required" with one tool is honoured, what
cannot be honoured is a 400 naming the field), and log-probs that show special tokens' real text,
one entry per requested top log-prob.

Two models: the debug char model (random weights; its `<pad>`, `<eos>`, `<unk>` specials are what
used to collide in `top_logprobs`), and a bigram chat model (tests/helpers/bigram_chat.py) that
writes known turns, so a forced tool call is checked to the argument."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from helpers.bigram_chat import IM_END, bigram_chat_dir, bigram_model_config
from helpers.decode_server import Server, decode_server

from services.common.auth import auth_headers, token_from_env
from services.common.config import CONFIG_DIR, load_config
from services.common.tokenizer import load_tokenizer
from trainer.model import build_model, save_weights_dir

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
ARGS = '{"city": "paris"}}'
CLOSE = "\n</tool_call>"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "current weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
OTHER = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def debug(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("oai-debug")
    m = load_config(CONFIG_DIR / "debug.toml").model
    state = build_model(m, seed=4).state_dict()
    state["norm.weight"] = state["norm.weight"] * 0.3  # spread-out distributions
    d = save_weights_dir(m, state, tmp / "step_0", {"version": 0})
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    with decode_server(redis_url, d, m, tmp, prefix="test-oai", max_seq_len=128, run_name="relay-oai") as s:
        yield s


@pytest.fixture(scope="module")
def bigram(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("oai-bigram")
    # After the generation prompt ("...assistant\n") the model says "Hi"; after a forced call's
    # opening (ending '"arguments": ') it writes the arguments and closes the call.
    d = bigram_chat_dir(
        tmp / "step_0", [["\n", "Hi", IM_END], [" ", ARGS, CLOSE, IM_END]], [ARGS, CLOSE, "Hi"]
    )
    with decode_server(
        redis_url, d, bigram_model_config(), tmp, prefix="test-oai-bg", max_seq_len=512, run_name="bigram"
    ) as s:
        yield s


def client(s: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{s.url}/v1", api_key=token_from_env(), max_retries=0)  # the run token


# ------------------------------------------------------------------ token ids


def test_completion_return_token_ids(debug: Server) -> None:
    tok = load_tokenizer(debug.model_dir)
    r = client(debug).completions.create(
        model="relay-oai", prompt="the cat ", max_tokens=12, temperature=1.0, seed=3, n=2, logprobs=2,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    prompt_ids = tok.encode("the cat ", add_special_tokens=False).ids
    for ch in r.choices:
        extra = ch.model_extra or {}
        assert extra["prompt_token_ids"] == prompt_ids
        ids = extra["token_ids"]
        assert len(ids) == 12 and tok.decode(ids) == ch.text
        assert ch.logprobs is not None and len(ch.logprobs.token_logprobs) == len(ids)
        assert extra["weight_versions"] == [0] * 12
    assert r.usage is not None and r.usage.prompt_tokens == len(prompt_ids)
    # Without the flag nothing extra comes back.
    plain = client(debug).completions.create(model="relay-oai", prompt="the cat ", max_tokens=4)
    assert "token_ids" not in (plain.choices[0].model_extra or {})


def test_chat_return_token_ids_and_logprobs_align(debug: Server) -> None:
    tok = load_tokenizer(debug.model_dir)
    msgs = [{"role": "user", "content": "hi there"}]
    r = client(debug).chat.completions.create(
        model="relay-oai", messages=msgs, max_tokens=10, logprobs=True, top_logprobs=3, seed=1,  # type: ignore[arg-type]
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    rendered = "<user>hi there\n<assistant>"
    assert (r.model_extra or {})["prompt_token_ids"] == tok.encode(rendered, add_special_tokens=False).ids
    ch = r.choices[0]
    ids = (ch.model_extra or {})["token_ids"]
    assert ch.logprobs is not None and ch.logprobs.content is not None
    assert len(ch.logprobs.content) == len(ids) and 1 <= len(ids) <= 10
    # Every token's real text, the EOS included, and one top entry per requested log-prob.
    assert [c.token for c in ch.logprobs.content] == [tok.decode([t], skip_special_tokens=False) for t in ids]
    for c in ch.logprobs.content:
        assert len(c.top_logprobs) == 3 and len({t.token for t in c.top_logprobs}) == 3


def test_chat_stream_return_token_ids(debug: Server) -> None:
    msgs = [{"role": "user", "content": "abc"}]
    body = dict(model="relay-oai", messages=msgs, max_tokens=15, seed=5, temperature=1.0)
    whole = client(debug).chat.completions.create(**body, extra_body={"return_token_ids": True})  # type: ignore[call-overload]
    chunks = list(
        client(debug).chat.completions.create(**body, stream=True, extra_body={"return_token_ids": True})  # type: ignore[call-overload]
    )
    prompt = [
        c.model_extra["prompt_token_ids"] for c in chunks if "prompt_token_ids" in (c.model_extra or {})
    ]
    assert prompt == [(whole.model_extra or {})["prompt_token_ids"]]
    ids = [t for c in chunks for ch in c.choices for t in (ch.model_extra or {}).get("token_ids") or []]
    assert ids == (whole.choices[0].model_extra or {})["token_ids"]
    assert (
        "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
        == whole.choices[0].message.content
    )


def test_chat_completions_tokens_route(debug: Server) -> None:
    """The prompt as ids (verifiers' token client): the same output as rendering the messages."""
    tok = load_tokenizer(debug.model_dir)
    msgs = [{"role": "user", "content": "xyz"}]
    ids = tok.encode("<user>xyz\n<assistant>", add_special_tokens=False).ids
    body = {
        "model": "relay-oai",
        "messages": msgs,
        "max_tokens": 8,
        "temperature": 0,
        "return_token_ids": True,
    }
    by_text = httpx.post(
        f"{debug.url}/v1/chat/completions", json=body, timeout=60, headers=auth_headers()
    ).json()
    by_ids = httpx.post(
        f"{debug.url}/v1/chat/completions/tokens",
        json={**body, "tokens": ids},
        timeout=60,
        headers=auth_headers(),
    ).json()
    assert by_ids["prompt_token_ids"] == ids == by_text["prompt_token_ids"]
    assert by_ids["choices"][0]["token_ids"] == by_text["choices"][0]["token_ids"]
    bad = httpx.post(
        f"{debug.url}/v1/chat/completions/tokens",
        json={**body, "tokens": [10**6]},
        timeout=60,
        headers=auth_headers(),
    )
    assert bad.status_code == 400 and bad.json()["detail"].startswith("tokens:")


# ------------------------------------------------------------------ tokenize, models


def test_tokenize_and_detokenize(debug: Server) -> None:
    tok = load_tokenizer(debug.model_dir)
    c = client(debug)
    r = c.post("/../tokenize", body={"model": "relay-oai", "prompt": "abc d"}, cast_to=httpx.Response)
    out = r.json()
    assert out["tokens"] == tok.encode("abc d").ids and out["count"] == 5 and out["max_model_len"] == 128
    chat = httpx.post(
        f"{debug.url}/tokenize",
        json={"messages": [{"role": "user", "content": "q"}], "return_token_strs": True},
        headers=auth_headers(),
    ).json()
    assert chat["tokens"] == tok.encode("<user>q\n<assistant>", add_special_tokens=False).ids
    assert "".join(chat["token_strs"]) == "<user>q\n<assistant>"
    no_gen = httpx.post(
        f"{debug.url}/tokenize",
        json={"messages": [{"role": "user", "content": "q"}], "add_generation_prompt": False},
        headers=auth_headers(),
    ).json()
    assert no_gen["tokens"] == tok.encode("<user>q\n", add_special_tokens=False).ids
    back = httpx.post(
        f"{debug.url}/detokenize", json={"tokens": out["tokens"]}, headers=auth_headers()
    ).json()
    assert back == {"prompt": "abc d"}
    for path, body, field in [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": ["x"]}, "tokens"),
    ]:
        bad = httpx.post(f"{debug.url}{path}", json=body, headers=auth_headers())
        assert bad.status_code in (400, 422), (path, body, bad.text)
        assert field in bad.text


def test_models_retrieve(debug: Server) -> None:
    c = client(debug)
    m = c.models.retrieve("relay-oai")
    assert m.id == "relay-oai" and (m.model_extra or {})["max_model_len"] == 128
    assert [x.id for x in c.models.list()] == ["relay-oai"]
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-5")


# ------------------------------------------------------------------ log-prob token texts


def test_top_logprobs_one_entry_each_with_special_texts(debug: Server) -> None:
    """The char model's specials (<pad>, <eos>, <unk>) used to all read "" and collide."""
    c = client(debug)
    r = c.completions.create(
        model="relay-oai", prompt="a", max_tokens=6, logprobs=20, seed=0, extra_body={"ignore_eos": True}
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None
    assert all(len(top) == 20 for top in lp.top_logprobs)
    assert any(k in ("<pad>", "<eos>", "<unk>") for top in lp.top_logprobs for k in top)
    chat = c.chat.completions.create(
        model="relay-oai", messages=[{"role": "user", "content": "a"}], max_tokens=6, logprobs=True, top_logprobs=20,
        seed=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(len({t.token for t in e.top_logprobs}) == 20 for e in content)
    as_ids = (
        c.completions.create(
            model="relay-oai",
            prompt="a",
            max_tokens=3,
            logprobs=2,
            extra_body={"return_tokens_as_token_ids": True},
        )
        .choices[0]
        .logprobs
    )
    assert as_ids is not None and all(t.startswith("token_id:") for t in as_ids.tokens or [])


# ------------------------------------------------------------------ tool_choice


def test_tool_choice_named_function_is_honoured(bigram: Server) -> None:
    c = client(bigram)
    msgs = [{"role": "user", "content": "weather?"}]
    auto = c.chat.completions.create(model="bigram", messages=msgs, tools=TOOLS, temperature=0)  # type: ignore[arg-type]
    assert auto.choices[0].message.content == "Hi" and not auto.choices[0].message.tool_calls
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        r = c.chat.completions.create(
            model="bigram", messages=msgs, tools=TOOLS, tool_choice=choice, temperature=0,  # type: ignore[arg-type]
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        (call,) = ch.message.tool_calls or []
        assert call.function.name == "get_weather"  # type: ignore[union-attr]
        assert json.loads(call.function.arguments) == {"city": "paris"}  # type: ignore[union-attr]
        # The forced opening is prompt (not sampled): the sampled ids are the arguments onwards.
        tok = load_tokenizer(bigram.model_dir)
        assert (
            tok.decode((ch.model_extra or {})["token_ids"], skip_special_tokens=False)
            == ARGS + CLOSE + IM_END
        )
    # Streamed: the same call in the choice's last content chunk.
    chunks = list(
        c.chat.completions.create(
            model="bigram",
            messages=msgs,
            tools=TOOLS,
            tool_choice="required",
            temperature=0,
            stream=True,  # type: ignore[arg-type]
        )
    )
    calls = [tc for ch in chunks for x in ch.choices for tc in x.delta.tool_calls or []]
    assert [tc.function.name for tc in calls] == ["get_weather"]  # type: ignore[union-attr]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_returns_text(bigram: Server) -> None:
    r = client(bigram).chat.completions.create(
        model="bigram",
        messages=[{"role": "user", "content": "x"}],
        tools=TOOLS,
        tool_choice="none",
        temperature=0,  # type: ignore[arg-type]
    )
    assert r.choices[0].message.content == "Hi" and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "tools,choice,why",
    [
        ([*TOOLS, OTHER], "required", "'required' with 2 tools"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "'nope' is not among tools"),
        (None, "required", "needs `tools`"),
        (TOOLS, "sometimes", "expected 'none', 'auto'"),
    ],
)
def test_tool_choice_refused_with_400(bigram: Server, tools: list | None, choice: object, why: str) -> None:
    kw = {} if tools is None else {"tools": tools}
    with pytest.raises(openai.BadRequestError) as e:
        client(bigram).chat.completions.create(
            model="bigram",
            messages=[{"role": "user", "content": "x"}],
            tool_choice=choice,
            **kw,  # type: ignore[arg-type]
        )
    detail = e.value.response.json()["detail"]
    assert detail.startswith("tool_choice:") and why in detail
