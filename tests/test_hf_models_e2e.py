"""Real HF chat-model directories end to end.

A small Qwen-style model directory: a tokenizer with `<|endoftext|>`, `<|im_start|>`,
`<|im_end|>` and tool-call words, a ChatML chat template with tools, config.json naming only
`<|endoftext|>` as EOS and generation_config.json adding `<|im_end|>` (as Qwen3 base snapshots do).
Its weights are random except for the parts that make the test deterministic: every layer's
output projections (attention o_proj, MLP down_proj) are zero, so the residual stream is the token
embedding (one-hot) and the model is an exact bigram table written into lm_head. Greedy decoding
after the generation prompt then writes a known assistant turn: text, a well-formed
`<tool_call>`, a malformed one, `<|im_end|>`. It runs through the real engine, the decode
service over HTTP and the orchestrator's RolloutRunner.

Checks: EOS ids from config.json + generation_config.json (engine stops on any of them; the
orchestrator's end-of-turn id comes from the model directory, and a turn ending on any EOS id
ended with EOS for the env); OpenAI `tool_calls` whole and streamed; arch llama3 without QK-norm
(ModelConfig, HF round trip, loader); the trainer's rope-scaled RoPE and its llama3 mapping
against the engine's log-probs.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import torch
from helpers.bigram_chat import ENDOFTEXT, IM_END, IM_START, bigram_chat_dir
from helpers.decode_server import Server, decode_server, sse_events

from services.common.auth import auth_headers
from services.common.chat import ChatTemplate
from services.common.config import (
    ConfigError,
    EngineConfig,
    ModelConfig,
    RopeScaling,
    load_config,
)
from services.common.modeldir import hf_config, model_config_from_hf
from services.common.registry import Registry
from services.common.schemas import (
    GenerateRequest,
    SamplingParams,
    ScoreResponse,
    StepResponse,
)
from services.common.tokenizer import end_of_turn_id, eos_id, load_tokenizer, model_eos_ids
from services.common.tools import ToolResult, ToolSpec, render_tool_results, render_tools_prompt
from services.common.weights_dir import read_model_dir, write_model_dir
from services.decode.tool_calls import ParsedTurn, openai_tool_calls, safe_content_prefix, split_tool_calls
from services.decode.tool_calls import finish_reason as tool_finish_reason
from services.engine import LLMEngine, WeightsError
from services.engine.batch import ForwardBatch, Span
from services.engine.loader import read_checkpoint
from services.orchestrator.clients import DecodeClient, Router
from services.orchestrator.rollout import GroupSpec, RolloutRunner
from trainer.model import build_model, load_weights_dir, save_weights_dir, to_hf_state

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
BAD = '{"name": broken'
WORDS = ["Sure", "<tool_call>", "</tool_call>", CALL, "<tool_call>\n", "</tool_call>\n", BAD]
# The assistant turn the bigram model writes after the generation prompt (which ends with "\n").
CHAIN = ["\n", "Sure", "<tool_call>", CALL, "</tool_call>", "<tool_call>\n", BAD, "</tool_call>\n", IM_END]
TURN_TEXT = "".join(CHAIN[1:-1])
MAX_LEN = 1024

# ChatML with tools, in the shape of Qwen's template (tool results go back in a user turn).
TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{% for t in tools %}{{ '\\n' + (t | tojson) }}{% endfor %}"
    "{{ '\\n</tools><|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
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


def qwen_style_dir(dest: Path, turn_end: str = IM_END) -> Path:
    """The bigram chat model described in the module docstring, as an HF directory; its turns end
    with `turn_end` (<|endoftext|>: a turn that ends on the other EOS id). After <|im_end|> the
    table goes on ("qqq..."): only the generation_config EOS stops there."""
    chains = [[*CHAIN[:-1], turn_end], [IM_END, "q", "q"]]
    d = bigram_chat_dir(dest, chains, WORDS, template=TEMPLATE)
    gen_file = d / "generation_config.json"
    gen_file.write_text(json.dumps({**json.loads(gen_file.read_text()), "temperature": 0.7}))
    return d


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return qwen_style_dir(tmp_path_factory.mktemp("qwen") / "step_0")


def tid(d: Path, token: str) -> int:
    i = load_tokenizer(d).token_to_id(token)
    assert i is not None
    return i


# ------------------------------------------------------------------ 1. EOS ids


def test_eos_ids_from_config_and_generation_config(qwen_dir: Path) -> None:
    eot, im_end = tid(qwen_dir, ENDOFTEXT), tid(qwen_dir, IM_END)
    assert model_eos_ids(qwen_dir) == [eot, im_end]
    assert read_checkpoint(qwen_dir).eos_token_ids == [eot, im_end]
    # The orchestrator's end of turn: what the template closes an assistant turn with.
    tok = load_tokenizer(qwen_dir)
    assert end_of_turn_id(qwen_dir, tok, ChatTemplate.from_model_dir(qwen_dir)) == im_end
    # Without a template: tokenizer_config's eos_token.
    assert end_of_turn_id(qwen_dir, tok, None) == eot


def test_char_debug_model_end_of_turn_unchanged(model_dir: Path) -> None:
    tok = load_tokenizer(model_dir)
    assert model_eos_ids(model_dir) == [eos_id(tok)]
    assert end_of_turn_id(model_dir, tok, ChatTemplate.from_model_dir(model_dir)) == eos_id(tok)
    # A template that does not end turns with an EOS token (tests/test_openai_api.py's) falls back.
    tpl = ChatTemplate({"default": "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"})
    assert end_of_turn_id(model_dir, tok, tpl) == eos_id(tok)


def test_bad_generation_config_eos_is_a_weights_error(qwen_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "w"
    write_model_dir(
        d, read_model_dir(qwen_dir)[1], json.loads((qwen_dir / "config.json").read_text()), qwen_dir, {}
    )
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": ["<|im_end|>"]}))
    with pytest.raises(WeightsError, match="generation_config.json: eos_token_id"):
        read_checkpoint(d)


def test_engine_stops_on_every_model_eos(qwen_dir: Path) -> None:
    eng = LLMEngine(qwen_dir, EngineConfig(device="cpu", max_batch_size=4, max_seq_len=MAX_LEN))
    tok = load_tokenizer(qwen_dir)
    greedy = SamplingParams(temperature=0, max_tokens=20)
    turn = tok.encode(f"{IM_START}assistant\n", add_special_tokens=False).ids
    plain = tok.encode("ab", add_special_tokens=False).ids
    chat, other, ignored = eng.generate(
        [
            GenerateRequest(input_ids=turn, sampling=greedy),  # ends with generation_config's <|im_end|>
            GenerateRequest(input_ids=plain, sampling=greedy),  # ends with config.json's <|endoftext|>
            GenerateRequest(input_ids=turn, sampling=greedy.model_copy(update={"ignore_eos": True})),
        ]
    )
    (c,) = chat.choices
    assert c.finish_reason == "stop" and c.output_ids[-1] == tid(qwen_dir, IM_END)
    assert tok.decode(c.output_ids) == TURN_TEXT
    assert other.choices[0].output_ids == [tid(qwen_dir, ENDOFTEXT)]
    assert other.choices[0].finish_reason == "stop"
    ig = ignored.choices[0]
    assert ig.finish_reason == "length" and len(ig.output_ids) == 20
    assert tok.decode(ig.output_ids).endswith("qqq")


# ------------------------------------------------------------------ decode over HTTP


@pytest.fixture(scope="module")
def server(redis_url: str, qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = read_checkpoint(qwen_dir).config
    tmp = tmp_path_factory.mktemp("qwen-decode")
    with decode_server(
        redis_url, qwen_dir, model, tmp, prefix="test-hf", max_seq_len=MAX_LEN, run_name="relay-qwen-style"
    ) as s:
        yield s


def chat(s: Server, **kw: Any) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": "weather in paris?"}], "temperature": 0, **kw}
    r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=60, headers=auth_headers())
    assert r.status_code == 200, r.text
    return dict(r.json())


# ------------------------------------------------------------------ 2. tool calls


def test_chat_tool_calls_whole(server: Server) -> None:
    out = chat(server, tools=TOOLS)
    (ch,) = out["choices"]
    assert ch["finish_reason"] == "tool_calls"
    msg = ch["message"]
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert isinstance(call["function"]["arguments"], str)
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    # The malformed block stays in content, verbatim; the well-formed one is gone.
    assert msg["content"] == 'Sure<tool_call>\n{"name": broken</tool_call>'
    assert out["usage"]["completion_tokens"] == len(CHAIN) - 1


def test_chat_without_tools_keeps_raw_text(server: Server) -> None:
    (ch,) = chat(server)["choices"]
    assert ch["message"] == {"role": "assistant", "content": TURN_TEXT}
    assert ch["finish_reason"] == "stop"


def test_chat_truncated_call_stays_content(server: Server) -> None:
    """max_tokens cuts the turn inside the first block: unterminated, so no call; "length"."""
    (ch,) = chat(server, tools=TOOLS, max_tokens=3)["choices"]
    assert ch["message"] == {"role": "assistant", "content": "Sure<tool_call>" + CALL}
    assert ch["finish_reason"] == "length"
    (ch,) = chat(server, tools=TOOLS, max_tokens=4)["choices"]  # complete call, turn not ended
    assert ch["finish_reason"] == "length" and ch["message"]["content"] == "Sure"
    assert json.loads(ch["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize("extra", [{}, {"max_tokens": 3}, {"n": 2, "logprobs": True}])
def test_chat_tool_calls_streamed(server: Server, extra: dict[str, Any]) -> None:
    body = {
        "messages": [{"role": "user", "content": "weather in paris?"}],
        "temperature": 0,
        "tools": TOOLS,
        **extra,
    }
    whole = chat(server, **{k: v for k, v in body.items() if k != "messages"})
    events = sse_events(f"{server.url}/v1/chat/completions", body)
    n = extra.get("n", 1)
    texts, finish = [""] * n, [None] * n
    calls: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    for ev in events:
        assert ev["object"] == "chat.completion.chunk"
        for c in ev["choices"]:
            i = c["index"]
            assert finish[i] is None, "nothing after a choice's finish reason"
            texts[i] += c["delta"].get("content") or ""
            calls[i] += c["delta"].get("tool_calls", [])
            if c["finish_reason"] is not None:
                assert c["delta"] == {}  # the finish reason comes in its own last chunk
                finish[i] = c["finish_reason"]
    for i, ch in enumerate(whole["choices"]):
        assert texts[i] == (ch["message"]["content"] or "")
        assert finish[i] == ch["finish_reason"]
        want = ch["message"].get("tool_calls", [])
        assert [(c["index"], c["function"]) for c in calls[i]] == [
            (j, w["function"]) for j, w in enumerate(want)
        ]
        assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls[i])
    if extra.get("logprobs"):
        streamed = [
            c for e in events for ch in e["choices"] if ch["logprobs"] for c in ch["logprobs"]["content"]
        ]
        assert len(streamed) == n * (len(CHAIN) - 1)


TEXTS = [
    'I will look.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
    '<tool_call>\n{"name": "b", "arguments": "{\\"y\\": [2]}"}\n</tool_call>',
    '  <tool_call>{"name": "a"}</tool_call>  then <tool_call>{nope}</tool_call> tail <tool_cal',
    "no calls at all, just <tool text> and < signs",
    '<tool_call>{"name": "a", "arguments": [1]}</tool_call><tool_call>{"name": "c"',
]


@pytest.mark.parametrize("text", TEXTS)
def test_split_tool_calls_and_stream_prefixes(text: str) -> None:
    """Every content prefix a stream may send while the text grows is a prefix of the final
    content, so streamed and whole responses agree for any token boundaries."""
    final = split_tool_calls(text)
    for end in range(len(text) + 1):
        for holdback in (0, 2):
            assert final.content.startswith(safe_content_prefix(text[:end], holdback)), (end, holdback)


def test_split_tool_calls_cases() -> None:
    t0 = split_tool_calls(TEXTS[0])
    assert t0.content == "I will look." and [(c.name, c.arguments) for c in t0.calls] == [
        ("a", {"x": 1}),
        ("b", {"y": [2]}),  # JSON-encoded arguments are decoded, as services/common/tools.py does
    ]
    t1 = split_tool_calls(TEXTS[1])
    assert [c.name for c in t1.calls] == ["a"]
    assert t1.content == "then <tool_call>{nope}</tool_call> tail <tool_cal"
    assert split_tool_calls(TEXTS[2]) == ParsedTurn(TEXTS[2], [])
    t3 = split_tool_calls(TEXTS[3])  # arguments not an object; unterminated: both stay content
    assert t3.calls == [] and t3.content == TEXTS[3]
    (call,) = openai_tool_calls(t0.calls[:1])
    assert call["type"] == "function" and json.loads(call["function"]["arguments"]) == {"x": 1}
    assert tool_finish_reason("stop", t0.calls) == "tool_calls"
    assert tool_finish_reason("length", t0.calls) == "length"
    assert tool_finish_reason("stop", []) == "stop"


# ------------------------------------------------------------------ 1. orchestrator end of turn


class ToolEpisode:
    """A tool environment's session as the sandbox service would serve it (the Hermes prompt,
    plain `<tool_response>` observations): answers the first turn with a tool result, ends on the
    second. Records every action and whether the model ended its turn."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, bool]] = []
        self.closed = False
        spec = ToolSpec("get_weather", "current weather", TOOLS[0]["function"]["parameters"])
        self._prompt = render_tools_prompt([spec]) + "\n\nweather in paris?"

    @property
    def prompt(self) -> str:
        return self._prompt

    async def step(self, action: str, eos: bool) -> StepResponse:
        self.steps.append((action, eos))
        if len(self.steps) == 2:
            self.closed = True
            return StepResponse(observation="", done=True, reward=1.0)
        obs = render_tool_results([ToolResult("get_weather", "sunny, 21 C")], "plain")
        return StepResponse(observation=obs, done=False)

    async def score(self) -> ScoreResponse:
        self.closed = True
        return ScoreResponse(reward=0.0, info={})

    async def close(self) -> None:
        self.closed = True


