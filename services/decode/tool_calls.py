"""OpenAI `tool_calls` out of generated text, for /v1/chat/completions requests that give `tools`.

Models of the Hermes / Qwen family write calls as `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>` blocks (services/common/tools.py, the project's parser, reads each block). A block
that parses becomes an OpenAI tool call and leaves the content; a malformed one (bad JSON, no
name, unterminated) stays in `content` verbatim, so nothing the model wrote is lost and nothing
raises. Calls are not checked against the request's schemas (as vLLM's hermes parser): the
client decides what to do with a call to a tool it did not offer.

The content of a tools request is the text without the parsed blocks, stripped of surrounding
whitespace (the blocks sit on their own lines). `StreamedContent` emits a prefix of exactly that
string while tokens arrive, holding back anything that may still turn out to be a call, so the
streamed content equals the whole response's.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from services.common.tools import CLOSE, OPEN, ToolCall, parse_tool_calls


@dataclass(frozen=True)
class ParsedTurn:
    content: str
    calls: list[ToolCall]


def split_tool_calls(text: str) -> ParsedTurn:
    """The content (text outside well-formed call blocks, stripped) and the calls, in order."""
    pieces: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while (start := text.find(OPEN, pos)) >= 0:
        end = text.find(CLOSE, start + len(OPEN))
        stop = len(text) if end < 0 else end + len(CLOSE)
        block = text[start:stop]
        # One block at a time through the project's parser: it decides what a valid call is.
        _, parsed = parse_tool_calls(block)
        pieces.append(text[pos:start])
        if len(parsed) == 1 and isinstance(parsed[0], ToolCall):
            calls.append(parsed[0])
        else:
            pieces.append(block)  # malformed: the client sees exactly what the model wrote
        pos = stop
    pieces.append(text[pos:])
    return ParsedTurn("".join(pieces).strip(), calls)


def openai_tool_calls(calls: list[ToolCall], with_index: bool = False) -> list[dict[str, Any]]:
    """OpenAI's shape: id, type "function", function.name, function.arguments (a JSON string).
    Stream deltas carry each call's `index` as well."""
    out = []
    for i, c in enumerate(calls):
        item: dict[str, Any] = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        out.append({"index": i, **item} if with_index else item)
    return out


def finish_reason(engine_reason: str | None, calls: list[ToolCall]) -> str | None:
    """ "tool_calls" when the model ended its turn with calls; a turn cut by max_tokens stays
    "length" (its calls are still returned), as truncation is what the client must know about."""
    return "tool_calls" if calls and engine_reason == "stop" else engine_reason


def _open_prefix_at_end(text: str) -> int:
    """Length of the longest proper prefix of OPEN that `text` ends with (0: none)."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0


def safe_content_prefix(text: str, holdback: int) -> str:
    """The part of the final content that is already certain while `text` is still growing:
    everything before the first call block (or a partial `<tool_call>` at the end), minus the
    stop-string holdback, without leading whitespace and up to its last non-space character
    (whitespace may still be stripped if a block follows)."""
    cut = len(text) - holdback
    start = text.find(OPEN)
    if start >= 0:
        cut = min(cut, start)
    else:
        cut = min(cut, len(text) - _open_prefix_at_end(text))
    return text[: max(cut, 0)].strip()


def tool_names(tools: list[dict[str, Any]] | None) -> list[str]:
    """The function names a request's `tools` offer (OpenAI shape: {"type": "function",
    "function": {"name": ...}}; a bare {"name": ...} is read too)."""
    names = []
    for t in tools or []:
        fn = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.append(fn["name"])
    return names
