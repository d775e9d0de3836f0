"""The trainer's performance path on CPU (trainer/parallel.py, attention.py, publish.py).

- the trainer.* knobs validate, with errors naming the key;
- selective / full activation checkpointing give the same gradients as none;
- bf16 mixed precision under FSDP2 (2 gloo processes) trains with losses close to float32;
- the per-parameter publisher writes exactly the tensors the full-state publish writes,
  sharded (FSDP2, AC-wrapped names) and unsharded.
The GPU-only parts (flex/varlen kernels, compile speed, CP) are measured by bench/trainer/.
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from pydantic import ValidationError

from services.common.config import ModelConfig, RunConfig, TrainerSection
from services.common.schemas import RolloutGroup, Sample
from services.common.weights_dir import read_model_dir
from trainer.attention import micro_batch_attention, packed_logprobs
from trainer.batch import loss_token_count
from trainer.chunked import enable_chunked_output
from trainer.loss import ratio_loss
from trainer.model import build_model, save_weights_dir
from trainer.packing import pack, packed_micro_batches
from trainer.parallel import degrees, parallelize
from trainer.publish import Publisher

M = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64)


def _samples(n: int, seed: int, max_len: int = 24) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(3, max_len + 1, (1,), generator=g))
        out.append(
            Sample(
                rollout_id=f"r{seed}-{i}",
                tokens=torch.randint(0, 64, (length,), generator=g).tolist(),
                loss_mask=(torch.rand(length, generator=g) < 0.7).int().tolist(),
                logprobs=(-4.0 + 0.3 * torch.randn(length, generator=g)).tolist(),
                versions=[0] * length,
                reward=0.0,
                advantage=float(torch.randn(1, generator=g)),
            )
        )
    return out


# ------------------------------------------------------------------ knobs


def test_knobs_validate_with_the_key_named() -> None:
    tc = TrainerSection(nproc=8, dtype="bfloat16", activation_checkpoint="selective", tp=1, cp=2, ep=4)
    assert (tc.dtype, tc.activation_checkpoint, tc.cp, tc.ep) == ("bfloat16", "selective", 2, 4)
    d = degrees(TrainerSection(nproc=4, cp=2), 4)
    assert (d.dp, d.cp, d.tp) == (2, 2, 1) and [d.data_rank(r) for r in range(4)] == [0, 0, 1, 1]
    bad: list[tuple[dict[str, Any], str]] = [
        ({"nproc": 4, "cp": 3}, "trainer.tp * trainer.cp"),
        ({"nproc": 4, "ep": 3}, "trainer.ep"),
        ({"attention": "flex"}, "needs CUDA"),
        ({"device": "cuda", "nproc": 2, "cp": 2, "attention": "varlen"}, "trainer.cp > 1"),
        ({"dtype": "float16"}, "dtype"),
        ({"activation_checkpoint": "op"}, "activation_checkpoint"),
    ]
    for kw, words in bad:
        with pytest.raises(ValidationError, match=words.replace("*", r"\*").replace(".", r"\.")):
            TrainerSection(**kw)
    # The process count actually launched is checked too (torchrun may disagree with nproc).
    with pytest.raises(ValueError, match="not a multiple of trainer.tp"):
        degrees(TrainerSection(nproc=4, cp=2), 3)
    d = degrees(TrainerSection(nproc=4, tp=2), 4)  # tensor parallel: tp fastest, as torchtitan
    assert (d.dp, d.tp) == (2, 2) and [d.data_rank(r) for r in range(4)] == [0, 0, 1, 1]
    with pytest.raises(NotImplementedError, match="trainer.tp > 1 with trainer.cp or trainer.ep"):
        degrees(TrainerSection(nproc=4, tp=2, cp=2), 4)
    # Through the run config, the error names the dotted key.
    cfg = RunConfig().model_dump()
    cfg["trainer"]["cp"] = 0
    with pytest.raises(ValidationError, match="cp"):
        RunConfig.model_validate(cfg)


# ------------------------------------------------------------------ activation checkpointing


def _grads(ac: str, samples: list[Sample]) -> tuple[float, dict[str, torch.Tensor]]:
    model = enable_chunked_output(build_model(M, seed=0))
    tc = TrainerSection(activation_checkpoint=ac)  # type: ignore[arg-type]
    model, _, _ = parallelize(model, tc, 1, torch.device("cpu"), distributed=False)
    n = loss_token_count(samples)
    total = 0.0
    mbs = packed_micro_batches(samples, 64)
    assert any(len(mb.seq_lens) > 1 for mb in mbs)  # document masking is exercised
    for mb in mbs:
        # As train_step: the mask is held over backward, where AC recomputes the forward.
        with micro_batch_attention(model, mb):
            logp, _ = packed_logprobs(model, mb, chunk=16)
            loss, _ = ratio_loss(
                logp,
                mb.logp_infer,
                mb.advantages,
                mb.loss_mask,
                ratio_low=0.0,
                ratio_high=1e30,
                total_loss_tokens=n,
            )
            loss.backward()
        total += float(loss.detach())
    names = {k.replace("_checkpoint_wrapped_module.", ""): p for k, p in model.named_parameters()}
    return total, {k: p.grad.clone() for k, p in names.items() if p.grad is not None}


@pytest.mark.parametrize("ac", ["selective", "full"])
def test_activation_checkpointing_keeps_gradients(ac: str) -> None:
    samples = _samples(10, seed=1)
    loss0, g0 = _grads("none", samples)
    loss1, g1 = _grads(ac, samples)
    assert g0.keys() == g1.keys() and len(g0) > 10
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-5, atol=1e-7, msg=k)
    assert any(float(g.abs().max()) > 1e-4 for g in g0.values())  # the comparison means something


def test_single_sample_pack_runs_causal_without_a_mask() -> None:
    """A one-sample pack (the 131k case) skips the dense [T, T] mask: same log-probs as with it."""
    model = enable_chunked_output(build_model(M, seed=0))
    model, _, _ = parallelize(model, TrainerSection(), 1, torch.device("cpu"), distributed=False)
    mb = pack(_samples(1, seed=2, max_len=30))
    assert len(mb.seq_lens) == 1
    from trainer.loss import micro_batch_logprobs  # the dense-mask DocumentSDPA path

    fast, _ = packed_logprobs(model, mb, chunk=8)
    dense, _ = micro_batch_logprobs(model, mb, chunk=8)
    torch.testing.assert_close(fast, dense, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ publishing


def _load(d: Path) -> dict[str, torch.Tensor]:
    return read_model_dir(d)[1]


def _write_single(t: Any, version: int) -> None:
    """Collective: the full state dict written by rank 0 alone (the single-writer reference)."""
    sd = t._full_state()
    if t.d.is_main:
        save_weights_dir(t.cfg.model, sd, t.run_dir / "weights" / f"step_{version}", {"version": version})


def _assert_same_dirs(a: Path, b: Path) -> None:
    ta, tb = _load(a), _load(b)
    assert ta.keys() == tb.keys() and ta
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k
    for name in ("config.json", "tokenizer.json"):
        assert (a / name).read_text() == (b / name).read_text()


def test_publisher_writes_what_save_weights_dir_writes(tmp_path: Path) -> None:
    model = enable_chunked_output(build_model(M, seed=3))
    tc = TrainerSection(activation_checkpoint="selective")  # names get a wrapper prefix
    model, _, _ = parallelize(model, tc, 1, torch.device("cpu"), distributed=False)
    today = save_weights_dir(
        M,
        {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in model.state_dict().items()},
        tmp_path / "today",
        {"version": 5, "step": 5},
    )
    announced: list[Path] = []
    pub = Publisher(M)
    blocked = pub.publish(model, 5, tmp_path / "weights" / "step_5", on_done=announced.append)
    # The write is in flight or done; training may change the weights meanwhile: the published
    # copy must be the one taken at gather time.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    pub.wait()
    assert announced == [tmp_path / "weights" / "step_5"] and blocked >= 0
    assert pub.last is not None and pub.last.version == 5 and pub.last.bytes > 0
    _assert_same_dirs(announced[0], today)
    assert not [p for p in (tmp_path / "weights").iterdir() if p.name.startswith(".")]  # tmp renamed


def test_publisher_casts_to_the_engines_dtype(tmp_path: Path) -> None:
    """A bf16 fleet gets bf16 weights: the masters' values rounded once, half the bytes."""
    model = enable_chunked_output(build_model(M, seed=3))
    full = Publisher(M)
    full.publish(model, 1, tmp_path / "f32", background=False)
    half = Publisher(M, dtype=torch.bfloat16)
    half.publish(model, 1, tmp_path / "bf16", background=False)
    a, b = _load(tmp_path / "f32"), _load(tmp_path / "bf16")
    assert a.keys() == b.keys() and a
    for k in a:
        assert a[k].dtype == torch.float32 and b[k].dtype == torch.bfloat16, k
        assert torch.equal(b[k], a[k].to(torch.bfloat16)), k
    assert half.last is not None and full.last is not None
    assert half.last.bytes < 0.55 * full.last.bytes


