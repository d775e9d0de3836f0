"""Faults survived, each against real processes and a real Redis: a killed or stopped Redis comes
back under its supervisor with its data and clients reconnect; decode, sandbox and the KV store
gateway ride out a longer Redis outage without a restart; a hung service is killed and
restarted by its supervisor's liveness probe; a service whose loop died says so on /health; a
supervisor started after a killed one waits for the child it left; the trained ledger and the
metrics stream stay exact when a write is retried; admission is derived from the ledger; the
task order continues after a restart; groups wait out a sandbox outage. Whole runs with faults
injected: test_faults_pipeline.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import redis
from helpers.debug_weights import spread_debug_versions
from helpers.decode_server import decode_server
from helpers.service_process import start_service, start_with_config, wait_registered
from test_agent_budgets import ENV, assert_accounted, budget_cfg, budget_sandbox, run_groups
from test_sandbox_service import Sandbox

from sbatch.supervisor import supervisor_argv
from services.common.auth import REDIS_PASSWORD_ENV, auth_headers
from services.common.bus import Bus, Keys, connect
from services.common.config import REPO_ROOT, RedisSection, RunConfig, load_config
from services.common.net import free_port
from services.common.redis_server import RedisServer, secure_conf, server_argv
from services.common.schemas import RolloutGroup, Sample, TrainerStepMetrics, WeightsInfo
from services.orchestrator.loop import Orchestrator, Progress

__all__ = ["budget_sandbox"]  # the real sandbox process, a module fixture used below

FAST_PROBE = ["--probe-interval-s=0.3", "--probe-timeout-s=0.5", "--probe-failures=2", "--backoff-s=0.2"]


def wait_for(pred: Callable[[], object], timeout: float = 30.0, what: str = "condition") -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = pred()
        except (redis.RedisError, OSError, ValueError):
            got = None
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def supervise(
    name: str, argv: list[str], tmp: Path, redis_url: str, prefix: str, probe: str
) -> subprocess.Popen[bytes]:
    """`python -m sbatch.supervisor` as the launchers start it, with a fast probe."""
    cmd = supervisor_argv(
        name, argv, _policy(), redis_url, prefix, probe, tmp / f"{name}.pid", tmp / f"{name}.log"
    )
    cmd[cmd.index("--") : cmd.index("--")] = FAST_PROBE  # later flags win
    return subprocess.Popen(cmd, cwd=REPO_ROOT, start_new_session=True)


def _policy():  # type: ignore[no-untyped-def]
    from sbatch.supervisor import RestartPolicy

    return RestartPolicy(max_restarts=5)


def state(r: redis.Redis, prefix: str, name: str) -> dict[str, object]:
    raw = r.get(Keys(prefix).supervisor(name))
    return json.loads(raw) if raw else {}


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ------------------------------------------------------------------ Redis under its supervisor


def test_supervised_redis_comes_back_with_its_data(tmp_path: Path) -> None:
    """kill -9 of the Redis server, then SIGSTOP: its supervisor restarts it on the same port (the
    PING probe catches the stopped one), the AOF brings the data back, and one client held across
    both reconnects by itself."""
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    prefix = f"t-faults-{uuid.uuid4().hex[:6]}"
    secure_conf(tmp_path / "redis", os.environ[REDIS_PASSWORD_ENV])  # the tests' password (conftest)
    sup = supervise("redis", server_argv(port, tmp_path / "redis"), tmp_path, url, prefix, "redis")
    try:
        bus = Bus(url, prefix)
        wait_for(bus.r.ping, what="redis up")
        for i in range(50):
            bus.mark_trained([f"g{i}"], step=1 + i // 10)
        bus.r.set("k", "v")
        first = int(wait_for(lambda: state(bus.r, prefix, "redis").get("child_pid"), what="state"))  # type: ignore[arg-type]

        os.kill(first, signal.SIGKILL)
        assert bus.r.get("k") == "v"  # the same client: reconnected while the server came back
        assert len(bus.ledger()["trained"]) == 50  # type: ignore[arg-type]
        second = int(
            wait_for(
                lambda: (
                    state(bus.r, prefix, "redis").get("child_pid") not in (None, first)
                    and state(bus.r, prefix, "redis")["child_pid"]
                ),
                what="restart",
            )  # type: ignore[arg-type]
        )

        os.kill(second, signal.SIGSTOP)  # hung: accepts connections, answers nothing
        st = wait_for(
            lambda: (s := state(bus.r, prefix, "redis")).get("child_pid") not in (None, second) and s,
            timeout=60,
            what="the stopped server replaced",
        )
        assert "unresponsive" in str(st["last_reason"]) and st["last_exit"] == -9  # type: ignore[index]
        assert bus.r.get("k") == "v" and len(bus.ledger()["trained"]) == 50  # type: ignore[arg-type]
    finally:
        stop(sup)


# ------------------------------------------------------------------ services across a Redis outage


@pytest.mark.full  # ~40 s (a decode process); the pipeline test kills the run's Redis in CI
def test_services_ride_out_a_redis_outage(tmp_path: Path) -> None:
    """The run's Redis killed (-9) and away for 4 s, longer than a supervised restart takes: the
    decode, sandbox and KV store gateway processes neither exit nor fail /health, decode serves
    meanwhile, and once Redis is back (same port, its data from the AOF) each one's heartbeat puts
    it back in the registry and decode's weights gate reads the newly announced version."""
    server = RedisServer(tmp_path / "redis").start()
    url = server.url
    kv_cfg = RunConfig(redis=RedisSection(url=url, prefix=f"t-outage-kv-{uuid.uuid4().hex[:6]}"))
    kv_cfg.redis.heartbeat_s = 0.2
    kv_cfg.kvstore.enabled = True
    kv = start_with_config("services.kvstore", kv_cfg, url, tmp_path, "kvstore")
    sb = Sandbox(tmp_path / "sandbox", url)
    dec_dir = tmp_path / "decode"
    dec_dir.mkdir()
    v0, v1 = spread_debug_versions(dec_dir / "weights")
    try:
        with decode_server(
            url, v0, load_config("debug").model, dec_dir, prefix="t-outage-dec", max_seq_len=64
        ) as dec:
            sb.wait_ready()
            kv_bus = Bus(url, kv_cfg.redis.prefix)
            wait_registered(kv_bus, "kvstore", kv, tmp_path / "kvstore.log")
            buses = {"decode": dec.bus, "sandbox": sb.bus, "kvstore": kv_bus}
            urls = {k: b.services(k)[0].url for k, b in buses.items()}
            procs = {"decode": dec.proc, "sandbox": sb.proc, "kvstore": kv}
            gen = {"input_ids": [5, 6], "sampling": {"max_tokens": 3, "ignore_eos": True}}

            assert server.proc is not None
            server.proc.kill()
            server.proc.wait()
            t0 = time.monotonic()
            while time.monotonic() - t0 < 4.0:  # Redis is away: what needs none of it goes on
                for kind, u in urls.items():
                    assert httpx.get(f"{u}/health", timeout=5).status_code == 200, kind
                r = httpx.post(f"{urls['decode']}/v1/generate", json=gen, headers=auth_headers(), timeout=30)
                assert r.status_code == 200 and r.json()["choices"][0]["versions"] == [0, 0, 0], r.text
                time.sleep(0.5)
            server = RedisServer(tmp_path / "redis", port=server.port, password=server.password).start()

            for kind, bus in buses.items():  # entries the AOF brought back (not yet expired)
                for key in bus.r.scan_iter(match=bus.k.service(kind, "*")):
                    bus.r.delete(key)
            for kind, bus in buses.items():  # each heartbeat writes its entry again
                wait_for(lambda b=bus, k=kind: b.services(k), what=f"{kind} registered again")
            dec.bus.publish_weights(WeightsInfo(version=1, path=str(v1)))
            r = httpx.post(
                f"{urls['decode']}/update_weights",
                json={"path": str(v1), "version": 1},
                headers=auth_headers(),
                timeout=60,
            )
            assert r.status_code == 200 and r.json()["version"] == 1, r.text
            for kind, proc in procs.items():
                assert proc.poll() is None, f"{kind} exited {proc.returncode}"
                assert httpx.get(f"{urls[kind]}/health", timeout=5).status_code == 200, kind
    finally:
        sb.stop()
        if kv.poll() is None:
            kv.terminate()
            kv.wait(20)
        server.stop()


