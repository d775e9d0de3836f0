"""KV pages between a cache's pools and a page-major byte batch, in one kernel per pool.

A batch of pages travels as [n, page_nbytes] bytes: per pool, a page's rows of every layer
(kv_transfer.export_blob). The pool is layer-major ([L, tokens, ...]), so a page is L chunks of
block_size rows, one per layer: a (page, layer) chunk is contiguous on both sides (32 KiB for
Qwen3-0.6B's k or v at 16-token pages) but the chunks of one page are strided in the pool.

Why a kernel: torch moved these chunks as an indexed write of token rows plus a strided copy,
~1.1 ms per 256 MiB on an H200 (~0.45 TB/s), on the import side stream, where it also took SMs
from the decode step running beside it (a step importing 256 MiB took 3.5 ms against 2.1). Here each program copies one block of one chunk as 8-byte words: a plain streaming
copy. The CPU path (and any layout the kernel does not fit) stays with torch (kv_transfer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops import pdl

WORD = 8  # bytes per element the kernel moves (int64)
MAX_BLOCK = 1024  # words per program


@triton.jit
def _page_copy(
    pool_ptr,
    blob_ptr,
    pages_ptr,
    layer_stride,
    blob_stride,
    blob_off,
    L: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    TO_POOL: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    c = tl.program_id(0)  # (batch page i, layer l)
    j = tl.program_id(1)  # block of the chunk
    i = c // L
    layer = c % L
    if USE_GDC:
        # Everything is waited for, the page ids too: they are uploaded right before the launch.
        tl.extra.cuda.gdc_wait()
    page = tl.load(pages_ptr + i).to(tl.int64)
    offs = j * BLOCK + tl.arange(0, BLOCK)
    b = blob_ptr + i.to(tl.int64) * blob_stride + blob_off + layer * CHUNK + offs
    p = pool_ptr + layer.to(tl.int64) * layer_stride + page * CHUNK + offs
    if TO_POOL:
        x = tl.load(b)
    else:
        x = tl.load(p)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    if TO_POOL:
        tl.store(p, x)
    else:
        tl.store(b, x)


def _block(chunk_words: int) -> int:
    block = MAX_BLOCK
    while block > 1 and chunk_words % block:
        block //= 2
    return block


def chunk_bytes(pool: torch.Tensor, block_size: int) -> int:
    """Bytes of one (page, layer) chunk of `pool` ([L, tokens, ...]): block_size rows."""
    return block_size * pool[0, 0].numel() * pool.element_size()


def fits(pool: torch.Tensor, block_size: int, blob: torch.Tensor, off: int) -> bool:
    """Whether copy_pages handles this pool and batch: contiguous tensors on one device, the
    chunks and the pool's byte offset in the batch whole words."""
    chunk = chunk_bytes(pool, block_size)
    return (
        pool.is_contiguous()
        and blob.is_contiguous()
        and blob.dim() == 2
        and blob.dtype == torch.uint8
        and pool.device == blob.device
        and chunk % WORD == 0
        and off % WORD == 0
        and blob.shape[1] % WORD == 0
        and pool.shape[1] % block_size == 0
    )


def copy_pages(
    pool: torch.Tensor, block_size: int, pages: torch.Tensor, blob: torch.Tensor, off: int, to_pool: bool
) -> None:
    """Batch page i's bytes blob[i, off : off + L * chunk] <-> page pages[i] of `pool` ([L, tokens,
    ...], chunk = block_size rows of one layer). `to_pool`: import (blob -> pool), else export.
    `pages`: int64 on the pool's device. Call only where `fits`."""
    n, L = len(pages), pool.shape[0]
    if n == 0:
        return
    chunk_words = chunk_bytes(pool, block_size) // WORD
    words = pool.view(torch.uint8).view(torch.int64).view(L, -1)
    flat = blob.view(torch.int64)
    block = _block(chunk_words)
    use = pdl.launch(pool)
    _page_copy[(n * L, chunk_words // block)](
        words,
        flat,
        pages,
        words.stride(0),
        flat.stride(0),
        off // WORD,
        L=L,
        CHUNK=chunk_words,
        BLOCK=block,
        TO_POOL=to_pool,
        USE_GDC=use,
        launch_pdl=use,
    )
