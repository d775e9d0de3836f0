"""The per-session disk quota (sandbox.disk_quota_mb / disk_quota_inodes; services/sandbox/mounts.py)
over the sandbox's real HTTP API: each session directory is its own filesystem of the quota's size,
an ext4 image on the disk (loop-mounted; its bytes are on disk, not in memory), so a `dd` or a
Python write loop past the quota fails inside the command with ENOSPC and a note saying why, the
host and the other sessions are unaffected, deleting files makes the session usable again, and the
file-write endpoint refuses what does not fit with a 413 naming the field, leaving old files intact."""

from __future__ import annotations

import os
import random
import stat
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.sandbox import root_session_root, session
from test_sandbox_service import Sandbox

from services.common.auth import auth_headers
from services.sandbox.isolation import Limits, WorkspaceManager
from services.sandbox.mounts import mounts_under, mounts_with_types

QUOTA_MB = 8
INODES = 200


@pytest.fixture(scope="module")
def workroot(bwrap: str) -> Iterator[Path]:
    with root_session_root("relay-quota-test-", "the disk quota mounts a filesystem per session") as root:
        yield root


@pytest.fixture(scope="module")
def sb(redis_server: str, tmp_path_factory: pytest.TempPathFactory, workroot: Path) -> Iterator[Sandbox]:
    s = Sandbox(
        tmp_path_factory.mktemp("sbquota"),
        redis_server,
        workdir_root=str(workroot),
        disk_quota_mb=QUOTA_MB,
        disk_quota_inodes=INODES,
        exec_max_file_mb=64,  # above the quota: the quota, not RLIMIT_FSIZE, must stop the writes
        file_max_bytes=4 << 20,
        uid_base=random.randrange(1_000_000, 50_000_000, 1000),
    ).wait_ready()
    yield s
    s.stop()


@pytest.fixture
def client(sb: Sandbox) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sb.url, timeout=60, headers=auth_headers()) as c:
        yield c


def run(c: httpx.Client, sid: str, cmd: str) -> dict[str, object]:
    r = c.post(f"/v1/sessions/{sid}/exec", json={"cmd": cmd, "timeout_s": 30})
    assert r.status_code == 200, r.text
    return r.json()


def disk(c: httpx.Client, sid: str) -> dict[str, int]:
    d = c.get(f"/v1/sessions/{sid}").json()["disk"]
    assert d is not None
    return d


def session_dir(workroot: Path, c: httpx.Client, sid: str) -> Path:
    run(c, sid, "true")  # the directory exists from the first command on
    (d,) = [p for p in (workroot / "replica-0").iterdir() if p.is_dir() and not p.name.endswith(".private")]
    return d


def test_dd_past_quota_fails_clearly_and_session_recovers(
    client: httpx.Client, sb: Sandbox, workroot: Path
) -> None:
    assert client.get("/health").json()["disk_quota_mb"] == QUOTA_MB
    sid = session(client)
    host_dir = session_dir(workroot, client, sid)
    # The data lands in the session's own ext4 image of the quota's size, on the disk.
    st = os.statvfs(host_dir)
    assert QUOTA_MB << 20 <= st.f_bavail * st.f_frsize <= (QUOTA_MB << 20) * 1.1
    assert os.stat(host_dir).st_dev != os.stat(workroot).st_dev
    assert (host_dir, "ext4") in mounts_with_types(workroot)
    image = host_dir.with_name(f"{host_dir.name}.img")
    assert stat.S_IMODE(image.stat().st_mode) == 0o600 and image.stat().st_uid == 0
    before = image.stat().st_blocks
    run(client, sid, "head -c 3000000 /dev/urandom > on-disk && sync")
    assert (image.stat().st_blocks - before) * 512 >= 3_000_000  # the image's blocks hold them
    run(client, sid, "rm on-disk")

    r = run(client, sid, "dd if=/dev/zero of=big bs=1M count=20; echo rc=$?")
    assert "rc=0" not in r["stdout"]
    assert "No space left on device" in r["stderr"]
    assert "[sandbox: /work is full" in r["stderr"] and "disk_quota_mb" in r["stderr"]
    d = disk(client, sid)
    assert QUOTA_MB << 20 <= d["quota_bytes"] <= (QUOTA_MB << 20) * 1.1
    assert d["used_bytes"] > (QUOTA_MB - 1) << 20
    size = int(run(client, sid, "stat -c %s big")["stdout"])
    assert QUOTA_MB << 20 <= size <= d["quota_bytes"]

    # Other sessions are unaffected.
    other = session(client)
    r = run(client, other, "head -c 1000000 /dev/zero > f && stat -c %s f")
    assert r["exit_code"] == 0 and r["stdout"].strip() == "1000000" and "sandbox:" not in r["stderr"]

    # Deleting files makes the session usable again, at once.
    r = run(client, sid, "rm big && echo hello > small && cat small")
    assert r["exit_code"] == 0 and r["stdout"] == "hello\n" and "sandbox:" not in r["stderr"]
    assert disk(client, sid)["used_bytes"] < 1 << 20

    # A Python write loop hits the same wall and sees an ordinary OSError.
    loop = "python3 -c \"f = open('x', 'wb')\nwhile True: f.write(b'0' * 65536)\""
    r = run(client, sid, loop)
    assert r["exit_code"] != 0 and "No space left on device" in r["stderr"]
    assert "[sandbox: /work is full" in r["stderr"]
    assert run(client, sid, "rm x && echo ok")["stdout"] == "ok\n"

    # dd and the Python loop (the stat after dd found the quota nearly, not entirely, full: ext4
    # refuses a write before its last block is used, so no note for a command that saw no ENOSPC)
    metrics = client.get("/metrics").text
    assert 'relay_sandbox_disk_quota_full_total{via="exec"} 2.0' in metrics
    for s in (sid, other):
        assert client.delete(f"/v1/sessions/{s}").status_code == 200
    assert host_dir not in mounts_under(workroot) and not host_dir.exists()  # unmounted
    assert not image.exists()  # the image (and its disk space) is gone