# ------------------------------------------------------------------ FSDP2 + bf16, 2 gloo processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _groups(step: int) -> list[RolloutGroup]:
    samples = _samples(8, seed=100 + step)
    return [
        RolloutGroup(group_id=f"g{step}-{i}", env="t", seed=i, samples=samples[4 * i : 4 * i + 4])
        for i in range(2)
    ]


def _worker(rank: int, port: int, redis_url: str, root: str, out: dict[str, Any]) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    from trainer.train import Dist, Trainer

    d = Dist("cpu")
    try:
        for dtype in ("float32", "bfloat16"):
            cfg = RunConfig()
            cfg.model = M
            cfg.redis.prefix = f"tp-{uuid.uuid4().hex[:8]}" if rank == 0 else "unused"
            cfg.redis.prefix = d.broadcast(cfg.redis.prefix)
            cfg.trainer.nproc = 2
            cfg.trainer.lr = 3e-3
            cfg.trainer.packing = True
            cfg.trainer.micro_batch_tokens = 48
            cfg.trainer.logprob_chunk_tokens = 16
            cfg.trainer.dtype = dtype  # type: ignore[assignment]
            cfg.trainer.activation_checkpoint = "selective"
            run_dir = Path(root) / dtype
            t = Trainer(cfg, run_dir, redis_url, d)
            t.setup()
            losses = [t.train_step(_groups(s)).loss for s in range(4)]
            # Publishing from FSDP2 shards, per parameter, vs the full-state-dict publish.
            t.publisher.publish(t.model, 99, run_dir / "weights" / "step_99")
            t.publisher.wait()
            _write_single(t, 98)
            first = next(iter(t.model.parameters()))
            if rank == 0:
                out[dtype] = {
                    "losses": losses,
                    "param_dtype": str(first.dtype),
                    "sharded": type(first).__name__,
                }
    finally:
        d.close()


