"""The Mamba-2 state slots in the engine's memory plan (services/engine/kv_cache.pool_blocks): a
byte budget (kv_cache_bytes) holds max_batch_size state slots first and KV pages in the rest, the
slots' bytes are what the state tensors really take, and a budget too small for the slots plus one
full-length sequence's pages is refused naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.moe import nemotron_model, small_nemotron

from sbatch.plan import recurrent_state_bytes
from services.common.config import EngineConfig
from services.engine import LLMEngine
from services.engine.kv_cache import KVCache, pool_blocks
from services.engine.state_cache import StateCache
from trainer.model import save_weights_dir

SLOTS = 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_bytes_are_the_tensors_bytes(dtype: torch.dtype) -> None:
    m = small_nemotron()
    cache = StateCache.for_model(m, SLOTS, dtype, torch.device("cpu"))
    assert cache is not None
    assert StateCache.bytes_for(m, SLOTS, dtype) == cache.nbytes == cache.conv.nbytes + cache.ssm.nbytes
    # The slots and the padding slot a captured decode graph's padding rows use (state_cache.py).
    assert StateCache.slot_bytes(m, dtype) * (SLOTS + 1) == cache.nbytes
    assert cache.conv.shape[1] == cache.ssm.shape[1] == SLOTS + 1 and cache.pad_slot == SLOTS
    # The capacity plan's per-sequence figure (bf16 conv state) is the engine's slot.
    assert recurrent_state_bytes(m) == StateCache.slot_bytes(m, torch.bfloat16)


def test_dense_model_has_no_state_bytes() -> None:
    m = small_nemotron().model_copy(update={"arch": "qwen3", "hybrid_pattern": ""})
    assert StateCache.bytes_for(m, SLOTS, torch.float32) == 0


def test_budget_holds_states_then_pages() -> None:
    m = small_nemotron()
    per_block = KVCache.bytes_per_block_for(m, 4, torch.float32)
    states = StateCache.bytes_for(m, SLOTS, torch.float32)
    budget = states + 100 * per_block + per_block // 2
    cfg = EngineConfig(device="cpu", max_batch_size=SLOTS, block_size=4, kv_cache_bytes=budget)
    assert pool_blocks(cfg, m, 64, torch.float32) == 100
    # Without the slots the same budget would hold more pages: the slots' bytes are what shrank it.
    assert budget // per_block >= 100 + states // per_block
    # num_kv_blocks is taken as it is; with neither, max_batch_size sequences of max_seq_len.
    assert pool_blocks(cfg.model_copy(update={"num_kv_blocks": 3}), m, 64, torch.float32) == 3
    plain = cfg.model_copy(update={"kv_cache_bytes": None})
    assert pool_blocks(plain, m, 64, torch.float32) == SLOTS * 16


def test_budget_too_small_names_the_field() -> None:
    m = small_nemotron()
    per_block = KVCache.bytes_per_block_for(m, 4, torch.float32)
    states = StateCache.bytes_for(m, SLOTS, torch.float32)
    least = states + 16 * per_block  # the slots plus one 64-token sequence's 16 pages
    cfg = EngineConfig(device="cpu", max_batch_size=SLOTS, block_size=4, kv_cache_bytes=least)
    assert pool_blocks(cfg, m, 64, torch.float32) == 16
    with pytest.raises(
        ValueError, match=r"kv_cache_bytes: .* Mamba-2 state slots .* at least " + f"{least:,}"
    ):
        pool_blocks(cfg.model_copy(update={"kv_cache_bytes": least - 1}), m, 64, torch.float32)


def test_engine_pool_from_the_budget(tmp_path: Path) -> None:
    """A real engine over the budget: its states and pages together stay inside kv_cache_bytes."""
    m = small_nemotron()
    d = save_weights_dir(m, nemotron_model(m, seed=3).state_dict(), tmp_path / "step_0", {"version": 0})
    per_block = KVCache.bytes_per_block_for(m, 4, torch.float32)
    states = StateCache.bytes_for(m, SLOTS, torch.float32)
    budget = states + 40 * per_block
    cfg = EngineConfig(
        device="cpu", max_batch_size=SLOTS, max_seq_len=m.max_seq_len, block_size=4, kv_cache_bytes=budget
    )
    eng = LLMEngine(d, cfg)
    assert eng.kv.num_blocks == 40
    assert eng.kv.state_bytes == states == eng.kv.states.nbytes
    # The routing store keeps one pad row past the pages (kv_cache.py): at most a few bytes over.
    assert eng.kv.kv_bytes - 40 * per_block == eng.kv.routing[:, -1].nbytes
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        LLMEngine(d, cfg.model_copy(update={"kv_cache_bytes": states}))
    # cuda_memory_gib: weights + pages + slots must fit it (checked before the pools are allocated).
    weights = sum(t.nbytes for t in (*eng.runner.model.parameters(), *eng.runner.model.buffers()))
    need = weights + 40 * per_block + states
    LLMEngine(d, cfg.model_copy(update={"cuda_memory_gib": need / (1 << 30)}))
    short = (need - states // 2) / (1 << 30)  # room for weights and pages, half the slots
    with pytest.raises(ValueError, match=r"cuda_memory_gib: .* 8 Mamba-2 state slots"):
        LLMEngine(d, cfg.model_copy(update={"cuda_memory_gib": short}))
