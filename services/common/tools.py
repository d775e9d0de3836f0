"""Tool calling in the Hermes / Qwen style: tool specs -> system text, model text -> tool calls,
tool results -> observation text.

The model writes calls as JSON objects inside tags, any number per turn:

    I'll look at the file first.
    <tool_call>
    {"name": "read_file", "arguments": {"path": "calc.py"}}
    </tool_call>

`parse_tool_calls` never raises: each malformed block (bad JSON, no name, arguments that are not
an object, an unterminated tag, an unknown tool, a missing required argument) becomes a
`ToolCallError` that `run_tool_calls` turns into an error observation for the model to read, so
a bad call costs the model a turn, never the rollout. Results go back as text
(`render_tool_results`) which the orchestrator tokenises and masks out of the loss; the model's
own tokens are never re-tokenised (services/orchestrator/rollout.py).

Two observation formats:
- "plain": `<tool_response>...</tool_response>` blocks, for tokenizers without a chat template
  (the debug char tokenizer).
- "qwen": closes the assistant turn and opens a user turn holding the responses, then reopens the
  assistant turn, exactly as Qwen2.5/Qwen3's chat template renders role "tool" messages.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


@dataclass(frozen=True)
class ToolSpec:
    """One tool, described with a JSON-schema object of parameters (OpenAI function format)."""

    name: str
    description: str
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def as_json(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolCallError:
    message: str
    raw: str = ""
    name: str = ""


@dataclass(frozen=True)
class ToolResult:
    name: str
    content: str
    error: bool = False


def render_tools_prompt(tools: list[ToolSpec]) -> str:
    """The tool section of the system prompt, worded as Qwen2.5/Qwen3's chat template does."""
    specs = "\n".join(json.dumps(t.as_json(), ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{specs}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _check_args(spec: ToolSpec, args: dict[str, Any]) -> str | None:
    schema = spec.parameters
    props: Mapping[str, Any] = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in args]
    if missing:
        return f"missing required argument(s) {', '.join(missing)}"
    for k, v in args.items():
        if k not in props:
            if schema.get("additionalProperties", True) is False:
                return f"unknown argument {k!r} (expected: {', '.join(props) or 'none'})"
            continue
        want = props[k].get("type")
        types = _JSON_TYPES.get(want) if isinstance(want, str) else None
        if types is None:
            continue
        ok = isinstance(v, types) and not (want in ("integer", "number") and isinstance(v, bool))
        if not ok:
            return f"argument {k!r} must be {want}, got {type(v).__name__}"
    return None


def parse_tool_calls(
    text: str, tools: list[ToolSpec] | None = None, max_calls: int = 16
) -> tuple[str, list[ToolCall | ToolCallError]]:
    """Split model text into (the text outside tool-call blocks, the calls in order).

    With `tools`, calls to unknown names and arguments that do not fit the schema are
    `ToolCallError`s too. More than `max_calls` blocks: the extra ones are one error."""
    specs = {t.name: t for t in tools} if tools is not None else None
    calls: list[ToolCall | ToolCallError] = []
    content = _BLOCK.sub("", text).strip()
    blocks = list(_BLOCK.finditer(text))
    for i, m in enumerate(blocks):
        if i == max_calls:
            calls.append(
                ToolCallError(f"too many tool calls in one turn (at most {max_calls}); the rest were ignored")
            )
            break
        body, closed = m.group(1).strip(), bool(m.group(2))
        if not closed:
            calls.append(ToolCallError(f"unterminated {OPEN} (no {CLOSE})", body[:200]))
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCallError(f"tool call is not valid JSON: {e.msg} at char {e.pos}", body[:200]))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            calls.append(ToolCallError('tool call must be a JSON object with a string "name"', body[:200]))
            continue
        name = obj["name"]
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models emit the arguments JSON-encoded
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass
        if args is None:
            args = {}
        if not isinstance(args, dict):
            calls.append(
                ToolCallError(
                    f'"arguments" must be a JSON object, got {type(args).__name__}', body[:200], name
                )
            )
            continue
        if specs is not None:
            spec = specs.get(name)
            if spec is None:
                calls.append(
                    ToolCallError(f"unknown tool {name!r}; available: {', '.join(specs)}", body[:200], name)
                )
                continue
            problem = _check_args(spec, args)
            if problem:
                calls.append(ToolCallError(f"{name}: {problem}", body[:200], name))
                continue
        calls.append(ToolCall(name, args))
    return content, calls


