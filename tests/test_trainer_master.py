"""World size 1 with bf16 parameters and float32 master weights (trainer.fsdp = "master").

On CPU, one rank of a gloo group (as tests/test_trainer_world1.py), bf16:
- the knob validates and `use_master_weights` decides (one rank, bf16 only);
- the first steps' losses and gradient norms match FSDP2 on the 1-rank group within bf16
  tolerance, and so do the weights after them; the parameters are bf16 and equal the float32
  masters rounded to bf16 after every step;
- gradient accumulation: over 4 micro-batches the master gradient is exactly the float32 sum of
  each micro-batch's bf16 gradient (the main grad), and equals one micro-batch of the same tokens
  within that accumulation's tolerance.
Checkpoints across modes: tests/test_trainer_world1.py (test_checkpoint_moves_between_master_and_fsdp).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from pydantic import ValidationError

from services.common.config import TrainerSection
from trainer.parallel import use_fsdp, use_master_weights

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="gloo process groups run on Linux")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_one_rank(fn: Any, *args: Any) -> None:
    """`fn(*args)` in a new process that is rank 0 of a 1-rank gloo group (step.Ctx joins it).
    Spawned, not forked: after other tests in this pytest process (tensor math, inductor) a forked
    child can deadlock on the parent's thread pools."""
    mp.start_processes(_entry, args=(_free_port(), fn, *args), nprocs=1, start_method="spawn")


def _entry(rank: int, port: int, fn: Any, *args: Any) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    sys.path.insert(0, str(REPO / "bench" / "trainer"))
    try:
        fn(*args)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_master_knob_validates_and_decides() -> None:
    master = TrainerSection(fsdp="master", dtype="bfloat16")
    assert master.fsdp == "master"
    with pytest.raises(ValidationError, match="fsdp"):
        TrainerSection(fsdp="masters")  # type: ignore[arg-type]
    # One rank: no FSDP, master weights (bf16 only); more ranks: FSDP2 as "auto".
    assert not use_fsdp(master, 1, distributed=True) and use_master_weights(master, fsdp=False)
    assert use_fsdp(master, 2, distributed=True) and not use_master_weights(master, fsdp=True)
    assert not use_master_weights(TrainerSection(fsdp="master", dtype="float32"), fsdp=False)
    assert not use_master_weights(TrainerSection(dtype="bfloat16"), fsdp=False)  # "auto": autocast


# ------------------------------------------------------------------ numerics against FSDP2


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from trainer.master_weights import masters_of
    from trainer.param_names import clean_name

    mw = masters_of(model)
    if mw is not None:
        return {n: m.detach().clone() for n, m in zip(mw.names, mw.masters, strict=True)}
    out = {}
    for k, p in model.named_parameters():
        full = getattr(p, "full_tensor", None)
        out[clean_name(k)] = (full() if callable(full) else p).detach().float().clone()
    return out


def _vs_fsdp_worker(path: str) -> None:
    import step

    from trainer.master_weights import masters_of

    ctx = step.Ctx("cpu")
    m = step.model_config("tiny", 1024)
    mine, total = step.rank_data(
        [[100, 37, 260, 120, 3, 211, 293]], m.vocab_size, step.Degrees(1, 1, 1, 1, 1), 0, 7
    )
    mb = step.pack(mine)
    runs: dict[str, Any] = {}
    for name, knobs in (("fsdp", {"fsdp": "always"}), ("master", {"fsdp": "master"})):
        model, opt, deg, meshes = step.build_ours(m, knobs, ctx, dtype="bfloat16")
        first = next(iter(model.parameters()))
        stats, synced = [], []
        for _ in range(3):
            stats.append(step.our_step(model, opt, [mb], total, deg, meshes, ctx.device))
            mw = masters_of(model)
            if mw is not None:  # after every step: the bf16 parameters are the masters, rounded
                synced.append(
                    all(
                        torch.equal(p, mst.to(torch.bfloat16))
                        for p, mst in zip(mw.params, mw.masters, strict=True)
                    )
                )
        mw = masters_of(model)
        runs[name] = {
            "stats": stats,
            "weights": _full_params(model),
            "fsdp": deg.fsdp,
            "master": deg.master,
            "param": (type(first).__name__, str(first.dtype)),
            "master_dtypes": {str(t.dtype) for t in mw.masters} if mw is not None else set(),
            "opt_params": [(str(p.dtype), tuple(p.shape)) for g in opt.param_groups for p in g["params"]],
            "synced": synced,
            "grads_freed": mw is not None and all(p.grad is None for p in mw.params),
            "amp": type(meshes["amp"]).__name__,
        }
        del model, opt
    # Compared here, not in the pytest process: tensor math there starts its OpenMP pool, and a
    # later forked worker can deadlock on it.
    runs["weights_rel"] = _rel(runs["master"].pop("weights"), runs["fsdp"].pop("weights"))
    torch.save(runs, path)


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    num = sum(float(((a[k].float() - b[k].float()) ** 2).sum()) for k in b)
    den = sum(float((b[k].float() ** 2).sum()) for k in b)
    return (num / den) ** 0.5


