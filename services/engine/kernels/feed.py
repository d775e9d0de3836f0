"""Pending tokens into a captured decode graph's input ids, on the device (overlap scheduling).

With overlap scheduling step N+1 is launched before step N's sampled tokens reach the host; a
sequence whose last token is one of them reads it from N's token buffer. When N sampled inside a
decode graph (cuda_graphs.DecodeGraphs, `sample_in_graph`) that buffer is the graphs' own static
one, so N+1's graph starts with this kernel: row i takes prev[src[i]] where src[i] >= 0 and keeps
the id the host wrote otherwise. One launch, where torch.where + gather + copy would be five.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _feed_kernel(ids_ptr, src_ptr, prev_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    src = tl.load(src_ptr + i, mask=live, other=-1)
    take = live & (src >= 0)
    tok = tl.load(prev_ptr + tl.where(take, src, 0), mask=take, other=0)
    tl.store(ids_ptr + i, tok, mask=take)


def feed_tokens(ids: torch.Tensor, src: torch.Tensor, prev: torch.Tensor, block: int = 256) -> None:
    """ids[i] = prev[src[i]] where src[i] >= 0, in place. ids, src, prev: int64, contiguous."""
    n = ids.numel()
    if n:
        _feed_kernel[(triton.cdiv(n, block),)](ids, src, prev, n, BLOCK=block, num_warps=4)


__all__ = ["feed_tokens"]
