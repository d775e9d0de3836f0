"""Isolated command execution for sandbox sessions: bubblewrap + rlimits + a per-session uid.

Every command a session runs (`exec`, file read/write, an environment's tools and hidden tests)
goes through `Workspace.run`, which starts

    prlimit --cpu --as --nproc --fsize --nofile --core -- bwrap --unshare-all --die-with-parent ...

as the session's own host uid (when the sandbox runs as root), with:

- **namespaces:** all of them unshared (net: only a loopback interface of its own, so nothing on
  the host or outside is reachable; pid: the command is pid 1's child, so when it exits or is
  killed the kernel kills everything it left behind), `--disable-userns`, `--new-session`.
- **filesystem:** /usr read-only (plus the /bin /lib /lib64 /sbin links), a fresh /proc, a
  minimal /dev, a size-capped tmpfs at /tmp, and the session's directory read-write at /work.
  Nothing else of the host exists inside: no /etc, /home, /root, other sessions.
  The sandbox root is mode 0711 (so each uid reaches only its own 0700 directory by name).
- **a distinct host uid per session** (`sandbox.uid_base` + a slot): RLIMIT_NPROC is counted per
  uid, so a fork bomb hits its own session's limit (root is exempt from it, hence never root),
  and a session's directory is mode 0700 owned by its uid, so sessions cannot read each other.
- **rlimits:** CPU seconds, address space, processes, file size, open files, no core dumps.
- **wall clock:** past the timeout the process group is SIGKILLed; bwrap's pid namespace takes
  every descendant down with it (a background grandchild included).
- **output:** stdout and stderr are each kept up to a byte budget and drained (discarded) past
  it, with a marker saying how much was dropped, so 1 GB of output costs time, not memory.
- **per-session limits:** with cgroups (services/sandbox/cgroups.py, v2 or v1) every command of
  a session runs in that session's cgroup: memory (`session_memory_mb`), processes and threads
  (`session_max_pids`) and CPU time per second (`session_cpus`) for the whole session, whatever
  it forks; the rlimits above still bound each process. Without cgroups (not root, none
  writable) only the rlimits and the per-uid process count hold; the service says so at start.
- **concurrency:** at most `max_concurrent_execs` commands at once in the sandbox and
  `max_execs_per_session` in one session (past either, an HTTP exec is a 429), so one session's
  sleeping commands cannot take every slot.
- **disk quota:** with `disk_quota_mb` the session directory is a filesystem of its own of that
  size (and `disk_quota_inodes` files), mounted by the host (root) before any command runs: by
  default an ext4 image on the disk under the sandbox root, loop-mounted, or a tmpfs
  (`disk_quota_backend`; services/sandbox/mounts.py). The kernel enforces it at write time: a
  write past it fails with ENOSPC inside the command (which keeps running and sees an ordinary
  "No space left on device"), nothing else on the host fills, and deleting files frees the space
  at once. A command that leaves /work full gets a note on its stderr saying so; `write_file`
  checks the free space first and writes through a temporary file, so a write that does not fit
  fails with `QuotaExceeded` and leaves the old file intact. RLIMIT_FSIZE plus a `du` after each
  command would bound single files, not the total, and could not stop a command mid-way. Without
  root nothing can be mounted: the quota is then not enforced (`WorkspaceManager.quota_enforced`
  is false and the service says so at start).

Host-side code never follows paths inside a session directory after untrusted code has run
there (symlinks could point anywhere on the host): file reads and writes run inside the sandbox
too (`read_file` / `write_file`), and the directory is removed with `shutil.rmtree`, which does
not follow symlinks.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.sandbox.cgroups import CgroupTree, SessionCgroup, SessionLimits, detect, join_argv
from services.sandbox.mounts import (
    MS_NODEV,
    MS_NOSUID,
    MountError,
    QuotaBackend,
    mount_call,
    mount_quota,
    mounts_under,
    unmount,
)

WORKDIR = "/work"  # the session directory's path inside the sandbox
HIDDEN = "/hidden"  # a workspace's private directory, mounted read-only only when asked for
INSTALL_SCRIPT = Path(__file__).resolve().parent / "install_bwrap.sh"
PATH_IN_SANDBOX = "/usr/local/bin:/usr/bin:/bin"


class IsolationError(RuntimeError):
    """The isolation layer itself cannot work here (no bwrap, no user namespaces)."""


class ExecBusy(IsolationError):
    """All `max_concurrent_execs` slots are taken (the HTTP layer answers 429)."""


class QuotaExceeded(OSError):
    """A file write does not fit in what is left of the session's disk quota."""


