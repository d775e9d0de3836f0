"""Per-session resource limits with control groups: memory, processes and CPU for everything a
session runs, together (rlimits bound each process alone: four 1 GiB processes are 4 GiB).

Each session with a workspace gets a cgroup, `<sandbox's own cgroup>/relay-sandbox-<pid>/<session>`,
with `sandbox.session_memory_mb` (memory.max; swap off for it where the kernel accounts swap),
`sandbox.session_max_pids` (pids.max: processes and threads) and `sandbox.session_cpus` (CPU
bandwidth: cpu.max, i.e. that many CPUs' worth of time per period). A command joins it before it
becomes the session's uid (services/sandbox/isolation.py: `join_argv`), so nothing it starts can
leave it. Past memory.max the kernel's OOM killer kills a process of that session only.

- **cgroup v2** (one unified hierarchy with the memory, pids and cpu controllers): used where the
  sandbox can enable them for a subtree of its own cgroup. A cgroup that holds processes cannot
  delegate controllers to children, so the service first moves itself into a leaf
  (`relay-service`) of its cgroup; at the hierarchy's root (a container's own namespace) this is
  not needed.
- **cgroup v1** (separate memory, pids and cpu hierarchies, e.g. hybrid hosts): the same limits in
  each hierarchy (memory.limit_in_bytes, pids.max, cpu.cfs_quota_us).
- **neither** (not root, a read-only /sys/fs/cgroup, controllers missing): `detect` returns None,
  the service logs it, and the limits are the per-process rlimits (sandbox.exec_memory_mb,
  exec_cpu_s) and the per-uid process count (sandbox.exec_max_procs), as without cgroups.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000


@dataclass(frozen=True)
class SessionLimits:
    memory_bytes: int  # 0: no limit
    pids: int  # 0: no limit
    cpus: float  # 0: no limit


def _write(path: Path, value: str) -> None:
    path.write_text(value)


def _mountpoints() -> list[tuple[str, Path, set[str]]]:
    """(fstype, mount point, super options) of every cgroup and cgroup2 mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            head, _, tail = line.partition(" - ")
            fstype, _source, superopts = (tail.split() + ["", "", ""])[:3]
            if fstype in ("cgroup", "cgroup2"):
                out.append((fstype, Path(head.split()[4]), set(superopts.split(","))))
    return out


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per hierarchy: "" for v2's unified one, else each controller."""
    out: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _id, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


