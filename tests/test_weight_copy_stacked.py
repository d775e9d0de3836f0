"""A layer's experts applied in one copy per fused buffer (services/engine/weight_copy.copy_pieces):
the staging ring's packing puts every byte where one copy per expert tensor would, and an engine
update through the stacked path leaves the model bit for bit as the per-expert path does (bf16
experts, FP8 pairs copied as the file's bits, and the FP8 expert width whose tiles straddle gate
and up, re-quantised one expert at a time). CPU, a small MoE published by trainer.publish."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers.hf_random import engine
from helpers.moe import small_moe

from ops.fp8.recipe import FP8_DTYPE
from services.engine.layers import fp8 as engine_fp8
from services.engine.layers import moe as engine_moe
from services.engine.weight_copy import copy_each, copy_pieces, pack, slot_plan
from trainer.model import build_model
from trainer.publish import Publisher


def _pieces(sizes: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]


@pytest.mark.parametrize("slot", [7, 64, 1000, 1 << 20])
def test_slot_packing_lays_the_pieces_end_to_end(slot: int) -> None:
    """Pieces smaller than, equal to and spanning several slots; every slot full but the last."""
    pieces = _pieces([5, 64, 1, 300, 0, 129, 2048, 3])
    want = torch.cat(pieces)
    got = torch.full_like(want, 0)
    buf = torch.empty(slot, dtype=torch.uint8)
    plan = list(slot_plan(pieces, slot))
    with ThreadPoolExecutor(4) as pool:
        for off, k, parts in plan:
            buf.fill_(0)
            pack(buf, parts, pool, 4)
            got[off : off + k] = buf[:k]
    assert torch.equal(got, want)
    assert [k for _, k, _ in plan[:-1]] == [slot] * (len(plan) - 1)
    assert [off for off, _, _ in plan] == list(range(0, want.numel(), slot))


def test_pack_groups_many_small_parts_into_few_jobs() -> None:
    """256 scale-sized parts (one layer's scales) are copied correctly over the pool's threads,
    and large ones split over them."""
    pieces = _pieces([384] * 256 + [3 << 20], seed=1)
    (off, k, parts), *rest = list(slot_plan(pieces, 8 << 20))
    assert off == 0 and not rest
    buf = torch.empty(8 << 20, dtype=torch.uint8)
    with ThreadPoolExecutor(4) as pool:
        pack(buf, parts, pool, 4)
    assert torch.equal(buf[:k], torch.cat(pieces))


def test_copy_pieces_on_cpu_casts_and_checks_sizes() -> None:
    dst = torch.empty(4, 3, 5, dtype=torch.bfloat16)
    src = [torch.randn(3, 5) for _ in range(4)]  # float32: cast piece by piece
    copy_pieces(dst, src)
    assert torch.equal(dst, torch.stack(src).to(torch.bfloat16))
    same = [t.to(torch.bfloat16) for t in src]
    out = torch.empty_like(dst)
    copy_pieces(out, same)
    assert torch.equal(out, dst)
    with pytest.raises(ValueError, match="pieces"):
        copy_pieces(dst, same[:3])
    with pytest.raises(ValueError, match="contiguous"):
        copy_pieces(dst.transpose(1, 2), same)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: _raw(v).clone() for k, v in model.state_dict().items()}


# Expert width 128: FP8 gate/up tiles concatenate exactly (stacked copy of the file's bits);
# width 96: a fused tile straddles gate and up (re-quantised expert by expert, the same as before).
@pytest.mark.parametrize("inter", [128, 96])
@pytest.mark.parametrize("quant", ["none", "fp8"])
def test_stacked_apply_is_bit_identical_to_per_expert_copies(
    tmp_path: Path, quant: str, inter: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = small_moe(
        dim=160, hidden_dim=192, n_layers=2, n_routed_experts=6, moe_hidden_dim=inter, vocab_size=300
    )
    model = build_model(m, seed=3)
    pub = Publisher(m, dtype=torch.bfloat16, quantization=quant)  # type: ignore[arg-type]
    for v in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        pub.publish(model, v, tmp_path / f"step_{v}", background=False)
    eng = engine(tmp_path / "step_1", quantization=quant, dtype="bfloat16")
    ckpt = eng.read_weights(tmp_path / "step_2")
    calls: list[int] = []

    def counted(dst: torch.Tensor, pieces: list[torch.Tensor]) -> None:
        calls.append(len(pieces))
        copy_pieces(dst, pieces)

    monkeypatch.setattr(engine_moe, "copy_pieces", counted)
    monkeypatch.setattr(engine_fp8, "copy_pieces", counted)
    eng.apply_weights(ckpt, 2)
    stacked = _snapshot(eng.model)
    # One copy per fused buffer and MoE layer (fp8: weight and scales), never one per expert.
    stacked_buffers = 2 if quant == "none" else (4 if inter % 128 == 0 else 2)
    assert len(calls) == stacked_buffers * (m.n_layers - m.first_k_dense)
    assert all(n in (m.n_routed_experts, 2 * m.n_routed_experts) for n in calls)

    eng.load_weights(tmp_path / "step_1", 1)  # other bits in every buffer first
    assert any(not torch.equal(stacked[k], v) for k, v in _snapshot(eng.model).items())
    monkeypatch.setattr(engine_moe, "copy_pieces", copy_each)
    monkeypatch.setattr(engine_fp8, "copy_pieces", copy_each)
    eng.apply_weights(ckpt, 2)
    per_expert = _snapshot(eng.model)
    assert list(per_expert) == list(stacked)
    assert [k for k in stacked if not torch.equal(stacked[k], per_expert[k])] == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned staging ring is CUDA's")
def test_staging_ring_packs_pieces_into_device_memory() -> None:
    """The CUDA path: pieces packed through a small ring (slots reused while earlier DMAs may be in
    flight) land end to end in the device buffer, fp8 and bf16 alike."""
    from services.engine.weight_copy import Uploader

    dev = torch.device("cuda")
    up = Uploader(dev, slot_bytes=1000, slots=2, threads=3)
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        pieces = [torch.randn(n).to(dtype) for n in (5, 640, 1, 3000, 129, 7)]
        dst = torch.empty(sum(p.numel() for p in pieces), dtype=dtype, device=dev)
        up.copy_pieces(dst, pieces)
        torch.cuda.synchronize()
        assert torch.equal(dst.cpu().view(torch.uint8), torch.cat([p.view(torch.uint8) for p in pieces]))
