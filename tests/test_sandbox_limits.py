"""Per-session resource limits of the sandbox (services/sandbox/cgroups.py, isolation.py,
sessions.py), over its real HTTP API with real commands under bubblewrap:

- memory, processes and CPU bound a whole session (everything it runs, together), not each process;
- one session cannot take every exec slot (sandbox.max_execs_per_session);
- a batch create is all or none: a 429 or a failed start leaves no session and no workspace behind.
"""

from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from helpers.sandbox import root_session_root, session
from test_sandbox_service import Sandbox

from services.common.auth import auth_headers
from services.sandbox.envs import Environment, register_env
from services.sandbox.sessions import EnvFailed, SandboxFull, SessionStore

MEMORY_MB = 128
PIDS = 24
CPUS = 0.1


@pytest.fixture(scope="module")
def workroot(bwrap: str) -> Iterator[Path]:
    with root_session_root("relay-limits-test-", "per-session cgroups and uids") as root:
        yield root


@pytest.fixture(scope="module")
def sb(redis_server: str, tmp_path_factory: pytest.TempPathFactory, workroot: Path) -> Iterator[Sandbox]:
    s = Sandbox(
        tmp_path_factory.mktemp("sblimits"),
        redis_server,
        workdir_root=str(workroot),
        max_sessions=6,
        max_concurrent_execs=8,
        max_execs_per_session=2,
        session_memory_mb=MEMORY_MB,
        session_max_pids=PIDS,
        session_cpus=CPUS,
        exec_memory_mb=512,  # per process: above the session's, so the session's must hold
        exec_max_procs=64,  # per uid: above the session's pids
        uid_base=random.randrange(1_000_000, 50_000_000, 1000),
    ).wait_ready()
    health = httpx.get(f"{s.url}/health").json()
    if health["session_limits"] == "rlimits only":
        s.stop()
        pytest.skip(f"no usable cgroups here: {s.log.read_text()[-2000:]}")
    yield s
    s.stop()


@pytest.fixture
def client(sb: Sandbox) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sb.url, timeout=60, headers=auth_headers()) as c:
        yield c


def run(c: httpx.Client, sid: str, cmd: str, timeout_s: float = 30) -> dict[str, object]:
    r = c.post(f"/v1/sessions/{sid}/exec", json={"cmd": cmd, "timeout_s": timeout_s}, timeout=timeout_s + 30)
    assert r.status_code == 200, r.text
    return r.json()


# Each process holds `mb` MiB (touched) for a second, then says so.
HOLD = "python3 -c \"import time; x = bytearray({mb} << 20); time.sleep(1); print('held')\""


def test_memory_is_limited_per_session_not_per_process(client: httpx.Client) -> None:
    sid = session(client)
    one = run(client, sid, HOLD.format(mb=48))
    assert one["exit_code"] == 0 and one["stdout"] == "held\n"
    # Two processes of 48 MiB more than the session's memory holds: each within every per-process
    # limit (512 MiB), over the session's memory together. The kernel kills inside the session
    # until the rest fits.
    fit = MEMORY_MB // 48
    procs = fit + 2
    # The kernel takes its time here (cgroup v1 on a loaded machine: 10-16 s between one kill
    # being reaped and the next), so the command gets minutes, not the usual 30 s.
    each = f'({HOLD.format(mb=48)}; echo "exit $?")'
    r = run(client, sid, " & ".join([each] * procs) + " & wait", timeout_s=150)
    assert r["exit_code"] == 0, r
    # Every holder accounted for: it held its memory (exit 0) or the kernel's OOM killer took it
    # (SIGKILL: 137), never a MemoryError (1), which a per-process limit would give.
    out = str(r["stdout"]).split()
    codes = sorted(int(out[i + 1]) for i, w in enumerate(out) if w == "exit")
    assert len(codes) == procs and set(codes) <= {0, 137}, (codes, r)
    survivors = codes.count(0)
    # Killed until the rest fits: some survive, no more than the session's memory holds, and
    # each survivor finished its hold.
    assert 1 <= survivors <= fit and out.count("held") == survivors, (codes, r)
    # Another session has its own 128 MiB: unaffected.
    other = session(client)
    assert run(client, other, HOLD.format(mb=96))["stdout"] == "held\n"
    for s in (sid, other):
        client.delete(f"/v1/sessions/{s}")


