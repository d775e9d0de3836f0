"""Chat templates: turn OpenAI-style messages into the prompt text a model was trained on.

A model directory carries its template the way HF ships it: `chat_template` in
tokenizer_config.json (a string, or a list of named templates), or a `chat_template.jinja` file.
It is rendered the way transformers' `apply_chat_template` renders it (sandboxed jinja2 with
trim_blocks/lstrip_blocks, loop controls, a non-HTML-escaping `tojson`, `raise_exception`,
`strftime_now`, and the tokenizer's special tokens as variables), so the prompt text, and hence
the token ids, are the ones the model saw in training.

    tpl = ChatTemplate.from_model_dir("runs/x/weights/step_3")
    text = tpl.render([{"role": "user", "content": "hi"}])
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.common.schemas import REQUEST_TEMPLATE_VARIABLES

# tokenizer_config.json keys exposed to the template as variables (HF's special_tokens_map).
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(ValueError):
    """The template could not be rendered for these messages (e.g. it called raise_exception)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes (<, >, &, '), which would change the prompt text.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which some templates use to mark assistant text
    for HF's assistant-token masks; rendering just emits the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _environment() -> ImmutableSandboxedEnvironment:
    # Templates from the Hub are untrusted code: the sandbox stops attribute tricks.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class ChatTemplate:
    def __init__(self, templates: dict[str, str], special_tokens: dict[str, str] | None = None):
        """templates: name -> jinja source; "default" is used unless tools are given and a
        "tool_use" template exists (HF's rule for named templates)."""
        if not templates:
            raise ValueError("a ChatTemplate needs at least one template")
        self.sources = dict(templates)
        self.special_tokens = dict(special_tokens or {})
        env = _environment()
        try:
            self._compiled = {name: env.from_string(src) for name, src in self.sources.items()}
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ChatTemplate | None:
        """The directory's chat template, or None when it has none. Raises ChatTemplateError
        when it has one that does not compile."""
        p = Path(path)
        cfg: dict[str, Any] = {}
        cfg_file = p / "tokenizer_config.json"
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())
        specials = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(cfg.get(k))) is not None}
        templates: dict[str, str] = {}
        raw = cfg.get("chat_template")
        if isinstance(raw, str):
            templates["default"] = raw
        elif isinstance(raw, list):
            templates.update({t["name"]: t["template"] for t in raw if "name" in t and "template" in t})
        # Newer HF snapshots keep the template in its own file, which takes precedence.
        jinja_file = p / "chat_template.jinja"
        if jinja_file.is_file():
            templates["default"] = jinja_file.read_text()
        if not templates:
            return None
        if "default" not in templates:
            templates["default"] = next(iter(templates.values()))
        return cls(templates, specials)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for `messages` (OpenAI shape: role, content, optional tool_calls ...).
        `tools` are JSON-schema tool definitions, passed to the template as `tools`; `variables`
        (e.g. enable_thinking) are further template variables, as HF's extra keyword arguments,
        and may not name the three above."""
        extra = dict(variables or {})
        taken = sorted(set(extra) & REQUEST_TEMPLATE_VARIABLES)
        if taken:
            raise ChatTemplateError(f"template variables {', '.join(taken)} are set by the request itself")
        name = "tool_use" if tools and "tool_use" in self._compiled else "default"
        context = {
            **self.special_tokens,
            **extra,
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._compiled[name].render(context)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(str(e)) from e
