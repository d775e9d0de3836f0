"""Asynchronous KV page import (services/engine/kv_transfer.PageExchange on CUDA): the copy runs on
a side stream, the pages are registered once it has landed, and the scheduler holds back a request
whose prefix continues with a landing page instead of recomputing it.

The CPU test drives the scheduler's side of the contract (the CPU import is synchronous, so a key is
made "landing" by hand); the CUDA tests run the real side-stream import (the GPU machine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.debug_weights import spread_debug_versions

from services.common.config import EngineConfig
from services.common.schemas import GenerateRequest, SamplingParams
from services.engine import LLMEngine
from services.engine.kv_transfer import (
    StagingBuffers,
    chain_hashes,
    export_pages,
    page_nbytes,
    reusable_pages,
)

PROMPT = [(7 * i + 3) % 60 for i in range(41)]  # 41 tokens: 10 full pages of 4 + 1
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the side-stream import is CUDA only")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return spread_debug_versions(tmp_path_factory.mktemp("kva"))[0]


def cfg(device: str) -> EngineConfig:
    return EngineConfig(device=device, max_batch_size=8, max_seq_len=128, block_size=4)  # type: ignore[arg-type]


def req() -> GenerateRequest:
    return GenerateRequest(
        input_ids=PROMPT,
        sampling=SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=6, ignore_eos=True),
    )


def source_pages(eng: LLMEngine) -> tuple[list[bytes], bytes]:
    """The prompt's full pages as a first engine computed them: (keys, bytes)."""
    eng.generate([req()])
    keys = chain_hashes(PROMPT, eng.version, eng.layout, 4, reusable_pages(len(PROMPT), 4))
    pages = [eng.kv.blocks.lookup(k) for k in keys]
    assert None not in pages
    return keys, export_pages(eng.kv, pages)  # type: ignore[arg-type]


def test_a_prefix_continuing_with_a_landing_page_waits_for_it(model_dir: Path) -> None:
    a = LLMEngine(model_dir, cfg("cpu"))
    keys, blob = source_pages(a)
    want = a.generate([req()])[0]

    b = LLMEngine(model_dir, cfg("cpu"))
    b.pages.landing_keys.add(keys[0])  # as if its copy were in flight
    state = b.add_request(req())
    for _ in range(3):
        b.step()
    assert b.stats.computed_tokens_total == 0 and b.num_waiting == 2  # held, nothing recomputed
    b.pages.landing_keys.clear()  # landed
    b.pages.stage(keys, blob)
    while not state.finished:
        b.step()
    b.flush()
    got = state.response()
    assert [c.output_ids for c in got.choices] == [c.output_ids for c in want.choices]
    assert b.stats.prefix_cache_hit_tokens == 40


@cuda
def test_side_stream_import_lands_bitwise_and_gives_the_same_tokens(model_dir: Path) -> None:
    a = LLMEngine(model_dir, cfg("cuda"))
    keys, blob = source_pages(a)
    want = a.generate([req()])[0]

    b = LLMEngine(model_dir, cfg("cuda"))
    pinned = torch.frombuffer(bytearray(blob), dtype=torch.uint8).pin_memory()
    released: list[bool] = []
    b.pages.stage(keys, pinned, release=lambda: released.append(True))
    b.pages.drain()  # launches the copy; registers it if it has already landed
    b.pages.finish()
    assert released == [True] and not b.pages.landing_keys and not b.pages.pending
    assert b.pages.imported_pages_total == len(keys)
    assert b.pages.import_bytes_total == len(keys) * page_nbytes(b.kv) and b.pages.import_seconds_total > 0
    for k in keys:
        pa, pb = a.kv.blocks.lookup(k), b.kv.blocks.lookup(k)
        assert pa is not None and pb is not None
        for ta, tb in ((a.kv.k, b.kv.k), (a.kv.v, b.kv.v)):
            assert torch.equal(ta[:, pa * 4 : pa * 4 + 4], tb[:, pb * 4 : pb * 4 + 4])
    got = b.generate([req()])[0]
    assert [c.output_ids for c in got.choices] == [c.output_ids for c in want.choices]
    assert b.stats.prefix_cache_hit_tokens == 40


@cuda
def test_a_request_staged_with_its_pages_is_admitted_on_them(model_dir: Path) -> None:
    """The router's order: stage the pulled pages, then submit. Whatever the copy's timing, the
    request is admitted on the imported pages (never a recompute of the prefix)."""
    a = LLMEngine(model_dir, cfg("cuda"))
    keys, blob = source_pages(a)
    want = a.generate([req()])[0]
    for _ in range(3):
        b = LLMEngine(model_dir, cfg("cuda"))
        b.pages.stage(keys, torch.frombuffer(bytearray(blob), dtype=torch.uint8).pin_memory())
        got = b.generate([req()])[0]
        assert [c.output_ids for c in got.choices] == [c.output_ids for c in want.choices]
        assert b.stats.prefix_cache_hit_tokens == 40
        assert b.stats.computed_tokens_total == 1 + 5 * 2


def test_staging_buffers_pick_the_smallest_that_fits_and_reserve_up_front() -> None:
    """Regression (H200 interference run): with idle buffers of different sizes, take() removed
    the chosen one with list.remove, which compares tensors elementwise and raised, so every pull
    after the first failed over to a recompute."""
    g = StagingBuffers.GRAIN
    bufs = StagingBuffers(pin=False, keep_bytes=64 * g)
    bufs.reserve(2, 3 * g)
    bufs.give(torch.empty(g, dtype=torch.uint8))
    assert bufs.allocations == 2 and bufs.idle_bytes == 7 * g
    small = bufs.take(g // 2)
    assert small.numel() == g  # the smallest that fits, not a reserved one
    big = bufs.take(2 * g)
    assert big.numel() == 3 * g and bufs.idle_bytes == 3 * g
    assert bufs.take(3 * g).numel() == 3 * g and bufs.allocations == 2  # reserved: nothing new
    bufs.give(small)
    bufs.give(big)
    assert bufs.idle_bytes == 4 * g


def test_copy_to_device_in_pieces_equals_one_copy() -> None:
    """Host -> device page copies go in pieces (kv_transfer.copy_to_device: a big copy would hold the
    copy engine and delay the decode loop's own uploads); the pieces must add up to the whole."""
    from services.engine.kv_transfer import copy_to_device

    src = torch.arange(7 * 96, dtype=torch.int64).to(torch.uint8).reshape(7, 96)
    dst = torch.zeros_like(src)
    copy_to_device(dst, src, chunk_bytes=200)  # 2 rows per piece: 4 pieces, the last one short
    assert torch.equal(dst, src)
    empty = torch.empty(0, 96, dtype=torch.uint8)
    copy_to_device(empty, empty)  # no rows: nothing to do