# ------------------------------------------------------------------ liveness of HTTP services

# A service as small as it gets: registers itself (its pid) in the registry, answers /health
# (503 once the file FAIL exists, as a service whose loop died does), and keeps its entry alive.
SERVICE = textwrap.dedent(
    """
    import http.server, os, socket, sys, threading, time
    from services.common.bus import Bus
    from services.common.schemas import ServiceInfo
    redis_url, prefix, fail = sys.argv[1], sys.argv[2], sys.argv[3]
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            code = 503 if os.path.exists(fail) else 200
            self.send_response(code); self.end_headers(); self.wfile.write(b"{}")
        def log_message(self, *a): pass
    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    info = ServiceInfo(kind="toy", id=f"toy-{os.getpid()}", url=f"http://127.0.0.1:{srv.server_port}",
                       host=socket.gethostname(), pid=os.getpid())
    bus = Bus(redis_url, prefix)
    def beat():
        while True:
            bus.register(info, 5.0); time.sleep(0.5)
    threading.Thread(target=beat, daemon=True).start()
    print("serving", flush=True)
    srv.serve_forever()
    """
)


def test_probe_restarts_a_hung_service_and_one_whose_health_fails(tmp_path: Path, redis_server: str) -> None:
    prefix = f"t-faults-{uuid.uuid4().hex[:6]}"
    fail = tmp_path / "FAIL"
    argv = [sys.executable, "-c", SERVICE, redis_server, prefix, str(fail)]
    sup = supervise("toy", argv, tmp_path, redis_server, prefix, "http")
    r = connect(redis_server)
    try:
        bus = Bus(redis_server, prefix)
        wait_for(lambda: bus.services("toy"), what="registered")
        first = int(state(r, prefix, "toy")["child_pid"])  # type: ignore[arg-type]
        os.kill(first, signal.SIGSTOP)  # hung: the probe's deadline passes
        st = wait_for(
            lambda: (s := state(r, prefix, "toy")).get("child_pid") not in (None, first) and s, what="restart"
        )
        assert st["last_exit"] == -9 and "unresponsive" in str(st["last_reason"])  # type: ignore[index]
        second = int(st["child_pid"])  # type: ignore[index]
        wait_for(lambda: any(s.pid == second for s in bus.services("toy")), what="re-registered")
        fail.write_text("")  # /health 503 (a task it needs died)
        st = wait_for(
            lambda: (s := state(r, prefix, "toy")).get("child_pid") not in (None, second) and s,
            what="restart",
        )
        assert "HTTP 503" in str(st["last_reason"]), st
        assert st["restarts"] == 2 and st["state"] in ("running", "backoff")  # type: ignore[index]
    finally:
        fail.unlink(missing_ok=True)
        stop(sup)