class EpisodeSandbox:
    def __init__(self) -> None:
        self.sessions: list[ToolEpisode] = []

    async def open_group(self, env: str, seed: int, n: int) -> list[ToolEpisode]:
        self.sessions = [ToolEpisode() for _ in range(n)]
        return self.sessions


def test_orchestrator_turns_end_with_im_end(server: Server) -> None:
    """RolloutRunner over real HTTP decode with the end-of-turn id loop.py derives from the model
    directory: <|im_end|> is recognised as the end of the turn, stripped from the action, and the
    chat template's continuation (which starts after <|im_end|>) lines up."""
    d = server.model_dir
    tok = load_tokenizer(d)
    template = ChatTemplate.from_model_dir(d)
    eot = end_of_turn_id(d, tok, template)
    cfg = server.cfg.model_copy(deep=True)
    cfg.orchestrator.group_size = 2
    cfg.orchestrator.sampling.max_tokens = 16
    cfg.orchestrator.sampling.temperature = 0.0

    async def run() -> tuple[Any, EpisodeSandbox]:
        async with aiohttp.ClientSession(headers=auth_headers()) as http:
            decode = DecodeClient(http, Router(Registry(server.bus.services), "decode"))
            sandbox = EpisodeSandbox()
            runner = RolloutRunner(cfg, decode, sandbox, tok, eot, chat=template)  # type: ignore[arg-type]
            return await runner.run(GroupSpec("g-im-end", "tool-env", 7)), sandbox

    group, sandbox = asyncio.run(run())
    im_end = tid(d, IM_END)
    for s, episode in zip(group.samples, sandbox.sessions, strict=True):
        assert s.finish_reason == "done" and s.reward == 1.0 and s.turns == 2
        assert episode.steps == [(TURN_TEXT, True), (TURN_TEXT, True)]
        trained = [t for t, m in zip(s.tokens, s.loss_mask, strict=True) if m]
        assert trained.count(im_end) == 2 and trained[-1] == im_end
        text = tok.decode(s.tokens, skip_special_tokens=False)
        # The observation continues after the model's <|im_end|> exactly as the template renders it.
        assert "</tool_call>\n<|im_end|>\n<|im_start|>user\n<tool_response>\nsunny, 21 C\n" in text
        assert text.endswith(f"{TURN_TEXT}{IM_END}")


