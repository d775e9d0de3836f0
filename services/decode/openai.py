"""OpenAI-compatible /v1/completions and /v1/chat/completions on top of token-level generation.

Requests become a GenerateRequest (text encoded with the model directory's tokenizer; chat
messages rendered with its chat template first); the engine detokenises the output and applies
stop strings as it generates (services/engine/detokenizer.py), so this module only shapes the
JSON: whole responses, or SSE chunks built from the progress the engine reports after each step.
Chat requests with `tools` get their `<tool_call>` blocks returned as OpenAI `tool_calls`
(services/decode/tool_calls.py); `tool_choice` naming a function (or "required" with one tool)
starts the assistant turn with that call's opening, so the call is certain.

RL clients (verifiers, prime-rl) use vLLM's extensions, served the same way: `return_token_ids`
(the prompt's and each choice's token ids in the response; log-probs then cover every generated
token, aligned with `token_ids`), `/v1/chat/completions/tokens` (the prompt given as token ids),
`/tokenize` and `/detokenize`. With `return_token_ids` each choice also carries `weight_versions`
(relay's extension: the weight version that sampled each token).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from tokenizers import Tokenizer

from services.common.chat import ChatTemplate, ChatTemplateError
from services.common.schemas import (
    ChatCompletionRequest,
    ChatCompletionTokensRequest,
    CompletionRequest,
    GenerateChoice,
    GenerateRequest,
    GenerateResponse,
    OpenAISampling,
    SamplingParams,
)
from services.common.tools import OPEN
from services.decode.tool_calls import (
    ParsedTurn,
    openai_tool_calls,
    safe_content_prefix,
    split_tool_calls,
    tool_names,
)
from services.decode.tool_calls import finish_reason as tool_finish_reason
from services.engine.sequence import RequestState


class PromptError(ValueError):
    """The request cannot be turned into token ids; `field` names the offending field."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def api_field(engine_field: str, prompt_field: str) -> str:
    """The request field an engine InvalidRequest is about: input_ids is the prompt (or the
    messages), sampling.<x> is the top-level <x>."""
    if engine_field == "input_ids":
        return prompt_field
    return engine_field.removeprefix("sampling.")


def _sampling(req: OpenAISampling, max_tokens: int, logprobs: int | None, detokenize: bool) -> SamplingParams:
    return SamplingParams(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=max(req.top_k, 0),
        min_p=req.min_p,
        max_tokens=max_tokens,
        stop_token_ids=req.stop_token_ids,
        stop=req.stop_strings,
        ignore_eos=req.ignore_eos,
        seed=req.seed,
        n=req.n,
        logprobs=logprobs,
        detokenize=detokenize,
    )


# Text is tokenised in pieces of about this many characters until it is known to fit the context.
PIECE_CHARS = 1 << 16
# What one cut between pieces may change in the token count (a word or number split in two).
CUT_SLACK = 4


def encode_prompt(tokenizer: Tokenizer, text: str, max_seq_len: int, field: str) -> list[int]:
    """`text`'s token ids, refusing a text far over the context before tokenising all of it: a
    long text is first counted piece by piece (cut at whitespace), and once the pieces hold more
    tokens than the context even allowing for every cut, it is a PromptError. Run it off the event
    loop: the exact encode of a text that fits still costs its length."""
    if len(text) > PIECE_CHARS:
        counted, cuts, start = 0, 0, 0
        while start < len(text):
            end = min(start + PIECE_CHARS, len(text))
            if end < len(text):
                space = max(text.rfind(" ", start, end), text.rfind("\n", start, end))
                end = space + 1 if space > start else end
            counted += len(tokenizer.encode(text[start:end], add_special_tokens=False).ids)
            cuts += end < len(text)
            if counted - CUT_SLACK * cuts >= max_seq_len:
                raise PromptError(
                    field,
                    f"over {counted - CUT_SLACK * cuts} tokens after {end} of {len(text)} characters; "
                    f"max_seq_len is {max_seq_len}",
                )
            start = end
    return tokenizer.encode(text, add_special_tokens=False).ids