def test_orchestrator_health_fails_when_its_loop_dies(tmp_path: Path, redis_server: str) -> None:
    """weights:latest holding garbage kills the orchestrator's rollout loop: /health turns 503 with
    the reason, instead of answering "ok" around a dead loop."""
    prefix = f"t-faults-{uuid.uuid4().hex[:6]}"
    cfg = RunConfig(redis=RedisSection(url=redis_server, prefix=prefix))
    (tmp_path / "config.json").write_text(cfg.dump())
    bus = Bus(redis_server, prefix)
    bus.r.set(bus.k.weights_latest, "not json")
    proc = start_service(
        "services.orchestrator", tmp_path / "config.json", redis_server, tmp_path / "orch.log"
    )
    try:
        url = str(wait_for(lambda: [s.url for s in bus.services("orchestrator")], what="registered")[0])  # type: ignore[index]
        resp = wait_for(
            lambda: (h := httpx.get(f"{url}/health", timeout=5)).status_code == 503 and h, what="503"
        )
        body = resp.json()  # type: ignore[union-attr]
        assert body["status"] == "failed" and "rollout loop died" in body["reason"], body
    finally:
        proc.terminate()
        proc.wait(30)


# ------------------------------------------------------------------ the watchdog's restart


CHILD = textwrap.dedent(
    """
    import signal, sys, time
    def term(*_):  # a graceful shutdown that takes a while (decode draining, the trainer's commit)
        time.sleep(8.0); print("drained", flush=True); sys.exit(0)
    signal.signal(signal.SIGTERM, term)
    print("up", flush=True)
    while True:
        time.sleep(0.1)
    """
)


