"""What the sandbox tests that run isolated commands (test_sandbox_exec.py, test_sandbox_quota.py)
share: a session root directory the per-session uids can traverse, and opening a session."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


@contextmanager
def session_root(prefix: str) -> Iterator[Path]:
    """A fresh directory for `sandbox.workdir_root`, removed afterwards. Not under pytest's tmp
    dir: its parents are 0700, and session uids must traverse them."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    root.chmod(0o711)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def root_session_root(prefix: str, why: str) -> Iterator[Path]:
    """`session_root` for tests of what only a root sandbox does (mounts, cgroups, uids): skips
    the test, saying `why`, when not root."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip(f"{why}: needs root")
    with session_root(prefix) as root:
        yield root


def session(c: httpx.Client) -> str:
    """A new session of the `echo` env (seed 0); its id."""
    r = c.post("/v1/sessions", json={"env": "echo", "seed": 0})
    assert r.status_code == 200, r.text
    return r.json()["session_id"]