def to_generate_request(
    req: CompletionRequest, tokenizer: Tokenizer | None, max_seq_len: int
) -> GenerateRequest:
    if isinstance(req.prompt, str):
        if tokenizer is None:
            raise PromptError("prompt", "this model directory has no tokenizer.json; send token ids")
        ids = encode_prompt(tokenizer, req.prompt, max_seq_len, "prompt")
        if not ids:
            raise PromptError("prompt", "encodes to no tokens")
    else:
        ids = list(req.prompt)
    if req.stop_strings and tokenizer is None:
        raise PromptError("stop", "this model directory has no tokenizer.json to match stop strings")
    sampling = _sampling(req, req.max_tokens, req.logprobs, detokenize=tokenizer is not None)
    return GenerateRequest(input_ids=ids, sampling=sampling)


def message_dict(index: int, msg: Any) -> dict[str, Any]:
    d: dict[str, Any] = msg.model_dump()
    content = d.get("content")
    if isinstance(content, list):
        # OpenAI content parts: the templates we serve take text only.
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise PromptError(f"messages.{index}.content", "only text content parts are supported")
            texts.append(part["text"])
        d["content"] = "".join(texts)
    return d


def chat_prompt(req: ChatCompletionRequest, template: ChatTemplate | None) -> str:
    if template is None:
        raise PromptError("messages", "this model directory has no chat template; use /v1/completions")
    messages = [message_dict(i, m) for i, m in enumerate(req.messages)]
    try:
        return template.render(
            messages,
            req.tools,
            add_generation_prompt=req.add_generation_prompt,
            variables=req.chat_template_kwargs,
        )
    except ChatTemplateError as e:
        raise PromptError("messages", f"the chat template rejected them: {e}") from None


def forced_call(req: ChatCompletionRequest) -> str | None:
    """The function `tool_choice` forces, or None ("auto", "none", unset). A name that is not
    among `tools`, a tool_choice without tools, or "required" with several tools (honouring it
    would need constrained decoding over the tool names) is a PromptError naming tool_choice."""
    choice = req.tool_choice
    if choice is None or choice in ("auto", "none"):
        return None
    names = tool_names(req.tools)
    if not names:
        raise PromptError("tool_choice", f"{choice!r} needs `tools`")
    if choice == "required":
        if len(names) != 1:
            raise PromptError(
                "tool_choice",
                f"'required' with {len(names)} tools is not supported (no constrained decoding); "
                "name the function instead",
            )
        return names[0]
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise PromptError("tool_choice", 'expected {"type": "function", "function": {"name": ...}}')
        if name not in names:
            raise PromptError("tool_choice", f"function {name!r} is not among tools ({', '.join(names)})")
        return name
    raise PromptError("tool_choice", f"{choice!r}: expected 'none', 'auto', 'required' or a named function")


def forced_call_text(name: str) -> str:
    """What the assistant turn starts with when `name` is forced: the Hermes call's opening up to
    its arguments, which the model writes (services/common/tools.py's format)."""
    return f'{OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


def to_chat_generate_request(
    req: ChatCompletionRequest, template: ChatTemplate | None, tokenizer: Tokenizer | None, max_seq_len: int
) -> GenerateRequest:
    if tokenizer is None:
        raise PromptError("messages", "this model directory has no tokenizer.json")
    forced = forced_call(req)
    if isinstance(req, ChatCompletionTokensRequest):
        ids = list(req.tokens)
    else:
        ids = encode_prompt(tokenizer, chat_prompt(req, template), max_seq_len, "messages")
        if not ids:
            raise PromptError("messages", "render to no tokens")
    if forced is not None:
        # The forced opening is part of the prompt (not sampled): prompt_token_ids include it.
        ids += tokenizer.encode(forced_call_text(forced), add_special_tokens=False).ids
    # OpenAI's default is "until the context is full"; the engine rejects a prompt that fills it.
    max_tokens = req.max_completion_tokens or req.max_tokens or max(1, max_seq_len - len(ids))
    top = (req.top_logprobs or 0) if req.logprobs else None
    return GenerateRequest(input_ids=ids, sampling=_sampling(req, max_tokens, top, detokenize=True))