@dataclass(frozen=True)
class DiskUsage:
    used_bytes: int
    quota_bytes: int
    used_inodes: int
    quota_inodes: int

    @property
    def free_bytes(self) -> int:
        return self.quota_bytes - self.used_bytes

    @property
    def full(self) -> bool:
        # Less than one page left, or no inode: the next write of anything fails.
        return self.free_bytes < 4096 or self.used_inodes >= self.quota_inodes

    @property
    def nearly_full(self) -> bool:
        """Within 1/16 of the quota: a filesystem may refuse a write before its last block is
        used (ext4 holds blocks back for writes in flight), so a command that saw ENOSPC there
        did hit the quota."""
        return self.full or self.free_bytes < self.quota_bytes // 16 + 4096

    def describe(self) -> str:
        return (
            f"{self.used_bytes / 2**20:.1f} of {self.quota_bytes / 2**20:.0f} MiB and "
            f"{self.used_inodes} of {self.quota_inodes} files used"
        )


@dataclass(frozen=True)
class Limits:
    """Per-command limits (SandboxSection's exec_* knobs)."""

    timeout_s: float = 30.0
    cpu_s: int = 60
    memory_mb: int = 1024  # address space (RLIMIT_AS)
    max_procs: int = 64  # RLIMIT_NPROC for the session's uid
    max_file_mb: int = 64  # RLIMIT_FSIZE
    max_open_files: int = 256
    output_bytes: int = 65536  # per stream
    tmp_mb: int = 64  # size of the /tmp tmpfs


@dataclass
class ExecResult:
    exit_code: int  # the command's status; 128+N when killed by signal N (shell convention)
    stdout: str
    stderr: str
    truncated: bool = False
    timed_out: bool = False
    duration_s: float = 0.0
    disk_full: bool = False  # /work was at its disk quota when the command ended (not on the wire)

    def as_dict(self) -> dict[str, Any]:
        return {
            "exit_code": self.exit_code,
            "stdout": self.stdout,
            "stderr": self.stderr,
            "truncated": self.truncated,
            "timed_out": self.timed_out,
            "duration_s": round(self.duration_s, 4),
        }


def find_bwrap() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise IsolationError(
            f"bubblewrap (bwrap) is not installed; run `bash {INSTALL_SCRIPT}` (apt-get install bubblewrap)"
        )
    return path


def _truncate_marker(dropped: int) -> bytes:
    return f"\n[... truncated: {dropped} more bytes not shown ...]\n".encode()


class _Capture:
    def __init__(self, budget: int):
        self.budget = budget
        self.buf = bytearray()
        self.dropped = 0

    def add(self, data: bytes) -> None:
        room = self.budget - len(self.buf)
        if room > 0:
            self.buf += data[:room]
        self.dropped += max(0, len(data) - max(room, 0))

    def text(self) -> str:
        out = bytes(self.buf) + (_truncate_marker(self.dropped) if self.dropped else b"")
        return out.decode("utf-8", errors="replace")


_SUBREAPER = False  # set by enable_subreaper()


