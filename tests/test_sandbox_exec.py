"""Isolated execution over the sandbox's real HTTP API: exec, file read/write, the concurrent-exec
429, session directories removed on delete/score/expiry, and the service surviving abuse."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from helpers.sandbox import session, session_root
from test_sandbox_service import Sandbox

from services.common.auth import auth_headers


@pytest.fixture(scope="module")
def workroot(bwrap: str) -> Iterator[Path]:
    with session_root("relay-sbx-test-") as root:
        yield root


@pytest.fixture(scope="module")
def sb(redis_server: str, tmp_path_factory: pytest.TempPathFactory, workroot: Path) -> Iterator[Sandbox]:
    s = Sandbox(
        tmp_path_factory.mktemp("sbexec"),
        redis_server,
        workdir_root=str(workroot),
        max_concurrent_execs=2,
        session_ttl_s=2.0,
        exec_output_bytes=1000,
        exec_max_procs=32,
        uid_base=random.randrange(1_000_000, 50_000_000, 1000),
    ).wait_ready()
    yield s
    s.stop()


@pytest.fixture
def client(sb: Sandbox) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sb.url, timeout=30, headers=auth_headers()) as c:
        yield c


def sessions_on_disk(workroot: Path) -> list[str]:
    d = workroot / "replica-0"
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_exec_roundtrip_and_files(client: httpx.Client, workroot: Path) -> None:
    sid = session(client)
    r = client.post(f"/v1/sessions/{sid}/exec", json={"cmd": "echo out; echo err >&2; exit 3"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["exit_code"] == 3 and body["stdout"] == "out\n" and body["stderr"] == "err\n"
    assert body["truncated"] is False and body["timed_out"] is False
    # write -> visible to commands -> read back
    r = client.put(f"/v1/sessions/{sid}/files", json={"path": "pkg/a.py", "content": "print('hé')\n"})
    assert r.status_code == 200 and r.json()["bytes"] == len("print('hé')\n".encode())
    r = client.post(f"/v1/sessions/{sid}/exec", json={"cmd": "python3 pkg/a.py"})
    assert r.json()["stdout"] == "hé\n"
    r = client.get(f"/v1/sessions/{sid}/files", params={"path": "pkg/a.py"})
    assert r.status_code == 200 and r.json()["content"] == "print('hé')\n"
    assert client.get(f"/v1/sessions/{sid}/files", params={"path": "nope.txt"}).status_code == 404
    r = client.get(f"/v1/sessions/{sid}/files", params={"path": "/etc/shadow"})
    assert r.status_code == 404
    # timeout and truncation come back as fields, not errors
    r = client.post(f"/v1/sessions/{sid}/exec", json={"cmd": "yes", "timeout_s": 0.5}).json()
    assert r["timed_out"] and r["truncated"] and len(r["stdout"]) < 1200
    assert client.get(f"/v1/sessions/{sid}").json()["execs"] == 3
    assert len(sessions_on_disk(workroot)) >= 2  # the directory and its private twin
    assert client.delete(f"/v1/sessions/{sid}").status_code == 200
    assert sessions_on_disk(workroot) == []
    assert client.post(f"/v1/sessions/{sid}/exec", json={"cmd": "true"}).status_code == 404


def test_bad_requests(client: httpx.Client) -> None:
    assert client.post("/v1/sessions/nope/exec", json={"cmd": "true"}).status_code == 404
    sid = session(client)
    assert client.post(f"/v1/sessions/{sid}/exec", json={"cmd": ""}).status_code == 422
    assert client.post(f"/v1/sessions/{sid}/exec", json={"cmd": "true", "timeout_s": -1}).status_code == 422
    client.delete(f"/v1/sessions/{sid}")


def test_concurrent_exec_limit_429(client: httpx.Client, sb: Sandbox) -> None:
    sids = [session(client) for _ in range(6)]

    def run(sid: str) -> httpx.Response:
        with httpx.Client(base_url=sb.url, timeout=30, headers=auth_headers()) as c:
            return c.post(f"/v1/sessions/{sid}/exec", json={"cmd": "sleep 1.5; echo ok"})

    with ThreadPoolExecutor(6) as pool:
        rs = list(pool.map(run, sids))
    codes = sorted(r.status_code for r in rs)
    assert codes.count(200) >= 2 and 429 in codes, codes
    busy = next(r for r in rs if r.status_code == 429)
    assert busy.headers["Retry-After"] == "1" and "max_concurrent_execs" in busy.json()["detail"]
    assert all(r.json()["stdout"] == "ok\n" for r in rs if r.status_code == 200)
    for sid in sids:
        client.delete(f"/v1/sessions/{sid}")


def test_expiry_removes_directory(client: httpx.Client, workroot: Path) -> None:
    sid = session(client)
    client.post(f"/v1/sessions/{sid}/exec", json={"cmd": "echo x > f"})
    assert len(sessions_on_disk(workroot)) == 3  # the directory, its private twin and its quota image
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and sessions_on_disk(workroot):
        time.sleep(0.2)
    assert sessions_on_disk(workroot) == []
    r = client.post(f"/v1/sessions/{sid}/exec", json={"cmd": "true"})
    assert r.status_code == 404 and "expired" in r.json()["detail"]


def test_service_survives_abuse(client: httpx.Client) -> None:
    sid = session(client)
    r = client.post(f"/v1/sessions/{sid}/exec", json={"cmd": ":(){ :|:& };:", "timeout_s": 3})
    assert r.status_code == 200
    r = client.post(f"/v1/sessions/{sid}/exec", json={"cmd": "head -c 300000000 /dev/zero", "timeout_s": 30})
    assert r.status_code == 200 and r.json()["truncated"]
    assert client.get("/health").status_code == 200
    other = session(client)
    assert client.post(f"/v1/sessions/{other}/exec", json={"cmd": "echo fine"}).json()["stdout"] == "fine\n"
    m = client.get("/metrics").text
    assert "relay_sandbox_execs_total" in m and "relay_sandbox_exec_seconds_bucket" in m
    for s in (sid, other):
        client.delete(f"/v1/sessions/{s}")


# ------------------------------------------------------------------ load


@pytest.fixture(scope="module")
def loadsb(redis_server: str, tmp_path_factory: pytest.TempPathFactory, workroot: Path) -> Iterator[Sandbox]:
    # Its own uid range, so the leak check below cannot see other sandboxes' processes.
    base = random.randrange(1_000_000, 50_000_000, 1000)
    s = Sandbox(
        tmp_path_factory.mktemp("sbload"),
        redis_server,
        workdir_root=str(workroot / "load"),
        max_sessions=128,
        max_concurrent_execs=16,
        uid_base=base,
    ).wait_ready()
    s.uid_base = base  # type: ignore[attr-defined]
    yield s
    s.stop()


def test_64_concurrent_sessions_no_crosstalk_no_leaks(loadsb: Sandbox) -> None:
    with httpx.Client(base_url=loadsb.url, timeout=60, headers=auth_headers()) as c:
        sids = [c.post("/v1/sessions", json={"env": "echo"}).json()["session_id"] for _ in range(64)]

    def work(sid: str) -> list[str]:
        outs = []
        with httpx.Client(base_url=loadsb.url, timeout=120, headers=auth_headers()) as c:
            for i in range(3):
                cmd = f"echo {sid}-{i} >> log; sleep 0.1 & wc -l < log; tail -1 log; cat /proc/self/status | grep ^Uid"
                while (r := c.post(f"/v1/sessions/{sid}/exec", json={"cmd": cmd})).status_code == 429:
                    time.sleep(0.02)
                assert r.status_code == 200, r.text
                outs.append(r.json()["stdout"])
        return outs

    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(work, sids))
    uids = set()
    for sid, outs in zip(sids, results, strict=True):
        for i, out in enumerate(outs):
            lines = out.splitlines()
            assert lines[:2] == [str(i + 1), f"{sid}-{i}"], (sid, out)
            uids.add(int(lines[2].split()[1]))
    assert len(uids) == 64  # one uid per session
    with httpx.Client(base_url=loadsb.url, timeout=60, headers=auth_headers()) as c:
        for sid in sids:
            assert c.delete(f"/v1/sessions/{sid}").status_code == 200
        assert c.get("/health").json()["sessions_open"] == 0
    lo = loadsb.uid_base  # type: ignore[attr-defined]
    assert uids <= set(range(lo, lo + 128))

    def leaked() -> list[str]:
        out = []
        for d in Path("/proc").iterdir():
            try:
                uid = int((d / "status").read_text().split("\nUid:")[1].split()[0])
            except (OSError, IndexError, ValueError):
                continue
            if lo <= uid < lo + 128:
                out.append(d.name)
        return out

    deadline = time.monotonic() + 10
    while leaked() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leaked() == []
