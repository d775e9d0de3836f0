"""OpenAI /v1/completions subset on top of token-level generation: text in and out through the
model directory's tokenizer, stop strings applied to the decoded text."""

from __future__ import annotations

import time
from itertools import accumulate
from typing import Any

from tokenizers import Tokenizer

from services.common.schemas import (
    CompletionRequest,
    GenerateChoice,
    GenerateRequest,
    GenerateResponse,
    SamplingParams,
)


class PromptError(ValueError):
    """The prompt cannot be turned into token ids; the message names the "prompt" field."""


def to_generate_request(req: CompletionRequest, tokenizer: Tokenizer | None) -> GenerateRequest:
    if isinstance(req.prompt, str):
        if tokenizer is None:
            raise PromptError("prompt: this model directory has no tokenizer.json; send token ids")
        ids = tokenizer.encode(req.prompt, add_special_tokens=False).ids
        if not ids:
            raise PromptError("prompt: encodes to no tokens")
    else:
        ids = list(req.prompt)
    sampling = SamplingParams(
        temperature=req.temperature, top_p=req.top_p, max_tokens=req.max_tokens, n=req.n, seed=req.seed
    )
    return GenerateRequest(input_ids=ids, sampling=sampling)


def _token_texts(tokenizer: Tokenizer | None, ids: list[int]) -> list[str]:
    if tokenizer is None:
        return ["" for _ in ids]
    return [tokenizer.decode([t], skip_special_tokens=True) for t in ids]


def _choice(
    index: int, ch: GenerateChoice, tokenizer: Tokenizer | None, stops: list[str], want_logprobs: bool
) -> dict[str, Any]:
    pieces = _token_texts(tokenizer, ch.output_ids)
    starts = [0, *accumulate(len(p) for p in pieces)][: len(pieces)]
    text = "".join(pieces)
    finish = ch.finish_reason
    n_tokens = len(pieces)
    # Cut at the earliest stop string (excluded from the text, as OpenAI does), keeping the
    # tokens that start before the cut.
    cuts = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    if cuts:
        cut = min(cuts)
        text, finish = text[:cut], "stop"
        n_tokens = sum(1 for s in starts if s < cut)
    logprobs = None
    if want_logprobs:
        logprobs = {
            "tokens": pieces[:n_tokens],
            "token_logprobs": ch.logprobs[:n_tokens],
            "top_logprobs": None,
            "text_offset": starts[:n_tokens],
        }
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}


def to_completion(
    req: CompletionRequest, resp: GenerateResponse, tokenizer: Tokenizer | None, model: str
) -> dict[str, Any]:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    want = req.logprobs is not None
    choices = [_choice(i, ch, tokenizer, stops, want) for i, ch in enumerate(resp.choices)]
    completion_tokens = sum(len(c.output_ids) for c in resp.choices)
    return {
        "id": f"cmpl-{resp.request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": resp.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": resp.prompt_tokens + completion_tokens,
        },
    }