def test_bf16_fsdp_two_processes_close_to_float32(redis_server: str, tmp_path: Path) -> None:
    out = mp.Manager().dict()
    mp.start_processes(
        _worker, args=(_free_port(), redis_server, str(tmp_path), out), nprocs=2, start_method="fork"
    )
    f32, bf16 = out["float32"], out["bfloat16"]
    # Master weights stay float32 shards (DTensor); FSDP casts to bf16 only for compute.
    assert f32["param_dtype"] == bf16["param_dtype"] == "torch.float32"
    assert f32["sharded"] == bf16["sharded"] == "DTensor"
    a, b = torch.tensor(f32["losses"]), torch.tensor(bf16["losses"])
    assert a.abs().min() > 1e-4 and not torch.equal(a, b)  # bf16 really computed in bf16
    torch.testing.assert_close(b, a, rtol=0.02, atol=5e-3)
    # Both trained, to nearly the same weights: the bf16/fp32 gap is small next to the update.
    w0, w32, w16 = (
        _load(tmp_path / d / "weights" / s)
        for d, s in [("float32", "step_0"), ("float32", "step_99"), ("bfloat16", "step_99")]
    )
    moved = sum(float((w32[k] - w0[k]).abs().mean()) for k in w0)
    gap = sum(float((w16[k] - w32[k]).abs().mean()) for k in w0)
    assert moved > 0 and gap < 0.1 * moved, (gap, moved)
    for dtype in ("float32", "bfloat16"):
        w = tmp_path / dtype / "weights"
        _assert_same_dirs(w / "step_99", w / "step_98")


