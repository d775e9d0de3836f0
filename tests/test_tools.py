"""Hermes/Qwen-style tool-call parsing and rendering (services/common/tools.py)."""

from __future__ import annotations

import json

import pytest

from services.common.tools import (
    ToolCall,
    ToolCallError,
    ToolResult,
    ToolSpec,
    parse_tool_calls,
    render_tool_results,
    render_tools_prompt,
    run_tool_calls,
)

READ = ToolSpec(
    "read_file",
    "Read a file",
    {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
)
BASH = ToolSpec(
    "bash",
    "Run a command",
    {
        "type": "object",
        "properties": {"cmd": {"type": "string"}, "timeout_s": {"type": "number"}},
        "required": ["cmd"],
        "additionalProperties": False,
    },
)
TOOLS = [READ, BASH]


def call(name: str, **args: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def test_parses_one_and_many_calls() -> None:
    text = "Let me look.\n" + call("read_file", path="a.py") + "\nthen\n" + call("bash", cmd="ls -la")
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "Let me look.\n\nthen"
    assert calls == [ToolCall("read_file", {"path": "a.py"}), ToolCall("bash", {"cmd": "ls -la"})]


def test_no_calls_is_plain_text() -> None:
    assert parse_tool_calls("just an answer", TOOLS) == ("just an answer", [])


def test_string_encoded_arguments_and_no_arguments() -> None:
    text = '<tool_call>{"name": "bash", "arguments": "{\\"cmd\\": \\"pwd\\"}"}</tool_call>'
    assert parse_tool_calls(text, TOOLS)[1] == [ToolCall("bash", {"cmd": "pwd"})]
    assert parse_tool_calls('<tool_call>{"name": "x"}</tool_call>')[1] == [ToolCall("x", {})]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", 'string "name"'),
        ('<tool_call>{"arguments": {}}</tool_call>', 'string "name"'),
        ('<tool_call>{"name": "bash", "arguments": [1]}</tool_call>', '"arguments" must be a JSON object'),
        ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "unknown tool 'rm_rf'"),
        ('<tool_call>{"name": "bash", "arguments": {}}</tool_call>', "missing required argument(s) cmd"),
        ('<tool_call>{"name": "bash", "arguments": {"cmd": 3}}</tool_call>', "'cmd' must be string"),
        (
            '<tool_call>{"name": "bash", "arguments": {"cmd": "ls", "x": 1}}</tool_call>',
            "unknown argument 'x'",
        ),
        ('<tool_call>{"name": "bash", "arguments": {"cmd": "ls"}', "unterminated"),
        ("<tool_call></tool_call>", "not valid JSON"),
    ],
)
def test_malformed_calls_are_errors_not_crashes(text: str, needle: str) -> None:
    _, calls = parse_tool_calls(text, TOOLS)
    assert len(calls) == 1 and isinstance(calls[0], ToolCallError)
    assert needle in calls[0].message
    results = run_tool_calls(calls, {"bash": lambda cmd: cmd, "read_file": lambda path: path})
    assert results[0].error and results[0].content.startswith("error: ")


def test_garbage_never_raises() -> None:
    for text in [
        "<tool_call>",
        "</tool_call>",
        "<tool_call><tool_call>{}</tool_call>",
        "\x00" * 10,
        "{" * 1000,
    ]:
        parse_tool_calls(text, TOOLS)


def test_too_many_calls() -> None:
    _, calls = parse_tool_calls(call("bash", cmd="true") * 5, TOOLS, max_calls=3)
    assert len(calls) == 4 and isinstance(calls[3], ToolCallError) and "too many" in calls[3].message


def test_run_tool_calls_handler_errors() -> None:
    def boom(cmd: str) -> str:
        raise RuntimeError("disk on fire")

    _, calls = parse_tool_calls(call("bash", cmd="x") + call("read_file", path="p"), TOOLS)
    res = run_tool_calls(calls, {"bash": boom, "read_file": lambda path: f"<{path}>"})
    assert res[0] == ToolResult("bash", "error: bash failed: RuntimeError: disk on fire", True)
    assert res[1] == ToolResult("read_file", "<p>")
    # No schema given: a wrong keyword is a TypeError from the handler, reported, not raised.
    _, calls = parse_tool_calls(call("read_file", nope=1))
    assert run_tool_calls(calls, {"read_file": lambda path: path})[0].error


def test_render_results_and_prompt() -> None:
    res = [ToolResult("bash", "ok"), ToolResult("read_file", "error: x", True)]
    plain = render_tool_results(res)
    assert plain == "\n<tool_response>\nok\n</tool_response>\n<tool_response>\nerror: x\n</tool_response>\n"
    qwen = render_tool_results(res, "qwen")
    assert qwen.startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\nok")
    assert qwen.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    prompt = render_tools_prompt(TOOLS)
    assert "<tools>" in prompt and '"name": "bash"' in prompt and "<tool_call>" in prompt
    specs = prompt.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(s)["function"]["name"] for s in specs] == ["read_file", "bash"]
