"""The trainer against a real Redis: a full run, a SIGKILL + restart, and 1 vs 2 processes.

A small in-test "orchestrator" (Feeder) samples groups from the published weights, exactly as
the real one would (inference log-probs and versions recorded per token), and rewards
completion tokens in a favoured set, so learning shows up as that set's probability rising.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.trainer_process import assert_first_adam_step_close, run_trainer_steps, start_trainer

from services.common.bus import TRAINER_GROUP, Bus
from services.common.config import KeepWeights, RunConfig
from services.common.schemas import RolloutGroup, Sample, WeightsInfo
from services.common.weights_dir import read_model_dir, step_dir, versions
from trainer.model import build_model, load_weights_dir
from trainer.train import Trainer, latest_checkpoint
from trainer.train import run as run_trainer

FAVOURED = set(range(16))  # a quarter of the 64-token vocab
PROMPT = [20, 21, 22]


def make_cfg(run_dir: Path, **trainer: object) -> RunConfig:
    cfg = RunConfig()
    cfg.redis.prefix = f"t-{uuid.uuid4().hex[:8]}"
    cfg.run.dir = str(run_dir)
    cfg.run.max_steps = 6
    cfg.orchestrator.batch_size = 4
    cfg.orchestrator.group_size = 4
    cfg.orchestrator.max_off_policy_steps = 1
    cfg.trainer.lr = 1e-2
    cfg.trainer.checkpoint_every = 2
    for k, v in trainer.items():
        setattr(cfg.trainer, k, v)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.dump())
    return cfg


def sample_group(
    model: torch.nn.Module, version: int, group_size: int, n_new: int, seed: int
) -> RolloutGroup:
    """G completions of PROMPT sampled at T=1, reward = share of favoured tokens, A = r - mean."""
    gen = torch.Generator().manual_seed(seed)
    toks = torch.tensor([PROMPT] * group_size)
    lps: list[torch.Tensor] = []
    with torch.no_grad():
        for _ in range(n_new):
            logp = model(toks).float().log_softmax(-1)[:, -1]
            nxt = torch.multinomial(logp.exp(), 1, generator=gen)
            lps.append(logp.gather(-1, nxt).squeeze(-1))
            toks = torch.cat([toks, nxt], dim=1)
    comp = toks[:, len(PROMPT) :]
    rewards = [sum(int(t) in FAVOURED for t in row) / n_new for row in comp.tolist()]
    mean = sum(rewards) / len(rewards)
    p = len(PROMPT)
    samples = [
        Sample(
            rollout_id=f"s{seed}-{i}",
            tokens=toks[i].tolist(),
            loss_mask=[0] * p + [1] * n_new,
            logprobs=[0.0] * p + [float(lp[i]) for lp in lps],
            versions=[-1] * p + [version] * n_new,
            reward=rewards[i],
            advantage=rewards[i] - mean,
        )
        for i in range(group_size)
    ]
    return RolloutGroup(group_id=f"g{seed}-v{version}", env="favour", seed=seed, samples=samples)


def favoured_mass(weights: Path) -> float:
    m, sd = load_weights_dir(weights)
    model = build_model(m)
    model.load_state_dict(sd)
    with torch.no_grad():
        p = model(torch.tensor([PROMPT])).float().softmax(-1)[0, -1]
    return float(p[sorted(FAVOURED)].sum())


class Feeder(threading.Thread):
    """Each time weights:latest changes to version v, push: one group sampled from v-2 (too
    stale with max_off_policy_steps=1: must be dropped), one from v-1 (staleness 1: trained)
    and batch_size-1 on-policy ones. If the trainer idles (nothing new for a while), top up."""

    def __init__(self, cfg: RunConfig, redis_url: str, run_dir: Path):
        super().__init__(daemon=True)
        self.cfg, self.run_dir = cfg, run_dir
        self.bus = Bus(redis_url, cfg.redis.prefix)
        self.stop = threading.Event()
        self.pushed: dict[str, str] = {}  # group_id -> kind ("fresh", "stale1", "stale2")
        self.seed = 0
        self.error: BaseException | None = None

    def _group(self, version: int, kind: str) -> None:
        for _ in range(50):  # the trainer may be rewriting this step dir after a rollback
            try:
                m, sd = load_weights_dir(step_dir(self.run_dir, version))
                break
            except (FileNotFoundError, OSError):
                time.sleep(0.05)
        model = build_model(m)
        model.load_state_dict(sd)
        self.seed += 1
        g = sample_group(model, version, self.cfg.orchestrator.group_size, 4, self.seed)
        self.pushed[g.group_id] = kind
        self.bus.push_group(g)

    def feed(self, v: int) -> None:
        if v >= 2:
            self._group(v - 2, "stale2")
        n = self.cfg.orchestrator.batch_size
        if v >= 1:
            self._group(v - 1, "stale1")
            n -= 1
        for _ in range(n):
            self._group(v, "fresh")

    def run(self) -> None:
        try:
            last, last_t = -1, time.monotonic()
            while not self.stop.is_set():
                info = self.bus.latest_weights()
                if info is not None and info.version < self.cfg.run.max_steps:
                    if info.version != last or time.monotonic() - last_t > 8.0:
                        last, last_t = info.version, time.monotonic()
                        self.feed(info.version)
                time.sleep(0.02)
        except BaseException as e:  # surfaced by the test
            self.error = e


def run_with_feeder(cfg: RunConfig, run_dir: Path, redis_url: str) -> Feeder:
    """trainer.train.run in this process to run.max_steps while a Feeder pushes its groups;
    returns the stopped feeder (the caller checks its `error` and what it pushed)."""
    feeder = Feeder(cfg, redis_url, run_dir)
    feeder.start()
    try:
        assert run_trainer(cfg, run_dir, redis_url) == 0
    finally:
        feeder.stop.set()
        feeder.join(10)
    return feeder


def metrics(bus: Bus) -> list[dict[str, object]]:
    return [m.model_dump() for _, m in bus.read_metrics()]


def unconsumed_groups(bus: Bus) -> set[str]:
    """Groups whose entries were never acked: pending, or not yet delivered to the trainer."""
    info = next(g for g in bus.r.xinfo_groups(bus.k.rollouts) if g["name"] == TRAINER_GROUP)
    last = info["last-delivered-id"]
    pending = {p["message_id"] for p in bus.r.xpending_range(bus.k.rollouts, TRAINER_GROUP, "-", "+", 10_000)}
    out = set()
    for eid, fields in bus.r.xrange(bus.k.rollouts):
        if eid in pending or tuple(map(int, eid.split("-"))) > tuple(map(int, last.split("-"))):
            out.add(json.loads(fields["group"])["group_id"])
    return out


def check_ledger(bus: Bus, feeder: Feeder) -> dict[str, int]:
    """Every pushed group was trained exactly once, dropped (stale), or is still unacked."""
    ledger = bus.ledger()
    trained: dict[str, int] = ledger["trained"]  # type: ignore[assignment]
    dropped: dict[str, str] = ledger["dropped"]  # type: ignore[assignment]
    assert trained and all(c == 1 for c in trained.values()), trained
    assert not set(trained) & set(dropped)
    for gid in dropped:
        # Only truly stale groups are dropped: the reason's staleness exceeds the limit and its
        # min_version is the version the group was sampled from (g{seed}-v{version}). Usually
        # these are the feeder's stale2 groups; under a loaded machine a slow restart lets the
        # feeder top up while the trainer rolls back, and a "fresh" group can then wait in the
        # stream until it is too stale (the trainer is right to drop it).
        m = re.fullmatch(
            r"stale: trainer v(\d+) - min_version (-?\d+) = (-?\d+) > max_off_policy_steps (\d+)",
            dropped[gid],
        )
        assert m and int(m.group(3)) > int(m.group(4)), (gid, dropped[gid])
        assert gid.endswith(f"-v{m.group(2)}"), (gid, dropped[gid])
    left = unconsumed_groups(bus)
    lost = set(feeder.pushed) - set(trained) - set(dropped) - left
    assert not lost, f"acked but neither trained nor dropped: {lost}"
    return trained


def test_full_run_publishes_acks_and_learns(redis_server: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = make_cfg(run_dir)
    feeder = run_with_feeder(cfg, run_dir, redis_server)
    assert feeder.error is None
    bus = Bus(redis_server, cfg.redis.prefix)
    n = cfg.run.max_steps
    # run.keep_weights (default: the newest 3 and every 100th, step_0 included) deleted the rest.
    assert versions(run_dir) == [0, n - 2, n - 1, n]
    for v in versions(run_dir):
        assert (step_dir(run_dir, v) / "model.safetensors").is_file()
        assert json.loads((step_dir(run_dir, v) / "relay.json").read_text())["version"] == v
    latest = bus.latest_weights()
    assert latest is not None and latest.version == n and latest.path == str(step_dir(run_dir, n))

    ms = metrics(bus)
    assert [m["step"] for m in ms] == list(range(1, n + 1))
    assert all(m["groups"] == 4 and m["samples"] == 16 and m["tokens"] == 16 * 7 for m in ms)
    assert all(m["entropy"] > 0 and m["tokens_per_s"] > 0 and m["step_s"] > 0 for m in ms)
    assert all(m["reward_by_env"].keys() == {"favour"} for m in ms)
    # Steps at v >= 1 train one staleness-1 group; from v >= 2 one staleness-2 group is dropped.
    assert [m["staleness_max"] for m in ms] == [0] + [1] * (n - 1)
    assert [m["dropped_stale"] for m in ms] == [0, 0] + [1] * (n - 2)

    trained = check_ledger(bus, feeder)
    assert len(trained) == 4 * n
    assert len(bus.ledger()["dropped"]) == n - 2  # type: ignore[arg-type]
    assert not bus.r.xpending(bus.k.rollouts, TRAINER_GROUP)["pending"]
    state = bus.r.hgetall(bus.k.trainer_state)
    assert state["version"] == str(n) and state["status"] == "done" and state["last_checkpoint"] == str(n)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_4", "step_6"]
    # Learning: the favoured tokens gained probability mass after the prompt.
    before, after = favoured_mass(step_dir(run_dir, 0)), favoured_mass(step_dir(run_dir, n))
    assert after > before + 0.1, (before, after)


def test_keep_weights_no_stop_checkpoint_and_step_shape_metrics(redis_server: str, tmp_path: Path) -> None:
    """run.keep_weights = {last = 3, every = 0} deletes all but the newest published versions
    (no service serves an older one, and step_0, the seeded init, is not needed by a restart),
    checkpoint_on_stop = false writes no checkpoint at the run's end, and each step reports its
    groups by staleness, its loss tokens and its longest sample."""
    run_dir = tmp_path / "run"
    cfg = make_cfg(run_dir, checkpoint_on_stop=False, checkpoint_every=1000)
    # 3: the feeder samples its stale groups from the version two before the latest
    cfg.run.keep_weights = KeepWeights(last=3, every=0)
    cfg.run.max_steps = 4
    (run_dir / "config.json").write_text(cfg.dump())
    feeder = run_with_feeder(cfg, run_dir, redis_server)
    assert feeder.error is None
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["step_2", "step_3", "step_4"]
    assert Bus(redis_server, cfg.redis.prefix).latest_weights().version == 4  # type: ignore[union-attr]
    assert not (run_dir / "checkpoints").exists()
    ms = metrics(Bus(redis_server, cfg.redis.prefix))
    assert [m["step"] for m in ms] == [1, 2, 3, 4]
    for m in ms:
        hist = m["staleness_groups"]
        assert sum(hist) == m["groups"] and len(hist) == m["staleness_max"] + 1  # type: ignore[arg-type]
        # the feeder's samples: a 3-token prompt and 4 sampled tokens, each sampled token in the loss
        assert m["loss_tokens"] == m["samples"] * 4 and m["sample_tokens_max"] == 7
    assert [m["staleness_groups"] for m in ms][1:] == [[3, 1]] * 3  # one staleness-1 group a step


def _events(log: Path, msg: str) -> list[dict[str, object]]:
    out = []
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            if rec.get("msg") == msg:
                out.append(rec)
    return out


def test_sigkill_restart_resumes_from_checkpoint_without_double_training(
    redis_server: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    cfg = make_cfg(run_dir)
    cfg.run.max_steps = 7
    (run_dir / "config.json").write_text(cfg.dump())
    bus = Bus(redis_server, cfg.redis.prefix)
    log = run_dir / "trainer.log"
    feeder = Feeder(cfg, redis_server, run_dir)
    feeder.start()
    try:
        proc = start_trainer(cfg, run_dir, redis_server, log)
        deadline = time.monotonic() + 60
        while (w := bus.latest_weights()) is None or w.version < 3:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "trainer made no progress"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)  # usually: published 3, checkpoint at 2 (weights newer)
        proc.wait(10)
        published_before_kill = bus.latest_weights().version  # type: ignore[union-attr]
        ckpt = latest_checkpoint(run_dir)
        assert ckpt is not None
        proc = start_trainer(cfg, run_dir, redis_server, log)
        assert proc.wait(90) == 0, log.read_text()
    finally:
        feeder.stop.set()
        feeder.join(10)
        if proc.poll() is None:
            proc.kill()
    assert feeder.error is None
    ready = _events(log, "trainer ready")
    assert len(ready) == 2 and ready[0]["resumed_from"] is None
    # It resumed from the newest checkpoint on disk; when weights newer than it had been
    # published, it numbers on after them (versions never go back).
    assert ready[1]["resumed_from"] == str(ckpt[1]) and ckpt[0] >= 2
    assert ready[1]["version"] in (ckpt[0], published_before_kill + 1)
    published = [m["version"] for m in metrics(bus)]
    assert published == sorted(published), f"weight versions went back: {published}"
    check_ledger(bus, feeder)
    w = bus.latest_weights()
    assert w is not None and w.version == 7
    assert (step_dir(run_dir, 7) / "model.safetensors").is_file()
    state = bus.r.hgetall(bus.k.trainer_state)
    assert state["status"] == "done" and state["last_checkpoint"] == "7"


@pytest.mark.parametrize("window", ["published", "write-in-flight", "redis-lost"])
def test_resume_when_published_weights_are_newer_than_checkpoint(
    redis_server: str, tmp_path: Path, window: str
) -> None:
    """Crash window: step 3 committed (its metrics pushed), checkpoint only at 2; weights:latest
    says 3, or (write-in-flight: killed while the background publisher wrote step 3) still says 2,
    with weights/step_3 on disk unpublished, or (redis-lost: Redis lost its last writes) both
    weights:latest and the recorded trainer state say 2 while weights/step_3 is on disk. Every
    time the trainer resumes from checkpoint 2's model and optimizer, publishes it as version 4
    (a version number is never reused for other weights, weights/step_3 is never rewritten),
    trains on from there and never trains a group twice."""
    run_dir = tmp_path / "run"
    cfg = make_cfg(run_dir)
    cfg.run.max_steps = 3
    feeder = run_with_feeder(cfg, run_dir, redis_server)
    shutil.rmtree(run_dir / "checkpoints" / "step_3")  # as if killed before checkpointing 3
    first_step3 = (step_dir(run_dir, 3) / "model.safetensors").read_bytes()

    cfg2 = cfg.model_copy(deep=True)
    cfg2.run.max_steps = 5
    bus = Bus(redis_server, cfg.redis.prefix)
    if window != "published":  # the background publisher had not yet set weights:latest to 3
        bus.publish_weights(WeightsInfo(version=2, path=str(step_dir(run_dir, 2))))
    if window == "redis-lost":
        bus.r.hset(bus.k.trainer_state, "version", 2)
    trainer = Trainer(cfg2, run_dir, redis_server)
    trainer.setup()
    assert trainer.version == 4 and trainer.last_checkpoint == 2
    w = bus.latest_weights()
    assert w is not None and w.version == 4 and w.path == str(step_dir(run_dir, 4))
    # version 4 is checkpoint 2's model, not step 3's
    assert (step_dir(run_dir, 4) / "model.safetensors").read_bytes() != first_step3
    _, sd2 = load_weights_dir(step_dir(run_dir, 2))
    _, sd4 = load_weights_dir(step_dir(run_dir, 4))
    assert all(torch.equal(sd2[k], sd4[k]) for k in sd2)
    feeder2 = Feeder(cfg2, redis_server, run_dir)
    feeder2.pushed = dict(feeder.pushed)
    feeder2.seed = 1000
    feeder2.start()
    try:
        assert trainer.run() == 0
    finally:
        feeder2.stop.set()
        feeder2.join(10)
        trainer.d.close()
    assert feeder2.error is None
    assert [m["step"] for m in metrics(bus)] == [1, 2, 3, 5]
    assert (step_dir(run_dir, 3) / "model.safetensors").read_bytes() == first_step3
    check_ledger(bus, feeder2)
    assert bus.latest_weights().version == 5  # type: ignore[union-attr]


def test_resume_without_a_checkpoint_numbers_on(redis_server: str, tmp_path: Path) -> None:
    """Killed (or out of disk) before its first checkpoint after reaching version 3: the trainer
    starts again from weights/step_0 (no optimizer state to resume) and publishes it as version 4,
    never as 0 again: a version number is never reused for other weights."""
    run_dir = tmp_path / "run"
    cfg = make_cfg(run_dir)
    cfg.run.max_steps = 3
    run_with_feeder(cfg, run_dir, redis_server)
    shutil.rmtree(run_dir / "checkpoints")
    trainer = Trainer(cfg.model_copy(deep=True), run_dir, redis_server)
    try:
        trainer.setup()
    finally:
        trainer.d.close()
    assert trainer.version == 4 and trainer.last_checkpoint == -1
    _, sd0 = load_weights_dir(step_dir(run_dir, 0))
    _, sd4 = load_weights_dir(step_dir(run_dir, 4))
    assert all(torch.equal(sd0[k], sd4[k]) for k in sd0)
    assert Bus(redis_server, cfg.redis.prefix).latest_weights().version == 4  # type: ignore[union-attr]


def test_stop_key_and_sigterm_exit_cleanly(redis_server: str, tmp_path: Path) -> None:
    """No data arrives; the control:stop key stops an in-process trainer, SIGTERM a subprocess.
    Both exit 0 with nothing acked."""
    run_dir = tmp_path / "run"
    cfg = make_cfg(run_dir)
    bus = Bus(redis_server, cfg.redis.prefix)
    bus.r.set(bus.k.control_stop, "1")
    assert run_trainer(cfg, run_dir, redis_server) == 0
    assert bus.r.hgetall(bus.k.trainer_state)["status"] == "stopped"
    bus.r.delete(bus.k.control_stop)

    log = run_dir / "trainer.log"
    proc = start_trainer(cfg, run_dir, redis_server, log)
    try:
        deadline = time.monotonic() + 60
        while bus.r.hget(bus.k.trainer_state, "pid") != str(proc.pid):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert bus.r.hgetall(bus.k.trainer_state)["status"] == "stopped"
    assert _events(log, "trainer exit")


def _one_step(
    redis_url: str,
    run_dir: Path,
    groups: list[RolloutGroup],
    nproc: int,
    tied: bool = True,
    **trainer: object,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """One trainer step (lr 1e-3, 24-token micro-batches) on `groups` with `nproc` processes:
    its metrics and the published weights; every group trained once. tied: model.tie_embeddings."""
    cfg = make_cfg(run_dir, nproc=nproc, micro_batch_tokens=24, lr=1e-3, **trainer)
    cfg.run.max_steps = 1
    cfg.model.tie_embeddings = tied
    bus = Bus(redis_url, cfg.redis.prefix)
    for g in groups:
        bus.push_group(g)
    run_trainer_steps(cfg, run_dir, redis_url, timeout_s=120)
    assert bus.ledger()["trained"] == {g.group_id: 1 for g in groups}
    (mt,) = metrics(bus)
    return mt, read_model_dir(step_dir(run_dir, 1))[1]


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun/gloo test runs on Linux")
@pytest.mark.parametrize(
    ("nproc", "tied"),
    [
        # tp 2 alone is what every dp replica of dp2xtp2 runs: a repeat, make test-full only
        pytest.param(2, True, id="tp2", marks=pytest.mark.full),
        pytest.param(4, True, id="dp2xtp2"),
        pytest.param(2, False, id="tp2-untied"),
    ],
)
def test_tensor_parallel_matches_one_process(
    redis_server: str, tmp_path: Path, nproc: int, tied: bool
) -> None:
    """trainer.tp = 2 over 2 processes, FSDP over 2 dp ranks x tp 2 (2D DTensors), and tp 2 with an
    untied head, gloo: every block's projections and MLP sharded, the embedding, norms and chunked
    head replicated. The same update as 1 process: loss, entropy, gradient norm, tokens, weights."""
    base = RunConfig()
    model = build_model(base.model, seed=base.run.seed, init_std=base.trainer.init_std)
    groups = [
        sample_group(model, 0, 4, 3 + i, seed=200 + i).model_copy(update={"group_id": f"tp-{i}"})
        for i in range(4)  # orchestrator.batch_size groups: one step
    ]
    packed = {"packing": True, "logprob_chunk_tokens": 5}
    m1, w1 = _one_step(redis_server, tmp_path / "run1", groups, 1, tied, **packed)
    m2, w2 = _one_step(redis_server, tmp_path / f"run{nproc}", groups, nproc, tied, tp=2, **packed)
    assert ("lm_head.weight" in w1) != tied  # the untied case has its own head matrix
    assert m1["grad_norm"] > 0
    for k in ("loss", "entropy", "grad_norm", "mismatch_kl_k3"):
        assert m2[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-7), k
    assert m1["tokens"] == m2["tokens"]
    assert_first_adam_step_close(w1, w2, lr=1e-3)  # the reduction order of 2D sharding


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun/gloo test runs on Linux")
@pytest.mark.parametrize(
    "fast",
    [
        pytest.param(False, id="padded"),
        # packing and chunked log-probs over processes: also what test_tensor_parallel_matches_one_process runs
        pytest.param(True, id="packed-chunked", marks=pytest.mark.full),
    ],
)
def test_two_processes_match_one(redis_server: str, tmp_path: Path, fast: bool) -> None:
    """The same batch through 1 process and through torchrun --nproc_per_node=2 (gloo, FSDP2)
    gives the same update. A small micro-batch budget makes the ranks run different numbers of
    micro-batches (one runs a zero-weight filler). With `fast`, the 2-process run packs its
    micro-batches and computes chunked log-probs (the 1-process reference stays padded/full)."""
    base = RunConfig()
    model = build_model(
        base.model, seed=base.run.seed, init_std=base.trainer.init_std
    )  # = the trainer's step_0
    groups = []
    for i in range(4):
        g = sample_group(model, 0, 4, 3 + i, seed=100 + i)  # different lengths per group
        groups.append(g.model_copy(update={"group_id": f"same-{i}"}))

    m1, w1 = _one_step(redis_server, tmp_path / "run1", groups, 1)
    fast_knobs = {"packing": True, "logprob_chunk_tokens": 5} if fast else {}
    m2, w2 = _one_step(redis_server, tmp_path / "run2", groups, 2, **fast_knobs)
    assert m1["grad_norm"] > 0 and m1["masked_ratio_frac"] < 0.05
    for k in ("loss", "entropy", "grad_norm", "masked_ratio_frac"):
        assert m2[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-7), k
    assert m1["tokens"] == m2["tokens"]
    assert w1.keys() == w2.keys()
    w0 = read_model_dir(step_dir(tmp_path / "run1", 0))[1]
    for k in w1:
        assert (w1[k] - w0[k]).abs().max() > 0 or k.endswith("norm.weight"), k
        dd = (w2[k] - w1[k]).abs()
        i = int(dd.argmax())
        w0_ = read_model_dir(step_dir(tmp_path / "run1", 0))[1][k]
        print(
            "DIFF",
            k,
            float(dd.max()),
            "upd1",
            float((w1[k] - w0_).reshape(-1)[i]),
            "upd2",
            float((w2[k] - w0_).reshape(-1)[i]),
            "n>1e-6",
            int((dd > 1e-6).sum()),
            dd.numel(),
        )
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-5, msg=k)


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun/gloo test runs on Linux")
def test_checkpoint_resumes_on_other_world_size(redis_server: str, tmp_path: Path) -> None:
    """Step 1 on N processes -> checkpoint -> step 2 on M processes, for (N, M) = (2, 1) and
    (1, 2), matches 2 uninterrupted steps in 1 process: same step-2 loss and grad norm (they
    depend on the model state) and same step-2 weights (they depend on Adam's moments too).
    The checkpoint holds full (unsharded) tensors, so no resharding step is needed."""
    base = RunConfig()
    model = build_model(base.model, seed=base.run.seed, init_std=base.trainer.init_std)
    groups = [
        sample_group(model, 0, 4, 3 + i % 3, seed=200 + i).model_copy(update={"group_id": f"rs-{i}"})
        for i in range(8)
    ]

    def prepare(name: str) -> tuple[RunConfig, Path, Bus]:
        run_dir = tmp_path / name
        cfg = make_cfg(run_dir, micro_batch_tokens=24, lr=1e-3)
        bus = Bus(redis_server, cfg.redis.prefix)
        for g in groups:
            bus.push_group(g)  # 4 per step: a step reads only the 4 it needs
        return cfg, run_dir, bus

    cfg, ref_dir, ref_bus = prepare("ref")
    cfg.run.max_steps = 2
    run_trainer_steps(cfg, ref_dir, redis_server, timeout_s=180)
    ref = metrics(ref_bus)
    assert [m["step"] for m in ref] == [1, 2] and ref[1]["masked_ratio_frac"] < 0.05
    ref_w = read_model_dir(step_dir(ref_dir, 2))[1]

    for first, second in ((2, 1), (1, 2)):
        cfg, run_dir, bus = prepare(f"w{first}to{second}")
        cfg.run.max_steps = 1
        cfg.trainer.nproc = first
        run_trainer_steps(cfg, run_dir, redis_server, timeout_s=180)
        ckpt = latest_checkpoint(run_dir)
        assert ckpt is not None and ckpt[0] == 1
        state = torch.load(ckpt[1] / "state.pt", weights_only=True)
        assert state["world"] == first and all(not hasattr(t, "placements") for t in state["model"].values())

        cfg.run.max_steps = 2
        cfg.trainer.nproc = second
        run_trainer_steps(cfg, run_dir, redis_server, timeout_s=180)
        ms = metrics(bus)
        assert [m["step"] for m in ms] == [1, 2], (first, second)  # resumed at 1, not from scratch
        assert bus.ledger()["trained"] == {f"rs-{i}": 1 for i in range(8)}
        for k in ("loss", "entropy", "grad_norm", "masked_ratio_frac"):
            for a, b in zip(ms, ref, strict=True):
                assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), (first, second, k)
        w = read_model_dir(step_dir(run_dir, 2))[1]
        assert w.keys() == ref_w.keys()
        for k in w:
            torch.testing.assert_close(
                w[k], ref_w[k], rtol=0, atol=1e-5, msg=lambda m, tag=f"{first}->{second} {k}": f"{tag}: {m}"
            )