# ------------------------------------------------------------------ flex kernel (CPU forward)


@pytest.mark.slow  # ~100 s: inductor compiles FlexAttention for the CPU
def test_flex_document_mask_equals_dense_mask_forward() -> None:
    """FlexAttention has no CPU backward, but its forward compiles on CPU: the BlockMask built
    from the packing and the output layout must reproduce the dense block-causal mask exactly."""
    from trainer.attention import enable_document_attention

    mb = pack(_samples(5, seed=3))
    assert len(mb.seq_lens) == 5
    dense = enable_document_attention(enable_chunked_output(build_model(M, seed=0)), "sdpa")
    flex = enable_document_attention(enable_chunked_output(build_model(M, seed=0)), "flex")
    with torch.no_grad():
        ref, ref_ent = packed_logprobs(dense, mb, chunk=8)
        out, ent = packed_logprobs(flex, mb, chunk=8)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)


def test_single_process_bf16_is_autocast_close_to_float32(redis_server: str, tmp_path: Path) -> None:
    """Without a process group there is no FSDP: bf16 runs under autocast, weights stay float32."""
    from trainer.train import Dist, Trainer

    losses = {}
    for dtype in ("float32", "bfloat16"):
        cfg = RunConfig()
        cfg.model = M
        cfg.redis.prefix = f"tp-{uuid.uuid4().hex[:8]}"
        cfg.trainer.lr = 3e-3
        cfg.trainer.packing = True
        cfg.trainer.micro_batch_tokens = 48
        cfg.trainer.logprob_chunk_tokens = 16
        cfg.trainer.dtype = dtype  # type: ignore[assignment]
        t = Trainer(cfg, tmp_path / dtype, redis_server, Dist("cpu"))
        t.setup()
        losses[dtype] = torch.tensor([t.train_step(_groups(s)).loss for s in range(3)])
        assert all(p.dtype == torch.float32 for p in t.model.parameters())
    assert not torch.equal(losses["float32"], losses["bfloat16"])  # autocast really ran in bf16
    torch.testing.assert_close(losses["bfloat16"], losses["float32"], rtol=0.02, atol=5e-3)


