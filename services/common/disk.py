"""A full disk: how a process recognises it, tells its supervisor, and where its logs go then."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

# The process cannot succeed by being started again (the disk it must write to is full): its
# supervisor gives up at once instead of restarting it into the same wall, and the launcher
# says why.
FATAL_EXIT = 73


def disk_full(e: BaseException | None) -> bool:
    """`e`, or an error it was raised from, is the filesystem saying it has no room."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e = e.__cause__ or e.__context__
    return False


def fallback_log_dir(prefix: str) -> Path:
    """Where a run's logs go once its log directory cannot be written: RELAY_LOG_FALLBACK, else
    the system's temporary directory; one directory per run (its Redis key prefix)."""
    root = os.environ.get("RELAY_LOG_FALLBACK") or os.path.join(tempfile.gettempdir(), "relay-logs")
    return Path(root) / (prefix.replace(":", "_").replace("/", "_") or "run")


def move_stdio(path: Path) -> bool:
    """Point this process's stdout and stderr (fds 1 and 2: its log) at `path`, appending."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        return False
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return True