class SessionCgroup:
    """One session's cgroup (one directory per hierarchy)."""

    def __init__(self, dirs: list[Path], v2: bool):
        self.dirs, self.v2 = dirs, v2

    @property
    def procs_files(self) -> list[Path]:
        """What a process writes its pid into to join (one per hierarchy)."""
        return [d / "cgroup.procs" for d in self.dirs]

    def pids(self) -> list[int]:
        try:
            text = (self.dirs[0] / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def memory_peak(self) -> int:
        """The most memory the session has used at once, in bytes (0 if the kernel does not say)."""
        for d in self.dirs:
            for name in ("memory.peak", "memory.max_usage_in_bytes"):
                with contextlib.suppress(OSError, ValueError):
                    return int((d / name).read_text())
        return 0

    def kill(self) -> None:
        """SIGKILL everything in the session's cgroup (v2: cgroup.kill, atomic with forks)."""
        if self.v2 and (self.dirs[0] / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                _write(self.dirs[0] / "cgroup.kill", "1")
            return
        for _ in range(50):  # v1: a fork between the read and the kill is caught next round
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)

    def remove(self) -> None:
        """Kill what is left and delete the cgroup (a directory with processes cannot go)."""
        self.kill()
        for d in self.dirs:
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        break
                    time.sleep(0.02)  # the killed processes are still exiting


class CgroupTree:
    """The sandbox's parent cgroup in each hierarchy; makes one child per session."""

    def __init__(self, parents: dict[str, Path], v2: bool):
        # controller -> parent directory (v2: the same directory for all three)
        self.parents, self.v2 = parents, v2

    @property
    def kind(self) -> str:
        return "cgroup v2" if self.v2 else "cgroup v1"

    def _dirs(self, name: str) -> list[Path]:
        return sorted({p / name for p in self.parents.values()})

    def create(self, name: str, limits: SessionLimits) -> SessionCgroup:
        dirs = self._dirs(name)
        for d in dirs:
            d.mkdir(exist_ok=True)
        cg = SessionCgroup(dirs, self.v2)
        try:
            self._limit(name, limits)
        except OSError:
            cg.remove()
            raise
        return cg

    def _limit(self, name: str, limits: SessionLimits) -> None:
        mem, pids, cpu = (self.parents[c] / name for c in CONTROLLERS)
        if self.v2:
            if limits.memory_bytes:
                _write(mem / "memory.max", str(limits.memory_bytes))
                if (mem / "memory.swap.max").exists():
                    _write(mem / "memory.swap.max", "0")
            if limits.pids:
                _write(pids / "pids.max", str(limits.pids))
            if limits.cpus:
                _write(cpu / "cpu.max", f"{int(limits.cpus * CPU_PERIOD_US)} {CPU_PERIOD_US}")
            return
        if limits.memory_bytes:
            _write(mem / "memory.limit_in_bytes", str(limits.memory_bytes))
            if (mem / "memory.memsw.limit_in_bytes").exists():
                _write(mem / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
        if limits.pids:
            _write(pids / "pids.max", str(limits.pids))
        if limits.cpus:
            _write(cpu / "cpu.cfs_period_us", str(CPU_PERIOD_US))
            _write(cpu / "cpu.cfs_quota_us", str(int(limits.cpus * CPU_PERIOD_US)))

    def cleanup(self) -> None:
        """Remove the session cgroups left (a killed predecessor's too) and the parents."""
        for parent in set(self.parents.values()):
            if not parent.exists():
                continue
            for child in parent.iterdir():
                if child.is_dir():
                    SessionCgroup([child], self.v2).remove()
            with contextlib.suppress(OSError):
                parent.rmdir()


def _try_v2(mount: Path, own: str, name: str) -> CgroupTree | None:
    base = mount / own.lstrip("/")
    available = set((base / "cgroup.controllers").read_text().split())
    if not set(CONTROLLERS) <= available:
        return None
    if base != mount:
        # A non-root cgroup with member processes cannot hand controllers to children: move this
        # process (all its threads) into a leaf of its own first.
        leaf = base / "relay-service"
        leaf.mkdir(exist_ok=True)
        _write(leaf / "cgroup.procs", str(os.getpid()))
    _write(base / "cgroup.subtree_control", " ".join(f"+{c}" for c in CONTROLLERS))
    parent = base / name
    parent.mkdir(exist_ok=True)
    _write(parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in CONTROLLERS))
    return CgroupTree(dict.fromkeys(CONTROLLERS, parent), v2=True)


def _try_v1(mounts: list[tuple[str, Path, set[str]]], own: dict[str, str], name: str) -> CgroupTree | None:
    parents: dict[str, Path] = {}
    for c in CONTROLLERS:
        mount = next((mp for fs, mp, opts in mounts if fs == "cgroup" and c in opts), None)
        if mount is None or c not in own:
            return None
        parent = mount / own[c].lstrip("/") / name
        parent.mkdir(exist_ok=True)
        parents[c] = parent
    return CgroupTree(parents, v2=False)


def detect(name: str) -> tuple[CgroupTree | None, str]:
    """The cgroup tree for this sandbox process (`name`: its parent cgroup's name), and a line
    saying what is in use or why none is."""
    if os.geteuid() != 0:
        return None, "not root: no cgroups, per-process rlimits only"
    if shutil.which("setpriv") is None:
        return None, "setpriv (util-linux) is missing: no cgroups, per-process rlimits only"
    mounts = _mountpoints()
    own = _own_paths()
    errors = []
    v2 = next((mp for fs, mp, _ in mounts if fs == "cgroup2"), None)
    if v2 is not None and "" in own:
        try:
            tree = _try_v2(v2, own[""], name)
            if tree is not None:
                return tree, f"cgroup v2 at {tree.parents['memory']}"
            errors.append(f"cgroup v2 at {v2} lacks {'/'.join(CONTROLLERS)} controllers")
        except OSError as e:
            errors.append(f"cgroup v2 at {v2}: {e}")
    try:
        tree = _try_v1(mounts, own, name)
        if tree is not None:
            return tree, f"cgroup v1 at {', '.join(str(p) for p in tree.parents.values())}"
        errors.append(f"no writable cgroup v1 hierarchies for {'/'.join(CONTROLLERS)}")
    except OSError as e:
        errors.append(f"cgroup v1: {e}")
    return None, "; ".join(errors) + ": no cgroups, per-process rlimits only"


# A process joins the session's cgroups before it becomes the session's uid (writing cgroup.procs
# needs root), then execs the command: `sh -c JOIN sh <procs files> -- <argv>`.
JOIN = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


def join_argv(cg: SessionCgroup, uid: int, argv: list[str]) -> list[str]:
    """`argv` run inside `cg` as `uid` (started as root)."""
    drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    return ["/bin/sh", "-c", JOIN, "sh", *map(str, cg.procs_files), "--", *drop, *argv]