def test_supervisor_started_again_waits_for_the_child_left_behind(tmp_path: Path) -> None:
    """The watchdog starts a killed supervisor again: the new one waits for the old child (which
    got SIGTERM when its supervisor died) to finish shutting down before starting another, so
    two never run at once."""
    cmd = supervisor_argv("svc", [sys.executable, "-c", CHILD], _policy(), pid_file=tmp_path / "svc.pid")
    log = tmp_path / "svc.log"
    first = subprocess.Popen([*cmd[:-4], "--log", str(log), *cmd[-4:]], cwd=REPO_ROOT, start_new_session=True)
    old = int(wait_for(lambda: (tmp_path / "svc.pid").read_text(), what="pid file"))  # type: ignore[arg-type]
    wait_for(lambda: "up" in log.read_text().split(), what="child up")
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    second = subprocess.Popen(
        [*cmd[:-4], "--log", str(log), *cmd[-4:]], cwd=REPO_ROOT, start_new_session=True
    )
    try:
        new = int(
            wait_for(lambda: (p := int((tmp_path / "svc.pid").read_text())) != old and p, what="new child")
        )  # type: ignore[arg-type]
        wait_for(lambda: log.read_text().splitlines().count("up") == 2, what="new child up")
        lines = log.read_text().splitlines()
        # the old child's last words come before the new child starts
        assert lines.index("drained") < max(i for i, x in enumerate(lines) if x == "up")
        assert any("waiting for the previous supervisor's child" in x for x in lines)
        assert new != old
    finally:
        stop(second)


# ------------------------------------------------------------------ idempotent writes


def test_ledger_and_metrics_writes_are_exact_under_retries(redis_server: str) -> None:
    """A write retried after its reply was lost (Redis restarting) must not count twice: the same
    step marking a group again is the same commit; another step training it is a second training.
    A step's metrics pushed again stay one entry."""
    bus = Bus(redis_server, f"t-faults-{uuid.uuid4().hex[:6]}")
    bus.mark_trained(["a", "b"], step=3)
    bus.mark_trained(["a", "b"], step=3)  # the retried commit
    assert bus.ledger()["trained"] == {"a": 1, "b": 1}
    bus.mark_trained(["a"], step=5)  # trained again by a later step: a real second training
    assert bus.ledger()["trained"] == {"a": 2, "b": 1}
    m = TrainerStepMetrics(
        step=4, version=4, groups=1, samples=1, tokens=1, loss=0.0, entropy=0.0, grad_norm=0.0, reward=0.0,
        reward_by_env={}, staleness_mean=0.0, staleness_max=0, masked_ratio_frac=0.0, dropped_stale=0,
        wait_data_s=0.0, step_s=0.0, publish_s=0.0, tokens_per_s=0.0,
    )  # fmt: skip
    bus.push_metrics(m)
    bus.push_metrics(m)
    assert [x.step for _, x in bus.read_metrics()] == [4]


# ------------------------------------------------------------------ admission and task order