# ------------------------------------------------------------------ token-level log-probs


def _text_piece(tokenizer: Tokenizer | None, token: int) -> str:
    # What the token adds to the returned text: special tokens (EOS) add nothing.
    return "" if tokenizer is None else tokenizer.decode([token], skip_special_tokens=True)


def token_str(tokenizer: Tokenizer | None, token: int, as_ids: bool = False) -> str:
    """A token as log-probs show it: its text, special tokens included (`<|im_end|>`, not ""),
    or vLLM's "token_id:<id>" (`return_tokens_as_token_ids`, no tokenizer, or an id it lacks)."""
    if as_ids or tokenizer is None or tokenizer.id_to_token(token) is None:
        # ids past the tokenizer's vocabulary (the model's may be padded) have no text
        return f"token_id:{token}"
    return tokenizer.decode([token], skip_special_tokens=False)


def top_dict(tokenizer: Tokenizer | None, top: list[tuple[int, float]], as_ids: bool) -> dict[str, float]:
    """Completions' {token: logprob} of one position, one entry per top log-prob: two tokens with
    the same text (e.g. halves of one UTF-8 character, both "\ufffd") must not overwrite each
    other, so a repeated text falls back to the token's "token_id:<id>"."""
    out: dict[str, float] = {}
    for t, lp in top:
        key = token_str(tokenizer, t, as_ids)
        out[f"token_id:{t}" if key in out else key] = lp
    return out


def completion_logprobs(
    tokenizer: Tokenizer | None,
    ids: list[int],
    logprobs: list[float],
    tops: list[list[tuple[int, float]]] | None,
    offset: int = 0,
    as_ids: bool = False,
) -> dict[str, Any]:
    """The legacy completions `logprobs` object for these tokens; text offsets start at `offset`."""
    pieces = [token_str(tokenizer, t, as_ids) for t in ids]
    starts = [offset + s for s in [0, *accumulate(len(p) for p in pieces)][: len(pieces)]]
    top_dicts = None
    if tops is not None:
        top_dicts = [top_dict(tokenizer, top, as_ids) for top in tops]
    return {
        "tokens": pieces,
        "token_logprobs": list(logprobs),
        "top_logprobs": top_dicts,
        "text_offset": starts,
    }


def chat_logprobs(
    tokenizer: Tokenizer | None,
    ids: list[int],
    logprobs: list[float],
    tops: list[list[tuple[int, float]]] | None,
    as_ids: bool = False,
) -> dict[str, Any]:
    def entry(token: int, lp: float) -> dict[str, Any]:
        text = token_str(tokenizer, token, as_ids)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    content = []
    for i, (t, lp) in enumerate(zip(ids, logprobs, strict=True)):
        item = entry(t, lp)
        item["top_logprobs"] = [entry(tt, tlp) for tt, tlp in (tops[i] if tops is not None else [])]
        content.append(item)
    return {"content": content}


def _kept_tokens(tokenizer: Tokenizer | None, ch: GenerateChoice) -> int:
    """Output tokens whose text starts before the end of the returned text: with a stop string,
    the tokens that make it up are generated but not part of the text."""
    if ch.stop_str is None or ch.text is None:
        return len(ch.output_ids)
    pieces = [_text_piece(tokenizer, t) for t in ch.output_ids]
    starts = [0, *accumulate(len(p) for p in pieces)][: len(pieces)]
    return sum(1 for s in starts if s < len(ch.text))


def usage(resp: GenerateResponse) -> dict[str, int]:
    completion_tokens = sum(len(c.output_ids) for c in resp.choices)
    return {
        "prompt_tokens": resp.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": resp.prompt_tokens + completion_tokens,
    }