@pytest.fixture(scope="module")
def endoftext_server(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Decode serving the bigram chat model whose turns end with <|endoftext|>: config.json's EOS
    id and the second of generation_config.json's two, not the template's <|im_end|>."""
    d = qwen_style_dir(tmp_path_factory.mktemp("qwen-eot") / "step_0", turn_end=ENDOFTEXT)
    tmp = tmp_path_factory.mktemp("qwen-eot-decode")
    model = read_checkpoint(d).config
    with decode_server(redis_url, d, model, tmp, prefix="test-hf-eot", max_seq_len=MAX_LEN) as s:
        yield s


@pytest.mark.parametrize("use_template", [True, False], ids=["chat-template", "plain-text"])
def test_orchestrator_turn_ending_on_another_eos_id(endoftext_server: Server, use_template: bool) -> None:
    """A turn the engine ends on an EOS id other than the end-of-turn one (generation_config.json
    lists <|im_end|> and <|endoftext|>; the model writes the second) ended with EOS: the env gets
    eos=True and the action without the EOS text. With the chat template the <|endoftext|> token
    stays in the sample where the model put it and the template's <|im_end|> follows as
    environment text, so the conversation goes on token-exact. The runner is built as loop.py
    builds it, from the model directory."""
    d = endoftext_server.model_dir
    tok = load_tokenizer(d)
    eot, im_end = tid(d, ENDOFTEXT), tid(d, IM_END)
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == [im_end, eot]
    cfg = endoftext_server.cfg.model_copy(deep=True)
    cfg.orchestrator.group_size = 2
    cfg.orchestrator.sampling.max_tokens = 16
    cfg.orchestrator.sampling.temperature = 0.0

    async def run() -> tuple[Any, EpisodeSandbox, RolloutRunner]:
        async with aiohttp.ClientSession(headers=auth_headers()) as http:
            decode = DecodeClient(http, Router(Registry(endoftext_server.bus.services), "decode"))
            sandbox = EpisodeSandbox()
            runner = RolloutRunner.for_model_dir(cfg, decode, sandbox, d)  # type: ignore[arg-type]
            if not use_template:
                runner.chat = None  # the env's prompt and observations go in as plain text
            return await runner.run(GroupSpec("g-endoftext", "tool-env", 7)), sandbox, runner

    group, sandbox, runner = asyncio.run(run())
    for s, episode in zip(group.samples, sandbox.sessions, strict=True):
        assert s.finish_reason == "done" and s.reward == 1.0 and s.turns == 2
        trained = [t for t, m in zip(s.tokens, s.loss_mask, strict=True) if m]
        text = tok.decode(s.tokens, skip_special_tokens=False)
        assert trained.count(eot) == 2 and trained[-1] == eot and im_end not in trained
        assert text.endswith(f"{TURN_TEXT}{ENDOFTEXT}")
        if use_template:
            assert episode.steps == [(TURN_TEXT, True), (TURN_TEXT, True)]
            # The model's <|endoftext|>, then the template's own close of the turn and the tool turn.
            assert (
                f"</tool_call>\n{ENDOFTEXT}{IM_END}\n{IM_START}user\n<tool_response>\nsunny, 21 C\n" in text
            )
        else:
            # The plain prompt ends with "?", which the bigram table answers with <|endoftext|> at once.
            assert episode.steps == [("", True), (TURN_TEXT, True)]
            assert f"?{ENDOFTEXT}\n<tool_response>\nsunny, 21 C\n</tool_response>\n" in text
    assert runner.eos == im_end and runner.eos_ids == {im_end, eot}


# ------------------------------------------------------------------ 3. llama3 has no QK-norm


def test_llama3_qk_norm_defaults_off_and_true_is_an_error() -> None:
    assert ModelConfig(arch="llama3").qk_norm is False
    assert ModelConfig(arch="qwen3").qk_norm is True
    with pytest.raises(ValueError, match="qk_norm: arch llama3"):
        ModelConfig(arch="llama3", qk_norm=True)
    with pytest.raises(ConfigError, match="qk_norm"):
        load_config("debug", ["--model.arch=llama3"])  # debug.toml says qk_norm = true


def test_llama3_hf_round_trip() -> None:
    m = ModelConfig(
        arch="llama3", vocab_size=97, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, rope_theta=5e5,
        rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=32), tie_embeddings=False,
    )  # fmt: skip
    hf = hf_config(m, 1)
    assert hf["model_type"] == "llama" and hf["architectures"] == ["LlamaForCausalLM"]
    assert model_config_from_hf(hf) == m


def test_loader_refuses_llama_dir_with_qk_norm(tmp_path: Path) -> None:
    m = ModelConfig(arch="qwen3", tie_embeddings=False)
    hf = to_hf_state(m, build_model(m, seed=0).state_dict())  # has q_norm / k_norm tensors
    cfg = hf_config(ModelConfig(**{**m.model_dump(), "arch": "llama3", "qk_norm": False}), 1)
    d = write_model_dir(tmp_path / "w", hf, cfg, None, {})
    with pytest.raises(WeightsError, match="qk_norm"):
        read_checkpoint(d)


# ------------------------------------------------------------------ 4. trainer rope scaling, llama3


def scaled_llama3() -> ModelConfig:
    return ModelConfig(
        arch="llama3", vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
        hidden_dim=128, max_seq_len=128, rope_theta=10000.0, tie_embeddings=False,
        # small original length: the 100-token sequences below cover all three frequency bands
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=32),
    )  # fmt: skip


@pytest.mark.parametrize("scaled", [True, False])
def test_trainer_matches_engine_llama3(scaled: bool, tmp_path: Path) -> None:
    """The trainer (torchtitan Qwen3 without QK-norm, rope-scaled cache) and the engine (serving
    the LlamaForCausalLM directory the trainer published) compute the same log-probs."""
    m = scaled_llama3() if scaled else scaled_llama3().model_copy(update={"rope_scaling": None})
    tt = build_model(m, seed=1).eval()
    with torch.no_grad():  # init leaves norms at 1: perturb them so they count
        for name, p in tt.named_parameters():
            if "norm" in name:
                p.mul_(1 + 0.3 * torch.randn_like(p))
            if name.endswith(("attention.wq.weight", "attention.wk.weight")):
                p.mul_(4.0)  # sharper attention: positions (RoPE) matter to the output
    d = save_weights_dir(m, tt.state_dict(), tmp_path / "w", {"version": 0})
    assert json.loads((d / "config.json").read_text())["model_type"] == "llama"
    loaded, _ = load_weights_dir(d)
    assert loaded == m
    eng = LLMEngine(d, EngineConfig(device="cpu", max_batch_size=4, max_seq_len=m.max_seq_len))
    assert eng.model_config == m
    tokens = torch.randint(0, m.vocab_size, (2, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = torch.log_softmax(tt(tokens).float(), dim=-1)
    pages = eng.kv.blocks_for(eng.kv.max_seq_len)
    spans = [Span(list(range(i * pages, (i + 1) * pages)), 0, tokens[i].tolist()) for i in range(2)]
    with torch.inference_mode():
        batch = ForwardBatch.build(spans, eng.device, eng.kv.max_seq_len, eng.kv.block_size)
        out = torch.log_softmax(eng.model.logits(eng.model(batch, eng.kv)).float(), dim=-1).view(2, 100, -1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    if scaled:
        # The scaling really changes the function: plain RoPE (torchtitan's own cache) differs.
        plain = build_model(m.model_copy(update={"rope_scaling": None}), seed=1).eval()
        plain.load_state_dict(tt.state_dict())
        with torch.no_grad():
            other = torch.log_softmax(plain(tokens).float(), dim=-1)
        assert (other - ref).abs().max() > 1e-3


def test_trainer_rope_cache_survives_init_weights() -> None:
    """init_weights rebuilds the buffer (e.g. after meta-device construction): still scaled."""
    m = scaled_llama3()
    model = build_model(m, seed=0)
    before = model.rope_cache.clone()
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    torch.testing.assert_close(model.rope_cache, before, atol=0, rtol=0)
    from services.engine.layers.rope import rope_cache

    cos, sin = rope_cache(m.head_dim, m.max_seq_len, m.rope_theta, m.rope_scaling)
    torch.testing.assert_close(model.rope_cache, torch.cat([cos, sin], dim=-1), atol=0, rtol=0)