def orchestrator(redis_url: str, prefix: str, tmp: Path, **orch: object) -> Orchestrator:
    cfg = RunConfig(redis=RedisSection(url=redis_url, prefix=prefix))
    cfg.run.max_steps = 1000
    cfg.orchestrator.batch_size = 8
    cfg.orchestrator.max_off_policy_steps = 1
    for k, v in orch.items():
        setattr(cfg.orchestrator, k, v)
    return Orchestrator(cfg, Bus(redis_url, prefix), tmp)


def test_admission_follows_the_ledger_across_restarts_and_resumes(redis_server: str, tmp_path: Path) -> None:
    """B = 8, max_off_policy_steps = 1: at most 2 batches pending (started, neither trained nor
    dropped) while decode serves the trainer's version, one less per version the trainer is ahead.
    What the version number says alone does not count: a trainer resumed from an older checkpoint
    numbers on past steps it trained (version 11 after 10 steps of groups), and a resumed run
    starts with groups pending from before."""
    o = orchestrator(redis_server, f"t-faults-{uuid.uuid4().hex[:6]}", tmp_path)
    o.version = 10
    # steady state: 10 steps trained, 5 groups pending
    assert o._allowance(Progress(started=85, trained=80, dropped=0, trainer_version=10, unconsumed=5)) == 11
    # the trainer committed step 11, its weights not rolled out yet: one batch less
    assert o._allowance(Progress(started=93, trained=88, dropped=0, trainer_version=11, unconsumed=5)) == 3
    # resumed from checkpoint 8 after reaching 10: version 11, but only 80 groups trained. Rolled
    # out, the same 2 batches minus what is pending (the version-based bound allowed 8 more).
    o.version = 11
    assert o._allowance(Progress(started=90, trained=80, dropped=4, trainer_version=11, unconsumed=6)) == 10
    # a resumed run: 30 groups pending from its first part (in flight, on the stream) admit none
    assert (
        o._allowance(Progress(started=110, trained=80, dropped=0, trainer_version=11, unconsumed=30)) == -14
    )
    # and the budget: no more than the trainer needs for its remaining steps
    o.cfg.run.max_steps = 12
    assert o._allowance(Progress(started=80, trained=80, dropped=0, trainer_version=11, unconsumed=0)) == 8
    # Progress read from Redis: the ledger and the trainer's committed version in one go
    bus = o.bus
    for g in ("x", "y", "z"):
        bus.r.sadd(bus.k.started, g)
    bus.commit_step(["x"], 1, [], {"version": 1})
    bus.mark_dropped("y", "stale")
    p = o._progress()
    assert (p.started, p.trained, p.dropped, p.trainer_version, p.pending) == (3, 1, 1, 1, 1)


def test_task_order_continues_after_a_restart(redis_server: str, tmp_path: Path) -> None:
    """Group n's task and seed depend on (run.seed, n); the cursor is in Redis, so an orchestrator
    restarted after starting 5 groups goes on with the 6th, not the 1st."""
    prefix = f"t-faults-{uuid.uuid4().hex[:6]}"
    tasks = [{"env": "reverse", "weight": 2.0}, {"env": "reverse-turns", "weight": 1.0}]
    first = orchestrator(redis_server, prefix, tmp_path, tasks=tasks)
    order = [first.spec(n) for n in range(12)]
    assert len({(s.env, s.seed) for s in order}) == 12 and {s.env for s in order} == {
        "reverse",
        "reverse-turns",
    }
    for n in range(5):
        first._record_start(order[n], n + 1)
    again = orchestrator(redis_server, prefix, tmp_path, tasks=tasks)
    assert again.cursor == 0
    asyncio.run(again.load_cursor())
    assert again.cursor == 5
    nxt = again.spec(again.cursor)
    assert (nxt.env, nxt.seed) == (order[5].env, order[5].seed)
    assert (nxt.env, nxt.seed) != (order[0].env, order[0].seed)


# ------------------------------------------------------------------ a sandbox outage