def run_tool_calls(
    calls: list[ToolCall | ToolCallError],
    handlers: Mapping[str, Callable[..., str]],
) -> list[ToolResult]:
    """Execute parsed calls in order with `handlers[name](**arguments)`; errors and exceptions
    become error results. Never raises (a handler bug is reported to the model, not the caller)."""
    out: list[ToolResult] = []
    for c in calls:
        if isinstance(c, ToolCallError):
            out.append(ToolResult(c.name or "error", f"error: {c.message}", error=True))
            continue
        fn = handlers.get(c.name)
        if fn is None:
            out.append(
                ToolResult(c.name, f"error: unknown tool {c.name!r}; available: {', '.join(handlers)}", True)
            )
            continue
        try:
            out.append(ToolResult(c.name, str(fn(**c.arguments))))
        except TypeError as e:
            out.append(ToolResult(c.name, f"error: bad arguments for {c.name}: {e}", error=True))
        except Exception as e:
            out.append(ToolResult(c.name, f"error: {c.name} failed: {type(e).__name__}: {e}", error=True))
    return out


def render_tool_results(results: list[ToolResult], fmt: Literal["plain", "qwen"] = "plain") -> str:
    """Tool results as the observation text appended after the model's turn."""
    body = "\n".join(f"<tool_response>\n{r.content}\n</tool_response>" for r in results)
    if fmt == "qwen":
        return f"<|im_end|>\n<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"
    return f"\n{body}\n"


# --------------------------------------------------------------------------- tool-call dialects

# How a model writes its calls. "hermes": the <tool_call> JSON blocks above (Qwen, Llama, the
# debug model). "kimi_k2": Kimi-K2's special-token sections, each call with an id the chat
# template quotes back with its result ("## Return of functions.read_file:0"):
#   <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
#   {"json": "arguments"}<|tool_call_end|>...<|tool_calls_section_end|>
Dialect = Literal["hermes", "kimi_k2"]
KIMI_SECTION_BEGIN, KIMI_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN, KIMI_ARGS_BEGIN, KIMI_CALL_END = (
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
_KIMI_SECTION = re.compile(
    re.escape(KIMI_SECTION_BEGIN) + r"(.*?)(" + re.escape(KIMI_SECTION_END) + r"|$)", re.DOTALL
)
_KIMI_CALL = re.compile(
    re.escape(KIMI_CALL_BEGIN)
    + r"\s*(.*?)\s*"
    + re.escape(KIMI_ARGS_BEGIN)
    + r"(.*?)("
    + re.escape(KIMI_CALL_END)
    + r"|$)",
    re.DOTALL,
)


def dialect_of(special_tokens: set[str] | frozenset[str]) -> Dialect:
    """The dialect of a tokenizer, from its special tokens: Kimi-K2's sections are tokens of their own."""
    return "kimi_k2" if KIMI_SECTION_BEGIN in special_tokens else "hermes"


def kimi_call_name(call_id: str) -> str:
    """`functions.read_file:0` -> `read_file` (the id is `functions.NAME:INDEX`)."""
    name = call_id.rsplit(":", 1)[0] if ":" in call_id else call_id
    return name.removeprefix("functions.")


def kimi_to_hermes(text: str) -> tuple[str, list[str]]:
    """A Kimi-K2 turn's text (decoded with its special tokens) as the Hermes text tool environments
    parse, and the call ids in order. Each call becomes one <tool_call> block holding
    {"name", "arguments"}; arguments that are not JSON are kept verbatim (the environment's parser
    reports them), and a call the model did not finish stays an unterminated block."""
    ids: list[str] = []

    def section(m: re.Match[str]) -> str:
        blocks = []
        for call in _KIMI_CALL.finditer(m.group(1)):
            call_id, raw, closed = call.group(1), call.group(2).strip(), bool(call.group(3))
            ids.append(call_id)
            name = json.dumps(kimi_call_name(call_id), ensure_ascii=False)
            try:
                args = json.dumps(json.loads(raw) if raw else {}, ensure_ascii=False)
            except json.JSONDecodeError:
                args = raw
            body = f'{{"name": {name}, "arguments": {args}}}'
            blocks.append(f"{OPEN}\n{body}\n{CLOSE}" if closed else f"{OPEN}\n{body}")
        return "\n" + "\n".join(blocks) + "\n"

    return _KIMI_SECTION.sub(section, text), ids
