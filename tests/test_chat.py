"""ChatTemplate renders exactly what transformers' apply_chat_template renders, from the same
model directory (tokenizer.json + tokenizer_config.json), for plain chats, tool definitions,
assistant tool calls and tool results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from services.common.chat import ChatTemplate, ChatTemplateError
from services.common.tokenizer import build_char_tokenizer, save_tokenizer

# A ChatML template with tools in the style of Qwen2.5/Qwen3's: namespaces, loop controls,
# tojson, raise_exception and special-token variables all get exercised.
CHATML_TOOLS = """
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=0) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
        {%- continue %}
    {%- elif message.role == 'user' or message.role == 'system' %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {{- tool_call.arguments if tool_call.arguments is string else tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- else %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
{{- '' if eos_token is defined else raise_exception('no eos_token variable') }}
"""

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "Run a shell command <in the sandbox> & return 'stdout'",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
        },
    }
]

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "system", "content": "you can run commands"},
        {"role": "user", "content": "list files"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "run", "arguments": {"cmd": "ls"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt\nb.txt"},
        {"role": "tool", "tool_call_id": "c2", "content": "ünïcode ✓"},
        {"role": "assistant", "content": "two files"},
        {"role": "user", "content": "thanks"},
    ],
]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    save_tokenizer(build_char_tokenizer(), tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHATML_TOOLS
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("gen", [True, False])
def test_matches_transformers(
    model_dir: Path, conv: int, tools: list[dict[str, Any]] | None, gen: bool
) -> None:
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    messages = CONVERSATIONS[conv]
    expected = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=False)
    tpl = ChatTemplate.from_model_dir(model_dir)
    assert tpl is not None
    got = tpl.render(messages, tools=tools, add_generation_prompt=gen)
    assert got == expected
    assert "<|im_start|>" in got and (got.endswith("<|im_start|>assistant\n") == gen)
    if tools:
        # tojson must not HTML-escape (jinja's built-in filter would turn < into \u003c)
        assert "<in the sandbox> & return 'stdout'" in got


def test_no_template_gives_none(tmp_path: Path) -> None:
    save_tokenizer(build_char_tokenizer(), tmp_path)
    assert ChatTemplate.from_model_dir(tmp_path) is None
    assert ChatTemplate.from_model_dir(tmp_path / "missing") is None


def test_named_templates_and_jinja_file(tmp_path: Path) -> None:
    """tokenizer_config.json may hold a list of named templates ("tool_use" is picked when tools
    are given); a chat_template.jinja file, as newer snapshots ship, replaces the default."""
    cfg = {
        "eos_token": {"content": "<eos>", "lstrip": False},
        "chat_template": [
            {"name": "default", "template": "D{{ messages[0].content }}{{ eos_token }}"},
            {"name": "tool_use", "template": "T{{ tools | length }}{{ messages[0].content }}"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tpl = ChatTemplate.from_model_dir(tmp_path)
    assert tpl is not None
    msgs = [{"role": "user", "content": "x"}]
    assert tpl.render(msgs) == "Dx<eos>"
    assert tpl.render(msgs, tools=TOOLS) == "T1x"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    tpl = ChatTemplate.from_model_dir(tmp_path)
    assert tpl is not None and tpl.render(msgs) == "J1"


def test_template_errors_are_chat_template_errors(model_dir: Path) -> None:
    tpl = ChatTemplate.from_model_dir(model_dir)
    assert tpl is not None
    with pytest.raises(ChatTemplateError, match="unknown role"):
        tpl.render([{"role": "user", "content": "a"}, {"role": "narrator", "content": "b"}])


def test_sandbox_blocks_attribute_escapes(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ messages.__class__.__mro__[1].__subclasses__() }}"})
    )
    tpl = ChatTemplate.from_model_dir(tmp_path)
    assert tpl is not None
    with pytest.raises(ChatTemplateError):
        tpl.render([{"role": "user", "content": "a"}])


def test_extra_template_variables(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": "{{ 'think' if enable_thinking is not defined or enable_thinking else 'no' }}"}
        )
    )
    tpl = ChatTemplate.from_model_dir(tmp_path)
    assert tpl is not None
    msgs = [{"role": "user", "content": "a"}]
    assert tpl.render(msgs) == "think"
    assert tpl.render(msgs, variables={"enable_thinking": False}) == "no"


def test_generation_tag_renders_its_body_like_transformers(tmp_path: Path) -> None:
    save_tokenizer(build_char_tokenizer(), tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}[{{ m.content }}]"
        "{% endgeneration %}{% else %}({{ m.content }}){% endif %}{% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    expected = AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(msgs, tokenize=False)
    tpl = ChatTemplate.from_model_dir(tmp_path)
    assert tpl is not None and tpl.render(msgs, add_generation_prompt=False) == expected == "(q)[a]"


def test_broken_template_is_a_chat_template_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}"}))
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate.from_model_dir(tmp_path)
