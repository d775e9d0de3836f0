"""Wire messages of the prefill service (POST /v1/prefill)."""

from __future__ import annotations

from pydantic import Field

from services.common.schemas import SamplingParams, Wire


class PrefillRequest(Wire):
    input_ids: list[int] = Field(min_length=1)
    # The request's own sampling parameters: its first token is drawn exactly as decode would
    # (same seed, same per-sample RNG stream); max_tokens is ignored (one token is sampled).
    sampling: SamplingParams = SamplingParams()
    request_id: str | None = None


class FirstToken(Wire):
    token: int
    logprob: float
    version: int


class PrefillResponse(Wire):
    request_id: str
    version: int  # weights the pages and first tokens were computed with
    layout: str  # kv_transfer.layout_id of the engine: decode checks it matches its own
    prompt_tokens: int
    page_keys: list[str]  # hex keys of the prompt's full pages, now in the KV store (chain order)
    pages_stored: int  # pages this call wrote to the store (the rest were already there)
    local_tokens: int  # prompt tokens whose KV was already in this service's prefix cache
    pulled_tokens: int  # prompt tokens whose KV came from the store instead of being computed
    computed_tokens: int  # prompt tokens this service computed
    choices: list[FirstToken]  # one per sample (sampling.n)