def test_master_weights_match_fsdp_one_rank(tmp_path: Path) -> None:
    path = tmp_path / "runs.pt"
    _run_one_rank(_vs_fsdp_worker, str(path))
    runs = torch.load(path, weights_only=False)
    fsdp, master = runs["fsdp"], runs["master"]
    # The wrappers: FSDP2's float32 DTensor shards vs plain bf16 parameters + float32 masters,
    # which are what AdamW steps on; no autocast (the parameters already are bf16).
    assert fsdp["fsdp"] and not fsdp["master"] and fsdp["param"] == ("DTensor", "torch.float32")
    assert not master["fsdp"] and master["master"] and master["param"] == ("Parameter", "torch.bfloat16")
    assert master["master_dtypes"] == {"torch.float32"}
    assert [d for d, _ in master["opt_params"]] == ["torch.float32"] * len(master["opt_params"])
    assert [s for _, s in master["opt_params"]] == [s for _, s in fsdp["opt_params"]]
    assert master["amp"] == "nullcontext"
    assert master["synced"] == [True, True, True] and master["grads_freed"]
    # Numerics: the same bf16 forward (FSDP casts its params to bf16 the same way) and float32
    # gradient accumulation; three steps' losses and gradient norms within bf16 tolerance.
    for (lf, gf), (lm, gm) in zip(fsdp["stats"], master["stats"], strict=True):
        assert lm == pytest.approx(lf, rel=1e-2, abs=1e-3)
        assert gm == pytest.approx(gf, rel=2e-2)
    print("master vs fsdp:", fsdp["stats"], master["stats"], "weights rel L2", runs["weights_rel"])
    assert runs["weights_rel"] < 1e-3


# ------------------------------------------------------------------ gradient accumulation


def _accumulation_worker(path: str) -> None:
    import step

    from trainer.master_weights import masters_of

    ctx = step.Ctx("cpu")
    m = step.model_config("tiny", 1024)
    lens = [90, 37, 160, 120, 64, 211, 150, 75]
    mine, total = step.rank_data([lens], m.vocab_size, step.Degrees(1, 1, 1, 1, 1), 0, 5)
    whole = step.pack(mine)
    parts = [step.pack(mine[2 * i : 2 * i + 2]) for i in range(4)]
    model, opt, deg, meshes = step.build_ours(m, {"fsdp": "master"}, ctx, dtype="bfloat16")
    for g in opt.param_groups:
        g["lr"] = 0.0  # AdamW with lr 0 leaves the weights as they are: only gradients here
    mw = masters_of(model)
    assert mw is not None

    def grads() -> list[torch.Tensor]:
        return [mst.grad.detach().clone() for mst in mw.masters]  # type: ignore[union-attr]

    each = []
    for part in parts:  # one micro-batch per step: the master grad is that micro-batch's bf16 grad
        step.our_step(model, opt, [part], total, deg, meshes, ctx.device)
        each.append(grads())
    step.our_step(model, opt, parts, total, deg, meshes, ctx.device)
    accumulated = grads()
    step.our_step(model, opt, [whole], total, deg, meshes, ctx.device)
    one = grads()
    torch.save(_accumulation_checks(each, accumulated, one, mw.names), path)


def _accumulation_checks(
    each: list[list[torch.Tensor]], acc: list[torch.Tensor], one: list[torch.Tensor], names: list[str]
) -> dict[str, Any]:
    """In the worker (see _vs_fsdp_worker): what the test asserts, as plain values."""
    out: dict[str, Any] = {"float32": all(a.dtype == torch.float32 for a in acc)}
    # Each micro-batch's gradient came out of bf16 GEMMs: bf16 values held in float32.
    out["parts_bf16"] = all(
        torch.equal(p[i], p[i].to(torch.bfloat16).float()) for p in each for i in range(len(acc))
    )
    # The main grad: exactly the float32 running sum of the four bf16 gradients.
    exact, bf16_equal = [], []
    for i, name in enumerate(names):
        want = each[0][i].clone()
        s = each[0][i].to(torch.bfloat16)
        for e in each[1:]:
            want += e[i]
            s = s + e[i].to(torch.bfloat16)
        if not torch.equal(acc[i], want):
            exact.append(name)
        bf16_equal.append(torch.equal(acc[i], s.float()))
    out["not_exact"] = exact
    out["all_equal_bf16_sum"] = all(bf16_equal)
    out["rel_one"] = _rel(dict(zip(names, acc, strict=True)), dict(zip(names, one, strict=True)))
    return out