@pytest.mark.slow  # ~100 s: inductor compiles the blocks for the CPU
def test_compile_with_selective_ac_keeps_gradients() -> None:
    """trainer.compile after selective AC (torchtitan's order), document mask held over backward:
    the same gradients, under the same (wrapper-free) names, as the plain model."""
    from trainer.param_names import clean_name

    mb = packed_micro_batches(_samples(6, seed=1), 64)[0]
    assert len(mb.seq_lens) > 1

    def grads(**knobs: Any) -> dict[str, torch.Tensor]:
        model = enable_chunked_output(build_model(M, seed=0))
        model, _, _ = parallelize(model, TrainerSection(**knobs), 1, torch.device("cpu"), distributed=False)
        with micro_batch_attention(model, mb):
            logp, _ = packed_logprobs(model, mb, chunk=16)
            logp.sum().backward()
        return {clean_name(k): p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    plain, compiled = grads(), grads(compile=True, activation_checkpoint="selective")
    assert plain.keys() == compiled.keys() and len(plain) > 10
    for k in plain:
        torch.testing.assert_close(compiled[k], plain[k], rtol=1e-4, atol=1e-5, msg=k)


# ------------------------------------------------------------------ expert parallel, 2 gloo processes

MOE = ModelConfig(
    arch="qwen3_moe",
    vocab_size=64,
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    hidden_dim=64,
    n_routed_experts=4,
    n_experts_per_tok=2,
    moe_hidden_dim=32,
)


def _ep_worker(
    rank: int, port: int, redis_url: str, root: str, out: dict[str, Any], fp8: bool = False
) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    from torch.distributed.tensor import DTensor

    from trainer.fp8 import Fp8RoutedExperts
    from trainer.train import Dist, Trainer

    d = Dist("cpu")
    try:
        for ep in (1, 2):
            cfg = RunConfig()
            cfg.model = MOE
            cfg.redis.prefix = d.broadcast(f"tp-{uuid.uuid4().hex[:8]}")
            cfg.trainer.nproc = 2
            cfg.trainer.ep = ep
            cfg.trainer.lr = 3e-3
            cfg.trainer.packing = True
            cfg.trainer.micro_batch_tokens = 48
            cfg.trainer.router_replay = False
            cfg.trainer.fp8 = fp8
            # EP's experts are an FSDP unit inside the checkpointed block: SAC must cope with it.
            cfg.trainer.activation_checkpoint = "selective" if ep == 2 else "none"
            run_dir = Path(root) / f"ep{ep}"
            t = Trainer(cfg, run_dir, redis_url, d)
            t.setup()
            res = [t.train_step(_groups(s)) for s in range(3)]
            t.publisher.publish(t.model, 99, run_dir / "weights" / "step_99")
            t.publisher.wait()
            _write_single(t, 98)
            w1 = t.model.layers["0"].moe.experts.w1
            assert isinstance(w1, DTensor)
            if rank == 0:
                out[ep] = {
                    "losses": [r.loss for r in res],
                    "grad_norms": [r.grad_norm for r in res],
                    "expert_mesh": list(w1.device_mesh.mesh_dim_names or ()),
                    "local_experts": int(w1.to_local().shape[0]),
                    "fp8_experts": isinstance(t.model.layers["0"].moe.experts, Fp8RoutedExperts),
                }
    finally:
        d.close()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_expert_parallel_matches_fsdp_only(redis_server: str, tmp_path: Path, fp8: bool) -> None:
    """trainer.ep = 2 (with selective AC) on 2 processes: experts split over the ranks (all-to-all
    dispatch), yet the same losses, gradient norms and trained weights as plain FSDP without AC;
    publishing gathers them back into HF's per-expert tensors exactly as the full-state-dict path.
    With trainer.fp8 the experts are the FP8 ones (each expert quantised whole on its rank, the
    dispatch's rows computed row by row), so the same holds."""
    out = mp.Manager().dict()
    mp.start_processes(
        _ep_worker, args=(_free_port(), redis_server, str(tmp_path), out, fp8), nprocs=2, start_method="fork"
    )
    fsdp, ep = out[1], out[2]
    assert ep["fp8_experts"] is fsdp["fp8_experts"] is fp8
    assert ep["expert_mesh"] == ["efsdp", "ep"] and ep["local_experts"] == 2  # 4 experts / 2 ranks
    assert fsdp["local_experts"] == 2  # FSDP alone shards the 4 experts' dim 0 too
    torch.testing.assert_close(torch.tensor(ep["losses"]), torch.tensor(fsdp["losses"]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        torch.tensor(ep["grad_norms"]), torch.tensor(fsdp["grad_norms"]), rtol=1e-5, atol=1e-6
    )
    w_fsdp, w_ep = (
        _load(tmp_path / "ep1" / "weights" / "step_99"),
        _load(tmp_path / "ep2" / "weights" / "step_99"),
    )
    assert w_fsdp.keys() == w_ep.keys() and any(".mlp.experts.3." in k for k in w_ep)
    for k in w_fsdp:
        torch.testing.assert_close(w_ep[k], w_fsdp[k], rtol=1e-4, atol=1e-5, msg=k)
    for run in ("ep1", "ep2"):
        _assert_same_dirs(tmp_path / run / "weights" / "step_99", tmp_path / run / "weights" / "step_98")
