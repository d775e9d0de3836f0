"""Publishing weights from the trainer (trainer/publish.py) and applying them in the engine:

- 4 gloo ranks under FSDP2 write one sharded HF directory, each rank its own file, that equals the
  single writer's tensor for tensor; no rank holds more than its share plus one parameter on the
  host; transformers loads the directory and computes what the trainer's model computes;
- with quantization "fp8" the directory holds the FP8 engine's own (E4M3, 128x128 scale) pairs:
  an FP8 engine loaded from it equals one that quantised the bf16 directory itself, its buffers
  are the file's bits (copied, not re-quantised), in about half the bf16 bytes;
- an engine update reports the bytes it read and the seconds it took.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.hf_random import engine
from helpers.moe import small_moe

from ops.fp8.checkpoint import is_fp8_weight
from ops.fp8.recipe import FP8_DTYPE
from services.common.config import ModelConfig, TrainerSection
from services.common.weights_dir import INDEX_FILE, SCALE_SUFFIX, WeightsReader, read_model_dir, shard_name
from services.engine.layers import fp8 as engine_fp8
from services.engine.layers.fp8 import Fp8Experts
from trainer.model import build_model, save_weights_dir
from trainer.parallel import parallelize
from trainer.publish import Publisher, owners

WORLD = 4
# Row counts that do not divide by 4 (vocab 66, FFN 70): FSDP2's last shards are short.
M4 = ModelConfig(
    vocab_size=66,
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    hidden_dim=70,
    tie_embeddings=False,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _publish_worker(rank: int, port: int, root: str, out: dict[int, Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.tensor import DTensor

        model, deg, _ = parallelize(
            build_model(M4, seed=5), TrainerSection(nproc=WORLD), WORLD, torch.device("cpu"), True
        )
        assert deg.fsdp and isinstance(model.tok_embeddings.weight, DTensor)
        pub = Publisher(M4, rank, WORLD, token="t")
        pub.publish(model, 7, Path(root) / "sharded" / "step_7", background=False)
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:  # the single-writer reference: rank 0 writes the full state dict
            save_weights_dir(M4, sd, Path(root) / "single" / "step_7", {"version": 7})
        dist.barrier()
        out[rank] = {
            "host_bytes": sum(b.numel() * b.element_size() for b in pub._buffers.values()),
            "file_bytes": pub.last.bytes if pub.last else 0,
        }
    finally:
        dist.destroy_process_group()


def test_four_ranks_publish_what_one_writer_writes(tmp_path: Path) -> None:
    out = mp.Manager().dict()
    mp.start_processes(
        _publish_worker, args=(_free_port(), str(tmp_path), out), nprocs=WORLD, start_method="fork"
    )
    sharded, single = tmp_path / "sharded" / "step_7", tmp_path / "single" / "step_7"
    files = [shard_name(i, WORLD) for i in range(WORLD)]
    assert sorted(p.name for p in sharded.glob("*.safetensors")) == files and (sharded / INDEX_FILE).is_file()
    _, a = read_model_dir(sharded)
    _, b = read_model_dir(single)
    assert a.keys() == b.keys() and len(a) == 2 + 2 * 11 + 1  # embed, head, 11 per layer, norm
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    for name in ("config.json", "tokenizer.json"):
        assert (sharded / name).read_text() == (single / name).read_text()
    # Each rank wrote its own file and held only its share: within one parameter of total / 4.
    total = sum(t.numel() * t.element_size() for t in a.values())
    largest = max(t.numel() * t.element_size() for t in a.values())
    held = [out[r]["host_bytes"] for r in range(WORLD)]
    assert sum(held) == total and max(held) <= total / WORLD + largest, held
    assert all(out[r]["file_bytes"] > 0 for r in range(WORLD))
    sizes = {e.file.name for e in WeightsReader.open(sharded).entries.values()}
    assert sizes == set(files)

    # transformers loads the sharded directory and computes the trainer model's logits.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(sharded, dtype=torch.float32).eval()
    hf_sd = hf.state_dict()
    for k, v in a.items():
        assert torch.equal(hf_sd[k], v), k
    tokens = torch.tensor([[3, 9, 27, 14, 5, 60, 2]])
    trainer_model = build_model(M4, seed=5).eval()
    with torch.no_grad():
        want = trainer_model(tokens).float()
        got = hf(tokens).logits.float()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_owners_balance_whole_parameters() -> None:
    plan = owners([("a", 100), ("b", 60), ("c", 50), ("d", 10), ("e", 5)], 2)
    assert plan == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 0}  # loads 115 / 110
    assert owners([("a", 1)], 3) == {"a": 0}


# ------------------------------------------------------------------ FP8


DENSE = ModelConfig(
    vocab_size=300, dim=192, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=48, hidden_dim=320, max_seq_len=64
)
MOE = small_moe(dim=160, hidden_dim=192, n_layers=2, n_routed_experts=4, moe_hidden_dim=128, vocab_size=300)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


@pytest.mark.parametrize("m", [DENSE, MOE], ids=["dense", "moe"])
def test_fp8_publish_is_the_fp8_engines_own_quantisation(tmp_path: Path, m: ModelConfig) -> None:
    model = build_model(m, seed=3)
    bf16 = Publisher(m, dtype=torch.bfloat16)
    bf16.publish(model, 1, tmp_path / "bf16" / "step_1", background=False)
    fp8 = Publisher(m, dtype=torch.bfloat16, quantization="fp8")
    fp8.publish(model, 1, tmp_path / "fp8" / "step_1", background=False)
    assert bf16.last is not None and fp8.last is not None
    _, hp = read_model_dir(tmp_path / "bf16" / "step_1")
    _, q = read_model_dir(tmp_path / "fp8" / "step_1")
    quantised = {k for k, v in hp.items() if is_fp8_weight(k, v.shape)}
    # Half the bytes of every linear, plus one float32 scale per 128x128 tile.
    saved = sum(hp[k].numel() for k in quantised) - sum(q[k + SCALE_SUFFIX].numel() * 4 for k in quantised)
    assert saved > 0.35 * bf16.last.bytes
    assert abs(bf16.last.bytes - fp8.last.bytes - saved) < 0.01 * bf16.last.bytes  # headers aside
    assert quantised and {k for k, v in q.items() if v.dtype == FP8_DTYPE} == quantised
    assert set(q) == set(hp) | {k + SCALE_SUFFIX for k in quantised}
    assert all(torch.equal(q[k], hp[k]) for k in hp if k not in quantised)  # the rest stays bf16

    # The FP8 engine holds exactly what it would have quantised from the bf16 directory ...
    from_fp8 = engine(tmp_path / "fp8" / "step_1", quantization="fp8", dtype="bfloat16")
    from_bf16 = engine(tmp_path / "bf16" / "step_1", quantization="fp8", dtype="bfloat16")
    sa, sb = from_fp8.model.state_dict(), from_bf16.model.state_dict()
    assert list(sa) == list(sb)
    assert [k for k in sa if not torch.equal(_raw(sa[k]), _raw(sb[k]))] == []
    # ... copied from the file's bits: every FP8 linear and expert buffer is the file's tensor.
    linears = engine_fp8.fp8_modules(from_fp8.model)
    assert {f"{n}.weight" for n in linears} | _expert_names(from_fp8.model) == quantised
    for n, mod in linears.items():
        assert torch.equal(_raw(mod.weight_fp8), _raw(q[f"{n}.weight"])), n
        assert torch.equal(mod.weight_scale, q[f"{n}.weight{SCALE_SUFFIX}"]), n
    for n, mod in from_fp8.model.named_modules():
        if isinstance(mod, Fp8Experts):
            for e in range(mod.n_experts):
                d = f"{n}.{e}.down_proj.weight"
                assert torch.equal(_raw(mod.down_fp8[e]), _raw(q[d])) and torch.equal(
                    mod.down_scale[e], q[d + SCALE_SUFFIX]
                )


def _expert_names(model: torch.nn.Module) -> set[str]:
    return {
        f"{n}.{e}.{p}.weight"
        for n, mod in model.named_modules()
        if isinstance(mod, Fp8Experts)
        for e in range(mod.n_experts)
        for p in ("gate_proj", "up_proj", "down_proj")
    }


def test_engine_update_reports_bytes_and_seconds(tmp_path: Path) -> None:
    model = build_model(DENSE, seed=1)
    pub = Publisher(DENSE)
    for v in (0, 1):
        pub.publish(model, v, tmp_path / f"step_{v}", background=False)
        with torch.no_grad():
            next(model.parameters()).add_(0.5)
    eng = engine(tmp_path / "step_0")
    eng.load_weights(tmp_path / "step_1", 1)
    s = eng.stats
    total = sum(t.numel() * t.element_size() for t in read_model_dir(tmp_path / "step_1")[1].values())
    assert s.weight_updates_total == 1 and s.weight_bytes_read_total == total
    assert s.weight_apply_seconds_total == s.weight_apply_seconds_last > 0 and s.weight_read_seconds_last > 0
    _, want = read_model_dir(tmp_path / "step_1")
    got = dict(eng.model.named_parameters())
    assert torch.equal(got["model.embed_tokens.weight"], want["model.embed_tokens.weight"])