# ------------------------------------------------------------------ whole responses


def _logprob_tokens(
    req: CompletionRequest | ChatCompletionRequest, tokenizer: Tokenizer | None, ch: GenerateChoice
) -> int:
    """How many output tokens the log-probs cover: with `return_token_ids` all of them (aligned
    with `token_ids`, as training needs), else those of the returned text."""
    return len(ch.output_ids) if req.return_token_ids else _kept_tokens(tokenizer, ch)


def _token_fields(req: CompletionRequest | ChatCompletionRequest, ch: GenerateChoice) -> dict[str, Any]:
    if not req.return_token_ids:
        return {}
    return {"token_ids": list(ch.output_ids), "weight_versions": list(ch.versions)}


def to_completion(
    req: CompletionRequest,
    resp: GenerateResponse,
    tokenizer: Tokenizer | None,
    model: str,
    prompt_ids: list[int],
) -> dict[str, Any]:
    choices = []
    for i, ch in enumerate(resp.choices):
        lp = None
        if req.logprobs is not None:
            n = _logprob_tokens(req, tokenizer, ch)
            tops = None if ch.top_logprobs is None else ch.top_logprobs[:n]
            lp = completion_logprobs(
                tokenizer, ch.output_ids[:n], ch.logprobs[:n], tops, as_ids=req.return_tokens_as_token_ids
            )
        choice: dict[str, Any] = {
            "text": ch.text or "",
            "index": i,
            "logprobs": lp,
            "finish_reason": ch.finish_reason,
        }
        if req.return_token_ids:  # vLLM puts the prompt's ids on each completions choice
            choice["prompt_token_ids"] = list(prompt_ids)
        choices.append({**choice, **_token_fields(req, ch)})
    return {
        "id": f"cmpl-{resp.request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(resp),
    }


def parse_turn(req: ChatCompletionRequest, text: str) -> ParsedTurn | None:
    """The tool calls of a chat turn, or None when calls are not parsed (no tools, or
    tool_choice "none"); `parallel_tool_calls: false` keeps only the first call."""
    if not req.tools or req.tool_choice == "none":
        return None
    turn = split_tool_calls(text)
    if req.parallel_tool_calls is False and len(turn.calls) > 1:
        turn = ParsedTurn(turn.content, turn.calls[:1])
    return turn


def to_chat_completion(
    req: ChatCompletionRequest,
    resp: GenerateResponse,
    tokenizer: Tokenizer | None,
    model: str,
    prompt_ids: list[int],
    forced: str = "",
) -> dict[str, Any]:
    """`forced`: the text the assistant turn was started with (tool_choice), part of the prompt."""
    choices = []
    for i, ch in enumerate(resp.choices):
        lp = None
        if req.logprobs:
            n = _logprob_tokens(req, tokenizer, ch)
            tops = None if ch.top_logprobs is None else ch.top_logprobs[:n]
            lp = chat_logprobs(
                tokenizer, ch.output_ids[:n], ch.logprobs[:n], tops, as_ids=req.return_tokens_as_token_ids
            )
        text = forced + (ch.text or "")
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish: str | None = ch.finish_reason
        turn = parse_turn(req, text)
        if turn is not None:
            # Hermes/Qwen <tool_call> blocks become OpenAI tool calls (services/decode/tool_calls.py).
            if turn.calls:
                message = {
                    "role": "assistant",
                    "content": turn.content or None,
                    "tool_calls": openai_tool_calls(turn.calls),
                }
            else:
                message["content"] = turn.content
            finish = tool_finish_reason(ch.finish_reason, turn.calls)
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": lp,
                "finish_reason": finish,
                **_token_fields(req, ch),
            }
        )
    out: dict[str, Any] = {
        "id": f"chatcmpl-{resp.request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(resp),
    }
    if req.return_token_ids:
        out["prompt_token_ids"] = list(prompt_ids)
    return out


# ------------------------------------------------------------------ streaming


