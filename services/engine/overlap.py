"""Overlap scheduling (decode.engine.overlap_schedule): the pieces LLMEngine's overlapped step uses.

Without overlap a step is: schedule -> build inputs -> launch the forward -> sample -> wait for the
tokens -> bookkeeping, and the GPU idles through the host parts. With overlap, step N+1 is
scheduled and launched while step N's tokens are still on the device: a sequence whose last token
is *pending* (sampled by N, not yet on the host) feeds it straight from N's token tensor
(`feed_pending`), and N's bookkeeping (append, stop conditions, freeing pages) runs after N+1 is
queued. At most one step is in flight (`InFlight`). A sequence that N finishes has already been
given one more token by N+1: that token is discarded (never appended, no log-prob, its pages freed
with the rest). docs/engine.md has the whole protocol.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.engine.layers.sampler import PendingSample
from services.engine.sequence import Sequence


@dataclass(slots=True)
class InFlight:
    """A launched step whose sampled tokens have not been appended yet."""

    seqs: list[Sequence]  # row i of `sample` belongs to seqs[i]
    sample: PendingSample
    version: int  # the weights that computed it (a swap may land before it is committed)


@dataclass(slots=True)
class Feed:
    """Input rows whose token is pending: flat row dst[i] takes row src[i] of the tokens in flight."""

    dst: list[int]
    src: list[int]
    tokens: torch.Tensor  # [B] int64, the in-flight step's sampled tokens (device)


def feed_pending(ids: torch.Tensor, feed: Feed | None) -> None:
    """Write the pending tokens into a step's device input ids, in place and on the stream, so the
    forward that follows reads them without a host round trip."""
    if feed is None or not feed.dst:
        return
    idx = torch.from_numpy(np.array([feed.dst, feed.src], dtype=np.int64))
    if ids.is_cuda:
        # Pinned + non_blocking: a pageable copy would wait for the step in flight to finish.
        idx = idx.pin_memory().to(ids.device, non_blocking=True)
    ids.index_copy_(0, idx[0], feed.tokens.index_select(0, idx[1]))


__all__ = ["Feed", "InFlight", "feed_pending"]