def test_groups_wait_out_a_sandbox_outage(budget_sandbox: object, redis_server: str, tmp_path: Path) -> None:
    """The only sandbox is killed, and a new one starts 5 s later: groups started meanwhile retry
    with back-off (orchestrator.service_retry_s) and all of them finish; none is dropped."""
    sb = budget_sandbox
    prefix = sb.prefix  # type: ignore[attr-defined]
    bus = Bus(redis_server, prefix)
    cfg = budget_cfg(redis_server, prefix)
    sb.proc.kill()  # type: ignore[attr-defined]
    sb.proc.wait()  # type: ignore[attr-defined]
    replacement: list[subprocess.Popen[bytes]] = []

    def restart_later() -> None:
        time.sleep(5.0)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")])}
        with open(tmp_path / "sandbox2.log", "wb") as log:
            replacement.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "services.sandbox",
                        "--config",
                        str(sb.config),
                        "--redis-url",
                        redis_server,
                    ],  # type: ignore[attr-defined]
                    cwd=REPO_ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )  # fmt: skip
            )

    t = threading.Thread(target=restart_later)
    t.start()
    try:
        specs, _seen, took = asyncio.run(run_groups(cfg, bus, tmp_path, [0, 1, 0, 1], env=ENV))
        t.join()
        assert took >= 5.0, "the groups finished before the sandbox was back?"
        assert not bus.ledger()["dropped"], bus.ledger()["dropped"]
        assert_accounted(bus, specs)
    finally:
        t.join()
        for p in replacement:
            sb.proc = p  # type: ignore[attr-defined]  # the module fixture stops the live one


def test_an_unavailable_sandbox_is_given_up_after_service_retry_s(
    budget_sandbox: object, redis_server: str, tmp_path: Path
) -> None:
    """Bounded: with no sandbox at all, a group is dropped once service_retry_s has passed."""
    prefix = f"t-faults-nosb-{uuid.uuid4().hex[:6]}"  # no sandbox registered under this prefix
    bus = Bus(redis_server, prefix)
    cfg = budget_cfg(redis_server, prefix, service_retry_s=2.0, service_retry_max_delay_s=0.5)
    specs, _seen, took = asyncio.run(run_groups(cfg, bus, tmp_path, [0], env=ENV))
    window, delay = cfg.orchestrator.service_retry_s, cfg.orchestrator.service_retry_max_delay_s
    # Not before the retry window is spent (less one back-off: the last wait may end past it),
    # and soon after it: not retrying for ever.
    assert window - delay <= took < window + 4 * delay + 6.0, took
    (reason,) = bus.ledger()["dropped"].values()  # type: ignore[union-attr]
    assert reason.startswith("failed after") and "no live sandbox" in reason
    assert_accounted(bus, specs)


def _group(gid: str) -> RolloutGroup:
    s = Sample(
        rollout_id=f"{gid}.0",
        tokens=[1, 2],
        loss_mask=[0, 1],
        logprobs=[0.0, -1.0],
        versions=[-1, 0],
        reward=1.0,
    )
    return RolloutGroup(group_id=gid, env="reverse", seed=0, samples=[s])


def test_trainer_recovers_entries_whose_read_reply_was_lost(redis_server: str, tmp_path: Path) -> None:
    """Entries delivered to the trainer's consumer whose reply never arrived (Redis restarted
    between running the read and answering it) are taken up before the next batch, not left
    pending until some later restart."""
    from trainer.train import CONSUMER, Trainer

    cfg = RunConfig(redis=RedisSection(url=redis_server, prefix=f"t-faults-{uuid.uuid4().hex[:6]}"))
    cfg.orchestrator.batch_size = 2
    trainer = Trainer(cfg, tmp_path, redis_server)
    trainer.setup()
    bus = trainer.bus
    assert bus is not None
    for i in range(3):
        bus.push_group(_group(f"g{i}"))
    lost = bus.read_groups(CONSUMER, count=2, block_ms=10)  # delivered, as if the reply was lost
    assert len(lost) == 2 and bus.pending_count(CONSUMER) == 2
    batch, entry_ids = trainer._collect()
    assert [g.group_id for g in batch.groups] == ["g0", "g1"]
    assert entry_ids == [eid for eid, _ in lost]
