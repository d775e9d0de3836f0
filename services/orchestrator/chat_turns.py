"""Tool-environment turns through the model's chat template, with exact token bookkeeping.

A tool environment (swe-lite) speaks the Hermes format in plain text: its prompt is
`render_tools_prompt(tools) + "\\n\\n" + task` and each observation is
`render_tool_results(results, "plain")` (services/common/tools.py). For a model that ships a chat
template, the orchestrator turns these back into what they are (tool schemas, a user message, tool
results; both parses are verified by re-rendering, so nothing is guessed) and renders them
through the template instead, the way the model was trained to see them:

- the first prompt: the template applied to the user message with the tools (the template puts
  the schemas in its system turn), with the generation prompt;
- each observation: the *continuation* of the conversation after the model's turn. The
  conversation is rendered with the current assistant turn as a sentinel; the text after the
  sentinel (the template's end of that turn, minus the end-of-turn token the model itself
  produced) plus what the tool messages and the next generation prompt add is the observation.

The model's tokens are never re-tokenised: only observation text is encoded, and it is appended
after the engine's ids. Before each continuation the template's rendering of the conversation so
far is checked against the exact text the model was given (`text`): a template that renders
earlier turns differently once more turns follow (e.g. one that strips old reasoning) would make
the continuation wrong, so that raises `TemplateMismatch` instead.
"""

from __future__ import annotations

import json
from typing import Any

from services.common.chat import ChatTemplate
from services.common.tools import ToolResult, ToolSpec, render_tool_results, render_tools_prompt

# Stands for the current assistant turn while rendering; NUL bytes never occur in template text.
SENTINEL = "\x00relay-assistant-turn\x00"
_OPEN, _CLOSE = "\n<tool_response>\n", "\n</tool_response>\n"


class TemplateMismatch(ValueError):
    """The template's rendering disagrees with the text the model was already given."""


def parse_tools_prompt(prompt: str) -> tuple[list[dict[str, Any]], str] | None:
    """(tool schemas in OpenAI function format, the user text) of a prompt built as
    `render_tools_prompt(tools) + "\\n\\n" + user`; None for any other prompt."""
    start, end = prompt.find("<tools>\n"), prompt.find("\n</tools>")
    if not prompt.startswith("# Tools\n") or start < 0 or end < start:
        return None
    try:
        schemas = [json.loads(line) for line in prompt[start + len("<tools>\n") : end].split("\n")]
        specs = [
            ToolSpec(f["name"], f.get("description", ""), f["parameters"])
            for f in (s["function"] for s in schemas)
        ]
    except (ValueError, KeyError, TypeError):
        return None
    head = render_tools_prompt(specs) + "\n\n"
    if not prompt.startswith(head):
        return None
    return schemas, prompt[len(head) :]


def parse_tool_observation(observation: str) -> list[str] | None:
    """The tool results' contents of a plain-format observation; None when it is not one."""
    if not (observation.startswith(_OPEN) and observation.endswith(_CLOSE)):
        return None
    inner = observation[len(_OPEN) : -len(_CLOSE)]
    contents = inner.split(_CLOSE + "<tool_response>\n")
    if render_tool_results([ToolResult("", c) for c in contents], "plain") != observation:
        return None
    return contents


def observation_messages(observation: str, call_ids: list[str] | None = None) -> list[dict[str, Any]]:
    """Tool results as role "tool" messages; anything else the env says is a user message.
    `call_ids`: the ids of the calls the model made this turn, in order (Kimi-K2's chat template
    quotes each result's id): result i answers call i, as the environment runs them in order."""
    contents = parse_tool_observation(observation)
    if contents is None:
        return [{"role": "user", "content": observation}]
    ids = call_ids or []
    return [
        {"role": "tool", "content": c} | ({"tool_call_id": ids[i]} if i < len(ids) else {})
        for i, c in enumerate(contents)
    ]


class ChatConversation:
    """One sample's conversation. `text` is exactly the text the model has been given so far."""

    def __init__(self, template: ChatTemplate, tools: list[dict[str, Any]], user: str, eos_text: str):
        self.template, self.tools, self.eos_text = template, tools, eos_text
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": user}]
        self.text = template.render(self.messages, tools=tools, add_generation_prompt=True)

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.template.render(messages, tools=self.tools, add_generation_prompt=generation_prompt)

    def continuation(self, model_text: str, ended_eos: bool, messages: list[dict[str, Any]]) -> str:
        """The observation text that follows the model's turn (`model_text`: its decoded output
        without the end-of-turn token; `ended_eos`: whether it produced that token) when the
        environment answers with `messages`. Does not change the conversation (see `commit`)."""
        turn = [*self.messages, {"role": "assistant", "content": SENTINEL}]
        upto = self._render(turn, False)
        at = upto.find(SENTINEL)
        if at < 0:
            raise TemplateMismatch("the chat template does not render assistant content verbatim")
        if upto[:at] != self.text:
            raise TemplateMismatch(
                "the chat template renders the conversation so far differently from the text the "
                f"model was given (first difference at char {_first_difference(upto[:at], self.text)})"
            )
        tail = upto[at + len(SENTINEL) :]
        after = self._render([*turn, *messages], True)
        if not after.startswith(upto):
            raise TemplateMismatch("the chat template rewrites the assistant turn once a reply follows it")
        if ended_eos:
            if not tail.startswith(self.eos_text):
                raise TemplateMismatch(
                    f"the template ends an assistant turn with {tail[:40]!r}, not the model's "
                    f"end-of-turn token {self.eos_text!r}"
                )
            tail = tail[len(self.eos_text) :]
        return tail + after[len(upto) :]

    def commit(
        self, model_text: str, ended_eos: bool, messages: list[dict[str, Any]], observation: str
    ) -> None:
        """Record the turn and the observation text that was appended after it."""
        self.messages += [{"role": "assistant", "content": model_text}, *messages]
        self.text += model_text + (self.eos_text if ended_eos else "") + observation


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
