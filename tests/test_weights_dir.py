"""The weights directory format (services/common/weights_dir.py, weights_slice.py): single and
sharded writes (HF layout, index, atomic rename, a failed writer), memory-mapped reads, a rank's
slices against the full tensors, and retention."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ops.fp8.recipe import dequantize_weight, quantize_weight
from services.common.weights_dir import (
    INDEX_FILE,
    META_FILE,
    WEIGHTS_FILE,
    DirWrite,
    WeightsReader,
    kept_versions,
    read_model_dir,
    remove_temp_dirs,
    retain,
    shard_name,
    step_dir,
    versions,
    write_model_dir,
)
from services.common.weights_slice import SliceSpec, read_slices

CONFIG = {"model_type": "qwen3"}


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, s = quantize_weight(torch.randn(256, 384, generator=g))
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=g).bfloat16(),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(32, 32, generator=g).bfloat16(),
        "model.layers.0.input_layernorm.weight": torch.rand(32, generator=g),
        "model.layers.0.mlp.gate_proj.weight": q,  # fp8 pair: 2 x 3 tiles
        "model.layers.0.mlp.gate_proj.weight_scale_inv": s,
        "model.layers.0.mlp.experts.0.down_proj.weight": torch.randn(32, 16, generator=g).bfloat16(),
        "model.layers.0.mlp.experts.1.down_proj.weight": torch.randn(32, 16, generator=g).bfloat16(),
        "model.layers.0.mlp.experts.2.down_proj.weight": torch.randn(32, 16, generator=g).bfloat16(),
        "model.layers.0.mlp.experts.3.down_proj.weight": torch.randn(32, 16, generator=g).bfloat16(),
        "counts": torch.arange(7, dtype=torch.int64),
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


def test_single_writer_is_one_hf_file_read_back_through_maps(tmp_path: Path) -> None:
    state = _state()
    d = write_model_dir(tmp_path / "weights" / "step_3", state, CONFIG, None, {"version": 3})
    assert sorted(p.name for p in d.iterdir()) == ["config.json", WEIGHTS_FILE, META_FILE]
    assert json.loads((d / META_FILE).read_text())["version"] == 3
    assert not [p for p in d.parent.iterdir() if p.name.startswith(".")]  # the temporary name is gone
    config, got = read_model_dir(d)
    assert config == CONFIG
    _same(got, state)
    # HF's reader agrees (safetensors' own parser, not ours).
    with safe_open(str(d / WEIGHTS_FILE), framework="pt") as f:
        assert set(f.keys()) == set(state)
        assert torch.equal(f.get_tensor("model.embed_tokens.weight"), state["model.embed_tokens.weight"])
    # A caller may write into what it got (a private map): the file keeps its bytes.
    got["model.embed_tokens.weight"].zero_()
    _same(read_model_dir(d)[1], state)


def test_sharded_writers_finish_with_an_index(tmp_path: Path) -> None:
    """Three writers, each its file, in any order; the finishing writer waits for all of them,
    then the index (from the files' headers), config, tokenizer files and relay.json appear with
    the directory's rename."""
    state = _state(1)
    names = list(state)
    parts = [{k: state[k] for k in names[i::3]} for i in range(3)]
    w = DirWrite(tmp_path / "weights" / "step_5", "123", 3)
    done: dict[str, Path] = {}
    finisher = threading.Thread(
        target=lambda: done.setdefault("d", w.finish(CONFIG, {"tokenizer.json": b"{}"}, {"version": 5}))
    )
    w.write_file(2, parts[2])
    finisher.start()
    w.write_file(0, parts[0])
    assert not w.dest.exists()  # one file still missing
    w.write_file(1, parts[1])
    finisher.join(10)
    d = done["d"]
    files = [shard_name(i, 3) for i in range(3)]
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((d / INDEX_FILE).read_text())
    assert index["weight_map"] == {k: files[i] for i, p in enumerate(parts) for k in p}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    assert (d / "tokenizer.json").read_bytes() == b"{}"
    _same(read_model_dir(d)[1], state)
    assert versions(tmp_path) == [5]


def test_a_failed_writer_fails_the_version_at_once(tmp_path: Path) -> None:
    w = DirWrite(tmp_path / "weights" / "step_1", "9", 2)
    w.write_file(0, {"a": torch.ones(3)})
    with pytest.raises(ValueError, match="complex"):
        w.write_file(1, {"b": torch.ones(2, dtype=torch.complex64)})
    with pytest.raises(RuntimeError, match="writer of file 1 failed: ValueError"):
        w.finish(CONFIG, {}, {"version": 1}, timeout_s=30)
    w.abandon()
    assert list((tmp_path / "weights").iterdir()) == []
    # A writer that never comes: a deadline, not a hang.
    w = DirWrite(tmp_path / "weights" / "step_2", "9", 2)
    w.write_file(1, {"a": torch.ones(3)})
    with pytest.raises(TimeoutError, match="model-00001-of-00002"):
        w.finish(CONFIG, {}, {}, timeout_s=0.2)


def test_reader_rejects_inconsistent_directories(tmp_path: Path) -> None:
    d = write_model_dir(tmp_path / "a", {"x": torch.ones(4)}, CONFIG, None, {})
    (d / INDEX_FILE).write_text(json.dumps({"weight_map": {"x": WEIGHTS_FILE, "y": WEIGHTS_FILE}}))
    with pytest.raises(ValueError, match=r"names tensors no file holds: \['y'\]"):
        WeightsReader.open(d)
    raw = bytearray((d / WEIGHTS_FILE).read_bytes())
    (d / INDEX_FILE).unlink()
    (d / WEIGHTS_FILE).write_bytes(raw[:-4])  # truncated data
    with pytest.raises(ValueError, match="x: byte range"):
        WeightsReader.open(d)


# ------------------------------------------------------------------ slices


def test_two_slices_are_the_halves_of_the_full_tensors(tmp_path: Path) -> None:
    """tp 2: column-parallel tensors split along their rows, row-parallel along their columns,
    the rest replicated; an fp8 weight's scales follow its slice tile by tile. ep 2: each rank
    maps its own experts, whole. Only the slices' bytes are mapped."""
    state = _state(2)
    d = write_model_dir(tmp_path / "w", state, CONFIG, None, {})
    full = read_slices(WeightsReader.open(d), SliceSpec())
    _same(full, state)
    readers = [WeightsReader.open(d) for _ in range(2)]
    tp = [read_slices(r, SliceSpec(tp_rank=i, tp_size=2), n_experts=4) for i, r in enumerate(readers)]
    assert tp[0].keys() == tp[1].keys() == state.keys()
    dims = {
        "model.embed_tokens.weight": 0,
        "model.layers.0.self_attn.q_proj.weight": 0,
        "model.layers.0.self_attn.o_proj.weight": 1,
        "model.layers.0.mlp.gate_proj.weight": 0,
        "model.layers.0.mlp.gate_proj.weight_scale_inv": 0,
        "model.layers.0.mlp.experts.0.down_proj.weight": 1,
    }
    for k, v in state.items():
        if k in dims:
            assert tp[0][k].shape[dims[k]] * 2 == v.shape[dims[k]], k
            assert torch.equal(torch.cat([tp[0][k], tp[1][k]], dims[k]).float(), v.float()), k
        elif "experts" not in k:
            assert torch.equal(tp[0][k], v) and torch.equal(tp[1][k], v), k  # replicated
    q, s = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.gate_proj.weight_scale_inv"
    for part, rows in zip(tp, (slice(0, 128), slice(128, 256)), strict=True):
        assert torch.equal(dequantize_weight(part[q], part[s]), dequantize_weight(state[q], state[s])[rows])
    split = sum(state[k].numel() * state[k].element_size() for k in dims) + sum(
        state[f"model.layers.0.mlp.experts.{e}.down_proj.weight"].numel() * 2 for e in (1, 2, 3)
    )
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert readers[0].bytes_mapped == total - split // 2  # half of each split tensor, all of the rest

    ep = [read_slices(WeightsReader.open(d), SliceSpec(ep_rank=i, ep_size=2), n_experts=4) for i in range(2)]
    experts = [sorted(k for k in part if ".experts." in k) for part in ep]
    assert experts == [
        [f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in (0, 1)],
        [f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in (2, 3)],
    ]
    for part in ep:
        for k, v in part.items():
            assert torch.equal(v, state[k]), k  # experts whole, the rest replicated
    assert SliceSpec(ep_rank=2, ep_size=3).experts(8) == range(6, 8)  # 3, 3, 2


def test_kv_heads_replicated_and_fused_gate_up_split_by_halves(tmp_path: Path) -> None:
    """2 KV heads of 4 rows over tp 4: ranks 0-1 read head 0, ranks 2-3 head 1 (kv_heads known);
    a fused [E, gate + up, D] expert tensor over tp 2: each rank's part of the gate rows and of the
    up rows."""
    k = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    gate_up = torch.arange(2 * 8 * 3, dtype=torch.float32).view(2, 8, 3)
    state = {"l.self_attn.k_proj.weight": k, "l.mlp.experts.gate_up_proj": gate_up}
    d = write_model_dir(tmp_path / "w", state, CONFIG, None, {})
    for r in range(4):
        part = read_slices(WeightsReader.open(d), SliceSpec(tp_rank=r, tp_size=4, kv_heads=2))
        head = r // 2
        assert torch.equal(part["l.self_attn.k_proj.weight"], k[head * 4 : head * 4 + 4])
    for r in range(2):
        part = read_slices(WeightsReader.open(d), SliceSpec(tp_rank=r, tp_size=2), n_experts=2)
        rows = [2 * r, 2 * r + 1, 4 + 2 * r, 5 + 2 * r]
        assert torch.equal(part["l.mlp.experts.gate_up_proj"], gate_up[:, rows])
    # Without the KV heads given, k/v split like any column-parallel projection.
    part = read_slices(WeightsReader.open(d), SliceSpec(tp_rank=1, tp_size=4))
    assert torch.equal(part["l.self_attn.k_proj.weight"], k[2:4])


def test_slices_refuse_what_does_not_split(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tp_rank 2 of tp_size 2"):
        SliceSpec(tp_rank=2, tp_size=2)
    q, s = quantize_weight(torch.randn(192, 128))
    d = write_model_dir(
        tmp_path / "w", {"a.q_proj.weight": q, "a.q_proj.weight_scale_inv": s}, CONFIG, None, {}
    )
    with pytest.raises(
        ValueError,
        match=r"a.q_proj.weight: tp_size 2 cuts dim 0 \(size 192\) at rows/columns 96:192, not on the 128x128",
    ):
        read_slices(WeightsReader.open(d), SliceSpec(tp_rank=1, tp_size=2))


# ------------------------------------------------------------------ retention


def test_kept_versions() -> None:
    vs = range(0, 21)
    assert kept_versions(vs, last=3, every=0, protected=[]) == {18, 19, 20}
    assert kept_versions(vs, last=2, every=5, protected=[]) == {0, 5, 10, 15, 19, 20}
    # Served and checkpoint-needed versions stay, whatever their age; unknown ones are ignored.
    assert kept_versions(vs, last=1, every=0, protected=[0, 7, 99]) == {0, 7, 20}


def test_retain_deletes_only_what_is_not_kept(tmp_path: Path) -> None:
    for v in range(12):
        write_model_dir(
            step_dir(tmp_path, v), {"x": torch.full((2,), float(v))}, CONFIG, None, {"version": v}
        )
    writing = step_dir(tmp_path, 12).parent / ".step_12.tmp-777"  # a write in flight
    writing.mkdir()
    gone = retain(tmp_path, last=3, every=4, protected={1})
    assert gone == [2, 3, 5, 6, 7]
    assert versions(tmp_path) == [0, 1, 4, 8, 9, 10, 11]
    assert writing.is_dir()  # not a complete version: retention leaves it
    assert torch.equal(read_model_dir(step_dir(tmp_path, 11))[1]["x"], torch.full((2,), 11.0))
    # A dead writer's temporary directory goes with remove_temp_dirs, unless kept.
    assert remove_temp_dirs(tmp_path, keep=lambda p: p == writing) == []
    assert remove_temp_dirs(tmp_path) == [writing] and not writing.exists()