@dataclass
class Delta:
    """What one choice gained since the last report."""

    index: int
    ids: list[int]
    logprobs: list[float]
    tops: list[list[tuple[int, float]]] | None
    text: str  # the whole text so far (strings are immutable: safe to hand across threads)
    finish_reason: str | None


class Progress:
    """Called on the engine thread after each step (LLMEngine.watchers): copies what each choice
    gained, so the asyncio side never reads engine state."""

    def __init__(self) -> None:
        self.sent: dict[int, int] = {}

    def __call__(self, state: RequestState) -> list[Delta]:
        deltas = []
        for seq in state.seqs:
            start = self.sent.get(seq.index, 0)
            end = len(seq.output)
            if end == start and seq.finish_reason is None:
                continue
            self.sent[seq.index] = end
            tops = None if seq.top_logprobs is None else [list(t) for t in seq.top_logprobs[start:end]]
            deltas.append(
                Delta(
                    seq.index,
                    seq.output[start:end],
                    seq.logprobs[start:end],
                    tops,
                    seq.text.text if seq.text is not None else "",
                    seq.finish_reason,
                )
            )
        return deltas


def sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


class Stream:
    """Turns progress deltas (and, at the end, the whole response) into OpenAI stream chunks.

    Text that could still turn out to be the start of a stop string (the last len(stop) - 1
    characters) is held back until more text rules it out or the choice finishes, so the streamed
    text always equals the non-streamed one."""

    def __init__(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        tokenizer: Tokenizer | None,
        model: str,
        request_id: str,
        prompt_ids: list[int] | None = None,
        forced: str = "",
    ):
        self.chat = isinstance(req, ChatCompletionRequest)
        # return_token_ids: the prompt's ids on the first chunk (chat: the role chunk; completions:
        # each choice's first chunk), each chunk's new token ids on its choice (vLLM's fields).
        self.prompt_ids = list(prompt_ids or []) if req.return_token_ids else None
        self.forced = forced  # tool_choice: the call opening the turn starts with (in the prompt)
        self.as_ids = req.return_tokens_as_token_ids
        self.req = req
        self.tokenizer = tokenizer
        self.model = model
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())
        self.want_logprobs = bool(req.logprobs) if self.chat else req.logprobs is not None
        self.holdback = max((len(s) for s in req.stop_strings), default=1) - 1
        self.emitted: dict[int, int] = {}  # chars of text sent per choice
        # Chat with tools: content is the text minus parsed call blocks (tool_calls.py); what is
        # sent is a prefix of it, and the calls go out in the choice's final chunks.
        self.tools = isinstance(req, ChatCompletionRequest) and bool(req.tools) and req.tool_choice != "none"
        self.content_sent: dict[int, str] = {}
        self.finished: set[int] = set()
        self.started: set[int] = set()  # chat: choices whose role chunk went out

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _choice(
        self,
        index: int,
        text: str,
        lp: dict[str, Any] | None,
        finish: str | None,
        ids: list[int] | None = None,
    ) -> dict[str, Any]:
        if self.chat:
            out = {
                "index": index,
                "delta": {"content": text} if text else {},
                "logprobs": lp,
                "finish_reason": finish,
            }
        else:
            out = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
            if self.prompt_ids is not None and index not in self.started:
                self.started.add(index)
                out["prompt_token_ids"] = self.prompt_ids
        if ids is not None:
            out["token_ids"] = ids
        return out

    def _ids(self, d: Delta) -> list[int] | None:
        return list(d.ids) if self.prompt_ids is not None and d.ids else None

    def _logprobs(self, d: Delta) -> dict[str, Any] | None:
        if not self.want_logprobs or not d.ids:
            return None
        if self.chat:
            return chat_logprobs(self.tokenizer, d.ids, d.logprobs, d.tops, as_ids=self.as_ids)
        return completion_logprobs(
            self.tokenizer, d.ids, d.logprobs, d.tops, offset=self.emitted.get(d.index, 0), as_ids=self.as_ids
        )

    def start(self) -> list[str]:
        """Chat streams open each choice with the assistant role, as OpenAI does."""
        if not self.chat:
            return []
        out = []
        for i in range(self.req.n):
            self.started.add(i)
            delta = {"role": "assistant", "content": ""}
            chunk = self._chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
            if self.prompt_ids is not None and i == 0:
                chunk["prompt_token_ids"] = self.prompt_ids
            out.append(sse(chunk))
        return out

    def _tool_chunks(
        self,
        index: int,
        text: str,
        lp: dict[str, Any] | None,
        finish: str | None,
        ids: list[int] | None = None,
    ) -> list[str]:
        """Chat with tools: the content that became certain, and at the end the rest of the
        content, the parsed tool calls (one chunk) and the finish reason (a last, empty chunk)."""
        text = self.forced + text
        extra = {} if ids is None else {"token_ids": ids}
        sent = self.content_sent.get(index, "")
        if finish is None:
            content = safe_content_prefix(text, self.holdback)
            if not content.startswith(sent):  # cannot happen (the prefix only grows); never resend
                content = sent
            new = content[len(sent) :]
            if not new and lp is None and ids is None:
                return []
            self.content_sent[index] = content
            grown = {"content": new} if new else {}
            return [
                sse(
                    self._chunk(
                        [{"index": index, "delta": grown, "logprobs": lp, "finish_reason": None, **extra}]
                    )
                )
            ]
        turn = parse_turn(self.req, text)  # type: ignore[arg-type]  # tools: a chat request
        assert turn is not None
        rest = turn.content[len(sent) :] if turn.content.startswith(sent) else ""
        self.content_sent[index] = turn.content
        last: dict[str, Any] = {"content": rest} if rest else {}
        out = []
        if turn.calls:
            last["tool_calls"] = openai_tool_calls(turn.calls, with_index=True)
        if last or lp is not None or ids is not None:
            out.append(
                sse(
                    self._chunk(
                        [{"index": index, "delta": last, "logprobs": lp, "finish_reason": None, **extra}]
                    )
                )
            )
        reason = tool_finish_reason(finish, turn.calls)
        out.append(
            sse(self._chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}]))
        )
        return out

    def progress(self, deltas: list[Delta]) -> list[str]:
        out = []
        for d in deltas:
            if d.index in self.finished:
                continue
            if self.tools:
                if d.finish_reason is not None:
                    self.finished.add(d.index)
                out += self._tool_chunks(d.index, d.text, self._logprobs(d), d.finish_reason, self._ids(d))
                continue
            done = d.finish_reason is not None
            end = len(d.text) if done else max(len(d.text) - self.holdback, self.emitted.get(d.index, 0))
            text = d.text[self.emitted.get(d.index, 0) : end]
            lp = self._logprobs(d)
            ids = self._ids(d)
            if not text and lp is None and ids is None and not done:
                continue
            self.emitted[d.index] = end
            if done:
                self.finished.add(d.index)
            out.append(sse(self._chunk([self._choice(d.index, text, lp, d.finish_reason, ids)])))
        return out

    def finish(self, resp: GenerateResponse) -> list[str]:
        """Whatever the progress reports did not cover (e.g. a request aborted by timeout), the
        usage chunk if asked for, and the terminator."""
        out = []
        for i, ch in enumerate(resp.choices):
            if i in self.finished:
                continue
            if self.tools:
                out += self._tool_chunks(i, ch.text or "", None, ch.finish_reason)
                continue
            text = (ch.text or "")[self.emitted.get(i, 0) :]
            out.append(sse(self._chunk([self._choice(i, text, None, ch.finish_reason)])))
        opts = self.req.stream_options
        if opts is not None and opts.include_usage:
            out.append(sse({**self._chunk([]), "usage": usage(resp)}))
        out.append(sse("[DONE]"))
        return out

    def error(self, message: str) -> list[str]:
        return [sse({"error": {"message": message, "type": "server_error"}}), sse("[DONE]")]