def test_processes_are_limited_per_session(client: httpx.Client) -> None:
    sid = session(client)
    # A subshell forks per sleep: when a fork fails the loop stops (a failed `&` ends sh itself).
    loop = "n=0; for i in $(seq 60); do (sleep 5 &) 2>/dev/null || break; n=$((n+1)); done; echo started $n"
    r = run(client, sid, loop)
    # pids.max (24) stops it long before the uid's RLIMIT_NPROC (64); the shell itself and
    # bubblewrap's processes count too.
    started = int(re.search(r"started (\d+)", str(r["stdout"])).group(1))  # type: ignore[union-attr]
    assert started < PIDS, r
    client.delete(f"/v1/sessions/{sid}")


def test_cpu_is_limited_per_session(client: httpx.Client) -> None:
    sid = session(client)
    # Two busy loops for 3 s of wall time: with a tenth of a CPU for the session they get about
    # 0.3 s of CPU time between them, whatever else the machine does.
    spin = 'python3 -c "import time\nt = time.time()\nwhile time.time() - t < 3: pass\nprint(time.process_time())"'
    r = run(client, sid, f"{spin} & {spin} & wait")
    used = [float(x) for x in str(r["stdout"]).split()]
    assert len(used) == 2 and sum(used) < CPUS * 3 * 1.5 + 0.15, used
    client.delete(f"/v1/sessions/{sid}")


def test_one_session_cannot_take_every_exec_slot(client: httpx.Client, sb: Sandbox) -> None:
    hog, other = session(client), session(client)

    def sleep(sid: str) -> httpx.Response:
        with httpx.Client(base_url=sb.url, timeout=30, headers=auth_headers()) as c:
            return c.post(f"/v1/sessions/{sid}/exec", json={"cmd": "sleep 2; echo ok"})

    with ThreadPoolExecutor(5) as pool:
        hogs = [pool.submit(sleep, hog) for _ in range(4)]
        time.sleep(0.7)  # the hog's commands are running (or refused)
        t0 = time.monotonic()
        mine = run(client, other, "echo mine")
        waited = time.monotonic() - t0
        codes = sorted(f.result().status_code for f in hogs)
    assert codes == [200, 200, 429, 429], codes
    refused = next(f.result() for f in hogs if f.result().status_code == 429)
    assert "max_execs_per_session" in refused.json()["detail"] and refused.headers["Retry-After"] == "1"
    assert mine["stdout"] == "mine\n" and waited < 1.5  # another session ran at once
    for s in (hog, other):
        client.delete(f"/v1/sessions/{s}")


def test_batch_create_is_all_or_none(client: httpx.Client) -> None:
    held = [session(client) for _ in range(2)]
    room = 6 - client.get("/health").json()["sessions_open"]
    r = client.post("/v1/sessions/batch", json={"env": "echo", "seed": 1, "n": room + 1})
    assert r.status_code == 429 and f"no room for {room + 1}" in r.json()["detail"], r.text
    assert client.get("/health").json()["sessions_open"] == 6 - room  # none of them was kept
    ok = client.post("/v1/sessions/batch", json={"env": "echo", "seed": 1, "n": room})
    assert ok.status_code == 200 and len(ok.json()["sessions"]) == room
    assert client.get("/health").json()["sessions_open"] == 6
    for s in held + [x["session_id"] for x in ok.json()["sessions"]]:
        client.delete(f"/v1/sessions/{s}")


STARTS = {"n": 0}


@register_env("test-third-start-fails")
class ThirdStartFails(Environment):
    """Starts a workspace per episode; every third start raises."""

    needs_workspace = True

    def reset(self, seed: int) -> str:
        STARTS["n"] += 1
        if STARTS["n"] % 3 == 0:
            raise RuntimeError("the third start fails")
        return "go"

    def step(self, action: str, eos: bool = True) -> tuple[str, bool]:
        return "", True

    def score(self) -> float:
        return 0.0


def test_a_batch_whose_start_fails_keeps_nothing(workroot: Path) -> None:
    from services.sandbox.isolation import WorkspaceManager

    root = workroot / "batch"
    m = WorkspaceManager(root=root, uid_base=random.randrange(1_000_000, 50_000_000, 1000), disk_quota_mb=4)
    store = SessionStore(8, 60.0, workspaces=m)
    STARTS["n"] = 0
    with pytest.raises(EnvFailed, match="the third start fails"):
        store.create_many("test-third-start-fails", 0, 4)
    assert len(store) == 0 and sorted(os.listdir(root)) == []  # the two started ones are gone too
    with pytest.raises(SandboxFull):
        store.create_many("test-third-start-fails", 0, 9)
    assert store.counts.rejected_full == 1 and len(store) == 0
    STARTS["n"] = 0
    made = store.create_many("test-third-start-fails", 0, 2)
    assert len(made) == 2 == len(store)
    store.close_all()
    m.shutdown()
    assert sorted(os.listdir(root)) == []
