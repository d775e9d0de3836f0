"""Wire messages of the prefill service (POST /v1/prefill, POST /v1/handoff/ack,
GET /v1/handoff/segments)."""

from __future__ import annotations

from pydantic import Field, model_validator

from services.common.schemas import SamplingParams, Wire, WireRequest


class PrefillRequest(WireRequest):
    input_ids: list[int] = Field(min_length=1)
    # The request's own sampling parameters: its first token is drawn exactly as decode would
    # (same seed, same per-sample RNG stream); max_tokens is ignored (one token is sampled).
    sampling: SamplingParams = SamplingParams()
    request_id: str | None = None
    # The caller is on this host's /dev/shm and will ack (a decode router): answer with a handoff
    # of the pages in the shared near tier, without waiting for the gateway when it covers them all.
    handoff: bool = False


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
    # Pages this call wrote to the store (the rest were already there); 0 when the handoff covers
    # every page (the answer does not wait for the store; the publish goes on in the background).
    pages_stored: int
    local_tokens: int  # prompt tokens whose KV was already in this service's prefix cache
    pulled_tokens: int  # prompt tokens whose KV came from the store instead of being computed
    computed_tokens: int  # prompt tokens this service computed
    choices: list[FirstToken]  # one per sample (sampling.n)
    # Same-host fast path: the pages in the prefill's shared near tier (None: pull from the store).
    handoff: KVHandoff | None = None


class HandoffSegment(Wire):
    name: str  # file name in /dev/shm (services/kvstore/shared_segment.py)
    token: str = Field(pattern="^[0-9a-f]{32}$")  # hex: proves the mapped file is this segment


class KVHandoff(Wire):
    """Where the prompt's first len(slots) pages lie in the prefill's shared near tier, for a
    decode process on the same host to copy directly (services/kvstore/handoff.py). Page i is
    slot `slots[i]` of segment `segments[seg[i]]`, valid while that slot's generation is still
    `gens[i]` (checked before and after the copy). The slots are held until `ack_url` is POSTed
    {"id": id} or `lease_s` passes, whichever first."""

    id: str
    page_bytes: int = Field(gt=0)
    segments: list[HandoffSegment]
    seg: list[int]
    slots: list[int]
    gens: list[int]
    lease_s: float
    ack_url: str
    # > 0: the last listed page is not a full page but the prompt's partial last page, holding its
    # last `tail_tokens` tokens (key kv_transfer.tail_hash; never a full page anywhere). 0: every
    # listed page is full.
    tail_tokens: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _same_lengths(self) -> KVHandoff:
        if not len(self.seg) == len(self.slots) == len(self.gens):
            raise ValueError("seg, slots and gens must have one entry per page")
        if any(not 0 <= s < len(self.segments) for s in self.seg):
            raise ValueError("seg names a segment that is not listed")
        if self.tail_tokens and not self.slots:
            raise ValueError("tail_tokens: a partial last page is announced but no page is listed")
        return self

    @property
    def full_pages(self) -> int:
        """Full pages listed (chain order from the prompt's first)."""
        return len(self.slots) - (1 if self.tail_tokens else 0)


class HandoffAck(WireRequest):
    id: str


class HandoffSegments(Wire):
    """GET /v1/handoff/segments: every segment of the prefill's shared near tier, for a decode on
    the same host to map (and pin) before its first handoff (empty: no shared tier)."""

    page_bytes: int = Field(ge=0)  # 0 when there is no shared tier
    segments: list[HandoffSegment]


PrefillResponse.model_rebuild()  # its handoff field names KVHandoff, defined after it