def test_file_count_quota(client: httpx.Client) -> None:
    sid = session(client)
    r = run(client, sid, f"for i in $(seq {INODES + 50}); do touch f$i || break; done; ls | wc -l")
    assert "No space left on device" in r["stderr"] and "files used" in r["stderr"]
    assert int(r["stdout"]) < INODES
    assert run(client, sid, "rm f* && touch one && ls")["stdout"] == "one\n"
    client.delete(f"/v1/sessions/{sid}")


def test_write_file_respects_quota(client: httpx.Client) -> None:
    sid = session(client)
    r = client.put(f"/v1/sessions/{sid}/files", json={"path": "keep.txt", "content": "original\n"})
    assert r.status_code == 200, r.text
    run(client, sid, f"head -c {(QUOTA_MB - 2) << 20} /dev/zero > filler")
    big = "z" * (3 << 20)  # under file_max_bytes, over what is left

    r = client.put(f"/v1/sessions/{sid}/files", json={"path": "keep.txt", "content": big})
    assert r.status_code == 413, r.text
    body = r.json()
    assert body["detail"].startswith("content: ") and "disk quota" in body["detail"]
    assert body["errors"][0]["loc"] == ["body", "content"]
    # The failed write left the old file as it was, and no temporary file behind.
    assert (
        client.get(f"/v1/sessions/{sid}/files", params={"path": "keep.txt"}).json()["content"] == "original\n"
    )
    assert run(client, sid, "ls -A")["stdout"].split() == ["filler", "keep.txt"]
    assert 'relay_sandbox_disk_quota_full_total{via="write_file"} 1.0' in client.get("/metrics").text
    r = client.put(f"/v1/sessions/{sid}/files", json={"path": "new/dir/f.txt", "content": big})
    assert r.status_code == 413 and run(client, sid, "ls -A")["stdout"].split() == ["filler", "keep.txt"]

    # After deleting the filler the same write fits; existing files keep their mode.
    run(client, sid, "rm filler && chmod 755 keep.txt")
    r = client.put(f"/v1/sessions/{sid}/files", json={"path": "keep.txt", "content": big})
    assert r.status_code == 200 and r.json()["bytes"] == len(big)
    assert run(client, sid, "stat -c '%a %s' keep.txt")["stdout"].split() == ["755", str(len(big))]
    client.delete(f"/v1/sessions/{sid}")


def test_stale_mounts_of_a_dead_process_are_detached(bwrap: str, workroot: Path) -> None:
    root = workroot / "stale"
    kw = {"disk_quota_mb": 1, "uid_base": random.randrange(1_000_000, 50_000_000, 1000)}
    crashed = WorkspaceManager(root=root, limits=Limits(timeout_s=10), **kw)  # type: ignore[arg-type]
    ws = crashed.create()
    assert ws.run("head -c 100000 /dev/zero > f && echo ok").stdout == "ok\n"
    assert ws.path in mounts_under(root)
    # A new process on the same root (a restarted sandbox) detaches what the old one left.
    fresh = WorkspaceManager(root=root, **kw)  # type: ignore[arg-type]
    ws2 = fresh.create()
    assert mounts_under(root) == [ws2.path]
    fresh.release(ws2)
    assert mounts_under(root) == []


def test_tmpfs_backend(bwrap: str, workroot: Path) -> None:
    """disk_quota_backend = "tmpfs": the same quota in memory (for hosts without loop devices)."""
    kw = {"disk_quota_mb": 2, "disk_quota_backend": "tmpfs"}
    m = WorkspaceManager(
        root=workroot / "tmpfs", uid_base=random.randrange(1_000_000, 50_000_000, 1000), **kw
    )  # type: ignore[arg-type]
    ws = m.create()
    try:
        assert (ws.path, "tmpfs") in mounts_with_types(workroot)
        r = ws.run("dd if=/dev/zero of=big bs=1M count=5; echo rc=$?")
        assert "No space left on device" in r.stderr and "rc=0" not in r.stdout
        assert not ws.image.exists()
    finally:
        m.release(ws)
        m.shutdown()