def test_master_grad_accumulates_micro_batches_in_float32(tmp_path: Path) -> None:
    path = tmp_path / "acc.pt"
    _run_one_rank(_accumulation_worker, str(path))
    r = torch.load(path, weights_only=False)
    assert r["float32"] and r["parts_bf16"]
    # The main grad is exactly the float32 running sum of the 4 micro-batches' bf16 gradients.
    assert r["not_exact"] == []
    # Summed in bf16 the same gradients would round at every add: not what was accumulated.
    assert not r["all_equal_bf16_sum"]
    # The same tokens as one micro-batch: equal within the bf16 rounding of the per-micro-batch
    # gradients (the float32 sum adds only float32 rounding). Measured: see docs/trainer.md.
    print("accumulation: 4 micro-batches vs 1, relative L2", r["rel_one"])
    assert r["rel_one"] < 1e-2


# ------------------------------------------------------------------ torch.compile


def _master_trajectory(redis_url: str, root: Path, compile: bool) -> dict[str, Any]:
    """5 real Trainer.train_step calls, one process (no FSDP), bf16 + master weights."""
    import uuid

    from test_trainer_compile import M, _graphs, _groups  # the compile tests' model and data

    from services.common.config import RunConfig
    from trainer.master_weights import masters_of
    from trainer.train import Dist, Trainer

    cfg = RunConfig()
    cfg.model = M
    cfg.redis.prefix = f"tm-{uuid.uuid4().hex[:8]}"
    cfg.trainer.lr = 1e-3
    cfg.trainer.packing = True
    cfg.trainer.micro_batch_tokens = 64
    cfg.trainer.logprob_chunk_tokens = 16
    cfg.trainer.compile = compile
    cfg.trainer.dtype = "bfloat16"
    cfg.trainer.fsdp = "master"
    if compile:
        torch._dynamo.reset()
    base = _graphs()
    t = Trainer(cfg, root / f"master-{compile}", redis_url, Dist("cpu"))
    t.setup()
    mw = masters_of(t.model)
    assert mw is not None and t.degrees.master
    out: dict[str, Any] = {"losses": [], "graphs": [], "synced": []}
    for s in range(5):
        out["losses"].append(t.train_step(_groups(s)).loss)
        out["graphs"].append(_graphs() - base)
        out["synced"].append(
            all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(mw.params, mw.masters, strict=True))
        )
    out["masters"] = {n: m.detach().clone() for n, m in zip(mw.names, mw.masters, strict=True)}
    return out


@pytest.mark.slow  # inductor on CPU: ~30 s with a cold cache
def test_master_weights_compiled_steps_track_eager(redis_server: str, tmp_path: Path) -> None:
    """trainer.compile with master weights: the compiled blocks take the bf16 parameters as
    inputs (compiled once, never again), so the masters' copy into them after each step reaches
    the next forward; losses track eager within bf16 tolerance over 5 steps."""
    sys.path.insert(0, str(REPO / "tests"))
    eager = _master_trajectory(redis_server, tmp_path, False)
    compiled = _master_trajectory(redis_server, tmp_path, True)
    assert compiled["graphs"][0] > 0 and compiled["graphs"][-1] == compiled["graphs"][0], compiled["graphs"]
    assert eager["synced"] == compiled["synced"] == [True] * 5
    assert len(set(eager["losses"])) == 5  # a real, changing loss
    for le, lc in zip(eager["losses"], compiled["losses"], strict=True):
        assert lc == pytest.approx(le, rel=2e-2, abs=2e-3)
    num = sum(float(((compiled["masters"][k] - v) ** 2).sum()) for k, v in eager["masters"].items())
    den = sum(float((v**2).sum()) for v in eager["masters"].values())
    print("master compiled vs eager:", eager["losses"], compiled["losses"], "rel L2", (num / den) ** 0.5)
    assert (num / den) ** 0.5 < 1e-2
