"""Escape attempts against the isolation layer (services/sandbox/isolation.py), each one contained.

Every test runs real commands under bubblewrap as the session's own uid, exactly as the sandbox
service does, and checks both what the command saw and that the host is unaffected (no leftover
processes, no files written outside, canaries intact). The HTTP-level checks (service stays up,
429) are in test_sandbox_exec.py.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.sandbox.cgroups import SessionLimits
from services.sandbox.isolation import Limits, Workspace, WorkspaceManager

FAST = Limits(timeout_s=10, cpu_s=5, memory_mb=512, max_procs=32, max_file_mb=4, output_bytes=4096)


@pytest.fixture(scope="module")
def manager(bwrap: str) -> Iterator[WorkspaceManager]:
    # A uid range of its own: other sandboxes on this host (other test runs) use the default one.
    # Session limits on, as the service's defaults have them: where cgroups are usable every
    # command here joins its session's cgroup as root and drops to the session's uid itself.
    m = WorkspaceManager.temporary(
        limits=FAST,
        max_concurrent=8,
        uid_base=random.randrange(1_000_000, 50_000_000, 1000),
        session_limits=SessionLimits(1 << 30, 128, 1.0),
    )
    yield m
    m.shutdown()


@pytest.fixture
def ws(manager: WorkspaceManager) -> Iterator[Workspace]:
    w = manager.create()
    yield w
    manager.release(w)
    assert not w.path.exists()
    if w.uid is not None:
        assert wait_gone(lambda: procs_of(w.uid)), "processes left behind after close"


def procs_of(uid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            status = (d / "status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("Uid:") and int(line.split()[1]) == uid:
                out.append(int(d.name))
    return out


def procs_with(marker: str) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker.encode() in (d / "cmdline").read_bytes():
                    found.append(int(d.name))
            except OSError:
                pass
    return found


def wait_gone(check, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not check():
            return True
        time.sleep(0.05)
    return not check()


# ------------------------------------------------------------------ basics


def test_runs_in_session_dir_as_session_uid(ws: Workspace) -> None:
    r = ws.run("pwd; id -u; echo hi > f; cat f; python3 -c 'print(6*7)'")
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.split()
    assert lines[0] == "/work" and lines[2:] == ["hi", "42"]
    if ws.uid is not None:
        assert int(lines[1]) == ws.uid != 0
    assert (ws.path / "f").read_text() == "hi\n"


def test_commands_run_in_the_session_cgroup_as_the_session_uid(manager: WorkspaceManager) -> None:
    """Every process of a command is in its session's cgroup, none of them root; the cgroup goes
    with the session."""
    if manager.setup_cgroups() and manager.cgroups is None:
        pytest.skip(f"no cgroups here: {manager.cgroups_note}")
    ws = manager.create()
    assert ws.cgroup is not None and ws.uid is not None
    t = threading.Thread(target=lambda: ws.run("sleep 2 & sleep 2; wait"))
    t.start()
    assert wait_gone(lambda: len(ws.cgroup.pids()) < 3), ws.cgroup.pids()  # type: ignore[union-attr]
    pids = ws.cgroup.pids()
    uids = {int((Path("/proc") / str(p) / "status").read_text().split("Uid:")[1].split()[0]) for p in pids}
    assert uids == {ws.uid}, (pids, uids)
    t.join(10)
    dirs = ws.cgroup.dirs
    manager.release(ws)
    assert not any(d.exists() for d in dirs)


# ------------------------------------------------------------------ network


def test_no_network_loopback_or_outside(ws: Workspace) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    accepted: list[object] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(srv.accept())
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        probe = (
            "import socket,sys\n"
            "for host, port in [('127.0.0.1', int(sys.argv[1])), ('1.1.1.1', 53), ('8.8.8.8', 443)]:\n"
            "    s = socket.socket(); s.settimeout(2)\n"
            "    try:\n"
            "        s.connect((host, port)); print('CONNECTED', host)\n"
            "    except OSError as e:\n"
            "        print('refused', host, type(e).__name__)\n"
            "try:\n"
            "    socket.getaddrinfo('example.com', 80); print('RESOLVED')\n"
            "except OSError as e:\n"
            "    print('noresolve', type(e).__name__)\n"
        )
        r = ws.run(["python3", "-c", probe, str(port)])
        assert r.exit_code == 0, r.stderr
        assert "CONNECTED" not in r.stdout and "RESOLVED" not in r.stdout, r.stdout
        assert r.stdout.count("refused") == 3 and "noresolve" in r.stdout
        # Only a loopback interface of its own.
        r = ws.run("cat /proc/net/dev")
        ifaces = {ln.split(":")[0].strip() for ln in r.stdout.splitlines()[2:]}
        assert ifaces == {"lo"}
    finally:
        stop.set()
        t.join()
        srv.close()
    assert accepted == []


# ------------------------------------------------------------------ reading / writing outside


def test_cannot_read_outside(manager: WorkspaceManager, ws: Workspace, tmp_path: Path) -> None:
    other = manager.create()
    try:
        (other.path / "secret.txt").write_text("OTHER-SESSION-SECRET")
        host_secret = tmp_path / "host-secret.txt"
        host_secret.write_text("HOST-SECRET")
        targets = [
            "/etc/shadow",
            "/etc/passwd",
            "/root/.bashrc",
            str(host_secret),
            str(other.path / "secret.txt"),
            f"/work/../{other.name}/secret.txt",
            str(Path.home()),
        ]
        for t in targets:
            r = ws.run(["/bin/sh", "-c", 'cat -- "$1" 2>&1; ls -- "$1" 2>&1', "sh", t])
            assert "SECRET" not in r.stdout and "root:x:" not in r.stdout, (t, r.stdout)
            assert "No such file" in r.stdout, (t, r.stdout)
        visible = set(ws.run("ls / /work/..").stdout.split())
        assert visible <= {
            "/:",
            "/work/..:",
            "bin",
            "dev",
            "lib",
            "lib64",
            "proc",
            "sbin",
            "tmp",
            "usr",
            "work",
        }
        # Host side: sessions are 0700 and owned by different uids.
        if ws.uid is not None:
            assert ws.uid != other.uid
            st = os.stat(other.path)
            assert st.st_uid == other.uid and st.st_mode & 0o777 == 0o700
    finally:
        manager.release(other)


def test_cannot_write_outside(ws: Workspace) -> None:
    marker = f"relay-escape-{uuid.uuid4().hex}"
    r = ws.run(
        f"for p in /usr/{marker} /{marker} /proc/{marker} /dev/{marker} /work/../{marker}; do "
        f"echo x > $p 2>/dev/null && echo WROTE $p; done; echo x > /tmp/{marker} && echo tmp-ok"
    )
    assert "WROTE" not in r.stdout, r.stdout
    assert "tmp-ok" in r.stdout  # /tmp is a private tmpfs ...
    assert not Path(f"/tmp/{marker}").exists()  # ... not the host's /tmp
    assert not Path(f"/usr/{marker}").exists() and not Path(f"/{marker}").exists()
    assert not (ws.path.parent / marker).exists()


def test_symlink_tricks(manager: WorkspaceManager, tmp_path: Path) -> None:
    w = manager.create()
    canary_dir = tmp_path / "canary"
    canary_dir.mkdir()
    (canary_dir / "keep.txt").write_text("still here")
    r = w.run(
        f"ln -s /etc/passwd passwd; ln -s / root; ln -s {canary_dir} canary; ln -s {canary_dir}/keep.txt keep"
    )
    assert r.exit_code == 0, r.stderr
    # The file API resolves inside the sandbox: host paths do not exist there.
    text, _, exists = w.read_file("passwd", 1000)
    assert not exists and text == ""
    _, _, exists = w.read_file("keep", 1000)
    assert not exists
    text, _, exists = w.read_file("root/etc/shadow", 10000)
    assert not exists and text == ""
    # Writing through a dangling symlink to a host path writes nowhere on the host.
    try:
        w.write_file("keep", "overwritten")
    except OSError:
        pass
    assert (canary_dir / "keep.txt").read_text() == "still here"
    # Closing the session removes the links, not what they point to.
    manager.release(w)
    assert not w.path.exists()
    assert (canary_dir / "keep.txt").read_text() == "still here"
    assert Path("/etc/passwd").exists()


# ------------------------------------------------------------------ resource limits


def test_fork_bomb_contained(ws: Workspace) -> None:
    t0 = time.monotonic()
    r = ws.run(":(){ :|:& };:", timeout_s=5)
    assert time.monotonic() - t0 < 15
    assert r.timed_out or r.exit_code != 0
    if ws.uid is not None:
        assert wait_gone(lambda: procs_of(ws.uid)), "fork bomb processes survived"
    # The host can still start processes, and the session can run the next command.
    assert subprocess.run(["true"]).returncode == 0
    assert ws.run("echo alive").stdout == "alive\n"


def test_process_limit(ws: Workspace) -> None:
    if ws.uid is None:
        pytest.skip("process limits need a per-session uid (sandbox running as root)")
    r = ws.run("for i in $(seq 100); do sleep 5 & done; wait", timeout_s=10)
    assert "fork" in r.stderr.lower() or "resource" in r.stderr.lower(), r.stderr


def test_memory_hog(ws: Workspace) -> None:
    r = ws.run(["python3", "-c", "x = bytearray(2 << 30); print('ALLOCATED')"])
    assert r.exit_code != 0 and "ALLOCATED" not in r.stdout
    assert "MemoryError" in r.stderr


def test_cpu_spin_killed_by_cpu_limit(manager: WorkspaceManager, ws: Workspace) -> None:
    lim = Limits(**{**FAST.__dict__, "cpu_s": 1, "timeout_s": 30})
    t0 = time.monotonic()
    r = ws.run(["python3", "-c", "while True: pass"], limits=lim)
    took = time.monotonic() - t0
    assert not r.timed_out and r.exit_code in (128 + 9, 128 + 24), r  # SIGKILL / SIGXCPU
    assert took < 20


def test_infinite_loop_wall_clock(ws: Workspace) -> None:
    r = ws.run("while :; do :; done", timeout_s=1)
    assert r.timed_out and r.exit_code == 128 + 9
    assert 0.9 < r.duration_s < 5


def test_file_size_limit(ws: Workspace) -> None:
    r = ws.run("head -c 20000000 /dev/zero > big; echo rc=$?")
    assert "rc=0" not in r.stdout
    assert (ws.path / "big").stat().st_size <= FAST.max_file_mb << 20


def test_infinite_output_truncated(ws: Workspace) -> None:
    r = ws.run("yes relay", timeout_s=1)
    assert r.timed_out and r.truncated
    assert len(r.stdout.encode()) < FAST.output_bytes + 200
    assert r.stdout.startswith("relay\nrelay\n") and "truncated" in r.stdout[-100:]


def test_one_gigabyte_of_output(ws: Workspace) -> None:
    r = ws.run("head -c 1000000000 /dev/zero; echo done >&2", timeout_s=60)
    assert r.exit_code == 0 and not r.timed_out and r.truncated
    assert len(r.stdout) < FAST.output_bytes + 200
    assert "999995904 more bytes" in r.stdout and r.stderr == "done\n"


def test_timeout_kills_whole_tree(ws: Workspace) -> None:
    marker = f"{time.time_ns() % 10**6}.{os.getpid()}"  # unique sleep argument
    r = ws.run(f"sleep {marker} & (sleep {marker} &); sleep 1000", timeout_s=1)
    assert r.timed_out
    assert wait_gone(lambda: procs_with(marker)), "a background grandchild survived the timeout"


def test_no_process_left_after_command(ws: Workspace) -> None:
    marker = f"{time.time_ns() % 10**6}.{os.getpid() + 1}"
    t0 = time.monotonic()
    r = ws.run(f"nohup sleep {marker} >/dev/null 2>&1 & setsid sleep {marker} & echo started")
    assert r.stdout == "started\n" and time.monotonic() - t0 < 5
    assert wait_gone(lambda: procs_with(marker)), "a daemonised process outlived its command"


def test_close_kills_running_command(manager: WorkspaceManager) -> None:
    w = manager.create()
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(w.run("sleep 100", timeout_s=60)))
    t.start()
    time.sleep(0.5)
    manager.release(w)
    t.join(10)
    assert not t.is_alive() and out and out[0].exit_code == 128 + 9  # type: ignore[attr-defined]
    assert not w.path.exists()