def enable_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (PR_SET_CHILD_SUBREAPER).

    bwrap's outer process exits as soon as the command does, a moment before the sandbox's own
    pid 1, which is then orphaned; without this it becomes a zombie of the host's init until that
    reaps it (lazily in some containers), and zombies count against the session uid's process
    limit. The sandbox service calls this at start; `Workspace.run` then reaps those orphans."""
    global _SUBREAPER
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        _SUBREAPER = libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        _SUBREAPER = False
    return _SUBREAPER


_ACTIVE: set[int] = set()  # pids of our own Popen children (never reaped behind subprocess's back)
_ACTIVE_LOCK = threading.Lock()


def reap_orphans() -> None:
    """waitpid() the zombie bwrap orphans reparented to us; leave our Popen children alone."""
    if not _SUBREAPER:
        return
    me = os.getpid()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm_end = stat.rfind(")")
        fields = stat[comm_end + 2 :].split()
        if fields[0] != "Z" or int(fields[1]) != me or stat[stat.find("(") + 1 : comm_end] != "bwrap":
            continue
        pid = int(d)
        with _ACTIVE_LOCK:
            if pid in _ACTIVE:
                continue
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


# Atomic write inside the sandbox: the content goes to a temporary file next to the target (the
# target resolved first, so writing through a symlink still writes where it points), which is
# renamed over it only once complete; on failure (e.g. ENOSPC) the temporary file is removed and
# the old file is untouched. A new file gets mode 0644; an existing one keeps its mode.
_WRITE_SCRIPT = """
p=$(readlink -m -- "$1") && d=$(dirname -- "$p") && mkdir -p -- "$d" || exit 1
[ -d "$p" ] && { echo "$1 is a directory" >&2; exit 1; }
t=$(mktemp -p "$d" .relay-write.XXXXXX) || exit 1
if [ -e "$p" ]; then chmod --reference="$p" -- "$t"; else chmod 0644 -- "$t"; fi
if cat > "$t" && mv -f -T -- "$t" "$p"; then exit 0; fi
rm -f -- "$t"
exit 1
"""


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()


class Workspace:
    """One session's directory and uid. Create through `WorkspaceManager.create`.

    `base`: a directory the session starts from (a project's source tree). As root it is the
    lower layer of an overlayfs mounted at the session directory, whose upper layer (every file
    the session writes) lives in the session's own quota tmpfs: 64 sessions on one project share
    one copy of it, and starting a session copies nothing. Without root it is copied.
    `binds`: host directories mounted read-only inside the sandbox ({host: path inside})."""

    def __init__(
        self,
        manager: WorkspaceManager,
        name: str,
        uid: int | None,
        base: Path | None = None,
        binds: dict[Path, str] | None = None,
    ):
        self.manager = manager
        self.name = name
        self.uid = uid
        self.base = base
        self.binds = dict(binds or {})
        self.path = manager.root / name
        self.upper = manager.root / f"{name}.upper"  # the overlay's upper layer (base, as root)
        self.overlay = False
        # Host-only directory for an environment's private files (hidden tests); never writable
        # from the sandbox, visible read-only at /hidden only to runs that ask for it.
        self.private = manager.root / f"{name}.private"
        self.image = manager.root / f"{name}.img"  # the quota's disk image (backend "disk")
        self.closed = False
        self.quota = False  # the directory is a size-capped filesystem of its own
        self.cgroup: SessionCgroup | None = None
        self.slots = threading.BoundedSemaphore(manager.max_session_execs)
        self._procs: set[subprocess.Popen[bytes]] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ setup (host side)

    def _setup(self) -> None:
        self.path.mkdir(mode=0o700)
        self.private.mkdir(mode=0o700)
        try:
            if self.uid is not None and self.manager.cgroups is not None:
                self.cgroup = self.manager.cgroups.create(self.name, self.manager.session_limits)
            if self.base is not None and self.uid is not None:
                self._setup_overlay()
                return
            if self.base is not None:  # no root: nothing can be mounted, so a private copy
                shutil.copytree(self.base, self.path, symlinks=True, dirs_exist_ok=True)
            if self.uid is not None and self.manager.disk_quota_mb:
                self._mount_quota(self.path)
            if self.uid is not None:
                os.chown(self.path, self.uid, self.uid)
        except BaseException as e:
            self._teardown()
            if isinstance(e, OSError | MountError):
                raise IsolationError(str(e)) from e
            raise

    def _mount_quota(self, path: Path) -> None:
        assert self.uid is not None
        m = self.manager
        mount_quota(
            m.disk_quota_backend, path, self.image, m.disk_quota_mb << 20, m.disk_quota_inodes, self.uid
        )
        self.quota = True

    def _setup_overlay(self) -> None:
        """Session directory = overlayfs(lower: base, upper: <name>.upper/u in the quota mount)."""
        assert self.base is not None and self.uid is not None
        self.upper.mkdir(mode=0o700)
        if self.manager.disk_quota_mb:
            self._mount_quota(self.upper)
        os.chmod(self.upper, 0o700)
        (self.upper / "u").mkdir()
        (self.upper / "w").mkdir()
        os.chown(self.upper / "u", self.uid, self.uid)
        os.chmod(self.upper / "u", 0o700)
        opts = f"lowerdir={self.base},upperdir={self.upper / 'u'},workdir={self.upper / 'w'}"
        try:
            mount_call("overlay", self.path, "overlay", MS_NOSUID | MS_NODEV, opts)
        except OSError as e:
            raise IsolationError(f"cannot mount the session's overlay over {self.base}: {e.strerror}") from e
        self.overlay = True

    def _teardown(self) -> None:
        """Undo what _setup did: the session's processes and cgroup, its mounts (a disk image is
        deleted), its directories (symlink-safe)."""
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None
        for mounted, path in (
            (self.overlay, self.path),
            (self.quota, self.upper if self.base else self.path),
        ):
            if mounted:
                with contextlib.suppress(OSError):
                    unmount(path)
        self.overlay = self.quota = False
        self.image.unlink(missing_ok=True)  # the loop device lets go of it with the unmount
        for d in (self.path, self.private, self.upper):
            shutil.rmtree(d, ignore_errors=True)

    def disk_usage(self) -> DiskUsage | None:
        """What the session has written into /work, against its quota (None: no quota).
        statvfs of the mount root: safe whatever the sandboxed code did inside it."""
        if not self.quota or self.closed:
            return None
        try:
            st = os.statvfs(self.path)
        except OSError:
            return None
        # f_bavail: ext4 keeps a few blocks back even without reserved blocks (delayed allocation)
        return DiskUsage(
            used_bytes=(st.f_blocks - st.f_bavail) * st.f_frsize,
            quota_bytes=st.f_blocks * st.f_frsize,
            used_inodes=st.f_files - st.f_ffree,
            quota_inodes=st.f_files,
        )

    def _quota_note(self, output: str = "") -> str:
        u = self.disk_usage()
        if u is None or not (u.full or (u.nearly_full and "No space left on device" in output)):
            return ""
        return (
            f"\n[sandbox: /work is full: {u.describe()} (the session's disk quota, "
            "sandbox.disk_quota_mb / disk_quota_inodes); writes fail with 'No space left on device' "
            "until files are deleted]\n"
        )

    def seed_files(self, files: dict[str, str]) -> None:
        """Write the task's initial files. Host side, so only before any command has run."""
        root = self.path.resolve()
        for rel, text in files.items():
            p = (self.path / rel).resolve()
            if not p.is_relative_to(root):
                raise ValueError(f"seed file {rel!r} is outside the workspace")
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
            if self.uid is not None:
                # Only what was written (and its directories): touching the rest of an overlay
                # base would copy every file of it up into the session.
                for q in [p, *p.parents]:
                    if q == root or not q.is_relative_to(root):
                        break
                    os.lchown(q, self.uid, self.uid)

    def seed_private(self, files: dict[str, str]) -> None:
        for rel, text in files.items():
            p = self.private / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
            p.chmod(0o644)
        for dirpath, _dirs, _files in os.walk(self.private):
            os.chmod(dirpath, 0o755)
        if self.uid is not None:  # bwrap (as the session uid) must reach it to mount it read-only
            os.chown(self.private, self.uid, self.uid)
        self.private.chmod(0o500)

    # ------------------------------------------------------------------ running

    def _argv(self, bwrap: str, limits: Limits, cmd: list[str], hidden: bool) -> list[str]:
        argv = [
            "prlimit",
            f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",
            f"--as={limits.memory_mb << 20}",
            f"--fsize={limits.max_file_mb << 20}",
            f"--nofile={limits.max_open_files}",
            "--core=0",
        ]
        if self.uid is not None:  # NPROC is per uid: only meaningful with the session's own uid
            argv.append(f"--nproc={limits.max_procs}")
        argv += [
            "--",
            bwrap,
            "--unshare-all",
            "--unshare-user",
            "--die-with-parent",
            "--new-session",
            "--disable-userns",
        ]
        argv += ["--ro-bind", "/usr", "/usr"]
        for d in ("bin", "lib", "lib64", "sbin"):
            src = Path("/") / d
            if src.is_symlink():
                argv += ["--symlink", os.readlink(src), f"/{d}"]
            elif src.exists():
                argv += ["--ro-bind", str(src), f"/{d}"]
        argv += ["--proc", "/proc", "--dev", "/dev"]
        argv += ["--size", str(limits.tmp_mb << 20), "--tmpfs", "/tmp"]
        argv += ["--bind", str(self.path), WORKDIR]
        for host, inside in self.binds.items():
            argv += ["--ro-bind", str(host), inside]
        if hidden:
            argv += ["--ro-bind", str(self.private), HIDDEN]
        # The root and /dev are bwrap's own tmpfs: read-only, so the only writable (and
        # size-bounded) places are /work and /tmp. Device nodes (/dev/null) still work.
        argv += ["--remount-ro", "/dev", "--remount-ro", "/"]
        argv += ["--chdir", WORKDIR, "--clearenv"]
        env = {"PATH": PATH_IN_SANDBOX, "HOME": WORKDIR, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        for k, v in env.items():
            argv += ["--setenv", k, v]
        argv += ["--", *cmd]
        return argv

    def run(
        self,
        cmd: str | list[str],
        timeout_s: float | None = None,
        stdin: bytes | None = None,
        limits: Limits | None = None,
        hidden: bool = False,
        wait: bool = True,
    ) -> ExecResult:
        """Run `cmd` (a shell string for /bin/sh -c, or an argv) in the sandbox, in /work.
        Takes one of the session's and one of the manager's concurrency slots: waits for them, or
        with wait=False raises ExecBusy when either has none free."""
        if self.closed:
            raise IsolationError(f"workspace {self.name} is closed")
        if not self.slots.acquire(blocking=wait):
            raise ExecBusy(
                f"this session already runs {self.manager.max_session_execs} commands "
                "(sandbox.max_execs_per_session); retry when one ends"
            )
        try:
            if not self.manager.slots.acquire(blocking=wait):
                raise ExecBusy(
                    f"all {self.manager.max_concurrent} exec slots are busy (sandbox.max_concurrent_execs); retry"
                )
            try:
                r = self._run(cmd, timeout_s, stdin, limits, hidden)
            finally:
                self.manager.slots.release()
        finally:
            self.slots.release()
        # The command itself saw ENOSPC; this tells the reader (often a model) why and what to do.
        note = self._quota_note(r.stderr + r.stdout)
        r.stderr += note
        r.disk_full = bool(note)
        return r

    def _run(
        self,
        cmd: str | list[str],
        timeout_s: float | None,
        stdin: bytes | None,
        limits: Limits | None,
        hidden: bool,
    ) -> ExecResult:
        limits = limits or self.manager.limits
        timeout = limits.timeout_s if timeout_s is None else min(timeout_s, self.manager.max_timeout_s)
        argv_cmd = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        bwrap = find_bwrap()
        t0 = time.monotonic()
        argv = self._argv(bwrap, limits, argv_cmd, hidden)
        kw: dict[str, Any] = {}
        if self.uid is not None and self.cgroup is not None:
            argv = join_argv(self.cgroup, self.uid, argv)  # joins as root, then becomes the uid
        elif self.uid is not None:
            kw = {"user": self.uid, "group": self.uid, "extra_groups": []}
        with _ACTIVE_LOCK:  # registered before any reaper can see it exit
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                cwd="/",
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                **kw,
            )
            _ACTIVE.add(proc.pid)
        with self._lock:
            self._procs.add(proc)
        try:
            return self._communicate(proc, stdin, timeout, limits, t0)
        finally:
            with self._lock:
                self._procs.discard(proc)
            with _ACTIVE_LOCK:
                _ACTIVE.discard(proc.pid)
            reap_orphans()

    def _communicate(
        self, proc: subprocess.Popen[bytes], stdin: bytes | None, timeout: float, limits: Limits, t0: float
    ) -> ExecResult:
        assert proc.stdout is not None and proc.stderr is not None
        if stdin is not None:
            assert proc.stdin is not None
            pipe = proc.stdin

            def feed() -> None:
                with contextlib.suppress(BrokenPipeError, OSError):
                    pipe.write(stdin)
                with contextlib.suppress(BrokenPipeError, OSError):
                    pipe.close()

            threading.Thread(target=feed, daemon=True).start()
        out, err = _Capture(limits.output_bytes), _Capture(limits.output_bytes)
        caps = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
        deadline = t0 + timeout
        timed_out = False
        with selectors.DefaultSelector() as sel:
            for f in (proc.stdout, proc.stderr):
                os.set_blocking(f.fileno(), False)
                sel.register(f.fileno(), selectors.EVENT_READ)
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    if not timed_out:
                        timed_out = True
                        _kill_group(proc)
                        # The pid namespace dies with bwrap; give the pipes a moment to close.
                        deadline = time.monotonic() + 2.0
                        continue
                    break
                for key, _ in sel.select(min(left, 0.5)):
                    try:
                        data = os.read(key.fd, 1 << 16)
                    except BlockingIOError:
                        continue
                    if not data:
                        sel.unregister(key.fd)
                    else:
                        caps[key.fd].add(data)
        try:
            code = proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            code = proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        if self.closed:  # deleted while running: report it like a kill
            timed_out = timed_out or code < 0
        return ExecResult(
            exit_code=128 - code if code < 0 else code,
            stdout=out.text(),
            stderr=err.text(),
            truncated=bool(out.dropped or err.dropped),
            timed_out=timed_out,
            duration_s=time.monotonic() - t0,
        )

    # ------------------------------------------------------------------ files (inside the sandbox)

    def read_file(self, path: str, max_bytes: int, wait: bool = True) -> tuple[str, bool, bool]:
        """(content, truncated, exists). Read inside the sandbox, so symlinks cannot escape."""
        lim = self.manager.limits
        r = self.run(
            ["/bin/sh", "-c", 'test -f "$1" || exit 44; cat -- "$1"', "sh", path],
            limits=Limits(**{**lim.__dict__, "output_bytes": max_bytes}),
            wait=wait,
        )
        if r.exit_code == 44:
            return "", False, False
        if r.exit_code != 0:
            raise OSError(f"cannot read {path!r}: {r.stderr.strip()[:500]}")
        text = r.stdout
        if r.truncated:  # drop the marker: the flag says it
            text = text[: text.rfind("\n[... truncated:")]
        return text, r.truncated, True

    def write_file(self, path: str, content: str, wait: bool = True) -> int:
        """Write `content` to `path` (created with its parents), inside the sandbox. With a quota,
        a write that does not fit raises QuotaExceeded and leaves any old file untouched."""
        data = content.encode()
        u = self.disk_usage()
        # tmpfs allocates whole pages, plus an inode for the new file.
        need = -(-len(data) // 4096) * 4096
        if u is not None and (need > u.free_bytes or u.used_inodes + 1 > u.quota_inodes):
            raise QuotaExceeded(
                f"cannot write {len(data)} bytes to {path!r}: the session's disk quota has "
                f"{max(u.free_bytes, 0)} bytes free ({u.describe()}); delete files first"
            )
        r = self.run(["/bin/sh", "-c", _WRITE_SCRIPT, "sh", path], stdin=data, wait=wait)
        if r.exit_code != 0:
            err = r.stderr.strip()
            if "No space left on device" in err or "Disk quota exceeded" in err:
                u = self.disk_usage()
                raise QuotaExceeded(
                    f"cannot write {len(data)} bytes to {path!r}: the session's disk quota is full"
                    + (f" ({u.describe()})" if u else "")
                    + "; delete files first"
                )
            raise OSError(f"cannot write {path!r}: {err[:500]}")
        return len(data)

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Kill anything still running, unmount the quota (a tmpfs frees its pages at once, a disk
        image is deleted), delete the directories (symlink-safe)."""
        self.closed = True
        with self._lock:
            procs = list(self._procs)
        for p in procs:
            _kill_group(p)
        self._teardown()


@dataclass
class WorkspaceManager:
    """Creates workspaces under `root` and hands out uids from [uid_base, uid_base + uid_count)."""

    root: Path
    limits: Limits = field(default_factory=Limits)
    max_timeout_s: float = 600.0
    uid_base: int = 200_000
    uid_count: int = 65536
    max_concurrent: int = 16
    max_session_execs: int = 4
    disk_quota_mb: int = 0  # 0: no quota (session directories are plain directories)
    disk_quota_inodes: int = 32768
    disk_quota_backend: QuotaBackend = "disk"
    # Memory, processes and CPU of each session together (cgroups.py); all 0: none.
    session_limits: SessionLimits = field(default_factory=lambda: SessionLimits(0, 0, 0.0))
    use_cgroups: bool = True
    _free: list[int] = field(default_factory=list, repr=False)
    _next: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _owned_root: bool = False

    @classmethod
    def temporary(cls, **kw: Any) -> WorkspaceManager:
        base = Path(tempfile.gettempdir()) / "relay-sandbox"
        m = cls(root=base / f"{os.getpid()}-{uuid.uuid4().hex[:8]}", **kw)
        m._owned_root = True
        return m

    @classmethod
    def from_config(cls, sec: Any, replica: int = 0) -> WorkspaceManager:
        """From a SandboxSection; replica i of a service gets its own uid range."""
        limits = Limits(
            timeout_s=sec.exec_timeout_s,
            cpu_s=sec.exec_cpu_s,
            memory_mb=sec.exec_memory_mb,
            max_procs=sec.exec_max_procs,
            max_file_mb=sec.exec_max_file_mb,
            max_open_files=sec.exec_max_open_files,
            output_bytes=sec.exec_output_bytes,
            tmp_mb=sec.exec_tmp_mb,
        )
        kw = {
            "limits": limits,
            "max_timeout_s": sec.exec_max_timeout_s,
            "uid_base": sec.uid_base + replica * sec.max_sessions,
            "uid_count": sec.max_sessions,
            "max_concurrent": sec.max_concurrent_execs,
            "max_session_execs": sec.max_execs_per_session,
            "disk_quota_mb": sec.disk_quota_mb,
            "disk_quota_inodes": sec.disk_quota_inodes,
            "disk_quota_backend": sec.disk_quota_backend,
            "session_limits": SessionLimits(
                sec.session_memory_mb << 20, sec.session_max_pids, sec.session_cpus
            ),
            "use_cgroups": sec.cgroups == "auto",
        }
        if sec.workdir_root:
            m = cls(root=Path(sec.workdir_root) / f"replica-{replica}", **kw)
            m._owned_root = True
            return m
        return cls.temporary(**kw)

    def __post_init__(self) -> None:
        self.slots = threading.BoundedSemaphore(self.max_concurrent)
        self.root = Path(self.root)
        self.as_root = os.geteuid() == 0
        self._root_ready = False
        self.cgroups: CgroupTree | None = None
        self.cgroups_note = "not set up yet"
        self._cgroups_ready = False

    @property
    def quota_enforced(self) -> bool:
        """Whether session directories get their size-capped filesystem (needs root to mount)."""
        return bool(self.disk_quota_mb) and self.as_root

    def setup_cgroups(self) -> str:
        """Find (and make) the cgroup the sessions' cgroups go under, once; a line saying what
        holds the per-session limits."""
        with self._lock:
            if not self._cgroups_ready:
                self._cgroups_ready = True
                if not self.use_cgroups:
                    self.cgroups_note = 'sandbox.cgroups = "off": per-process rlimits only'
                elif self.session_limits == SessionLimits(0, 0, 0.0):
                    self.cgroups_note = "no per-session limits configured"
                else:
                    name = f"relay-sandbox-{os.getpid()}-{self.root.name}"
                    self.cgroups, self.cgroups_note = detect(name)
            return self.cgroups_note

    def _ensure_root(self) -> None:
        """Create the root on first use, so a service that never runs a command leaves nothing."""
        if self._root_ready:
            return
        with self._lock:
            if self._root_ready:
                return
            if self._owned_root and self.root.parent.name == "relay-sandbox":
                self.root.parent.mkdir(exist_ok=True)
                self.root.parent.chmod(0o711)
            self.root.mkdir(parents=True, exist_ok=True)
            # A previous process on this root that died without closing its sessions left their
            # mounts (tmpfs memory, disk images) behind: detach them before anything else uses it.
            self._unmount_all()
            for image in self.root.glob("*.img"):
                image.unlink(missing_ok=True)
            # Traversable, not listable: bwrap, running as a session's uid, must reach its own
            # directory by path; each session directory is 0700 and owned by that session's uid.
            self.root.chmod(0o711)
            for parent in self.root.resolve().parents:
                if not os.stat(parent).st_mode & 0o001:
                    raise IsolationError(
                        f"sandbox.workdir_root {self.root}: its parent {parent} is not traversable by "
                        "other users (o+x); session uids could not reach their directories"
                    )
            self._root_ready = True

    def _alloc_uid(self) -> int | None:
        if not self.as_root:
            return None  # cannot switch uids: commands run as this user (weaker process limits)
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._next >= self.uid_count:
                raise IsolationError(f"out of sandbox uids ({self.uid_count}); raise sandbox.uid_count")
            self._next += 1
            return self.uid_base + self._next - 1

    def create(self, base: Path | None = None, binds: dict[Path, str] | None = None) -> Workspace:
        self._ensure_root()
        self.setup_cgroups()
        uid = self._alloc_uid()
        ws = Workspace(self, uuid.uuid4().hex, uid, base, binds)
        try:
            ws._setup()
        except BaseException:
            if uid is not None:
                with self._lock:
                    self._free.append(uid)
            raise
        return ws

    def release(self, ws: Workspace) -> None:
        if ws.closed and not ws.path.exists():
            return
        ws.close()
        if ws.uid is not None:
            with self._lock:
                self._free.append(ws.uid)

    def _unmount_all(self) -> None:
        if not self.as_root or not self.root.exists():
            return
        for mp in mounts_under(self.root):
            with contextlib.suppress(OSError):
                unmount(mp)

    def shutdown(self) -> None:
        if self.cgroups is not None:
            self.cgroups.cleanup()
        if self._owned_root and self._root_ready:
            # rmtree would empty a still-mounted tmpfs, fail on its mount point and leak it.
            self._unmount_all()
            shutil.rmtree(self.root, ignore_errors=True)
