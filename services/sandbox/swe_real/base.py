"""A project's cached, read-only base: its sdist unpacked (`src/`, the lower layer every session's
copy-on-write view starts from) and pytest with the project's test dependencies installed into
`deps/` (mounted read-only at /opt/relay-deps inside the sandbox). Built once per project
version, from the package index through pip, under the cache directory."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from services.common.config import REPO_ROOT
from services.sandbox.swe_real.projects import Project

PYTEST = "pytest==9.2.0"
DEPS_INSIDE = "/opt/relay-deps"
DEFAULT_CACHE = REPO_ROOT / ".cache" / "swe-real"
REPORT = "relay_pytest_report.py"

# Runs the suite inside the sandbox and prints one JSON line: the node ids that failed (or
# errored) and the counts, so the result fits any output budget however many tests pass.
_REPORT_SRC = """
import json, sys
import pytest

class Report:
    def __init__(self):
        self.failed, self.passed = set(), 0
    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.failed.add(report.nodeid)
        elif report.passed and report.when == "call":
            self.passed += 1
    def pytest_collectreport(self, report):
        if report.failed:
            self.failed.add("collect:" + report.nodeid)

r = Report()
first = ["-x"] if "--first" in sys.argv else []
paths = [a for a in sys.argv[1:] if a != "--first"]
code = pytest.main(["-q", "-p", "no:cacheprovider", "-o", "addopts=", *first, *paths], plugins=[r])
print("\\nRELAY-REPORT " + json.dumps({"failed": sorted(r.failed), "passed": r.passed, "code": int(code)}))
"""


class BaseError(RuntimeError):
    pass


def base_dir(project: Project, cache: Path = DEFAULT_CACHE) -> Path:
    return cache / project.key


def ensure_base(project: Project, cache: Path = DEFAULT_CACHE) -> Path:
    """The project's base directory, built if missing (pip download + pip install --target)."""
    d = base_dir(project, cache)
    if (d / "ready.json").exists():
        return d
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{project.key}-", dir=d.parent))
    try:
        pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
        _run([*pip, "download", "--no-deps", "--no-binary", ":all:", f"{project.name}=={project.version}",
              "-d", str(tmp / "dl")])  # fmt: skip
        (sdist,) = list((tmp / "dl").iterdir())
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp / "x", filter="data")
        (root,) = list((tmp / "x").iterdir())
        root.rename(tmp / "src")
        _run([*pip, "install", "--no-compile", "--target", str(tmp / "deps"), PYTEST, *project.test_deps])
        (tmp / "deps" / REPORT).write_text(_REPORT_SRC)
        # The base is reachable only as an overlay's lower layer (or copied): sessions, each its
        # own uid, edit it through their upper layer, so it must be writable to any uid there.
        for dirpath, _dirnames, filenames in os.walk(tmp / "src"):
            os.chmod(dirpath, 0o777)
            for n in filenames:
                p = os.path.join(dirpath, n)
                if not os.path.islink(p):
                    os.chmod(p, 0o666 | (os.stat(p).st_mode & 0o111))
        for dirpath, _dirs, filenames in os.walk(tmp / "deps"):
            os.chmod(dirpath, 0o755)
            for n in filenames:
                p = os.path.join(dirpath, n)
                if not os.path.islink(p):
                    os.chmod(p, 0o644 | (os.stat(p).st_mode & 0o111))
        shutil.rmtree(tmp / "dl")
        shutil.rmtree(tmp / "x")
        (tmp / "ready.json").write_text(json.dumps({"project": project.key, "pytest": PYTEST}))
        tmp.chmod(0o755)
        if d.exists():
            shutil.rmtree(d)
        tmp.rename(d)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return d


def _run(cmd: list[str]) -> None:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise BaseError(f"{' '.join(cmd[:6])} ...: {p.stderr.strip()[-2000:]}")


def test_command(project: Project, tests: list[str] | None = None) -> list[str]:
    """The suite's run inside the sandbox, from /work, printing a RELAY-REPORT line; `tests`:
    only these node ids or paths (quoted for the shell) instead of the project's test paths."""
    path = ":".join([*(f"/work/{p}".rstrip("/.") or "/work" for p in project.pythonpath), DEPS_INSIDE])
    args = " ".join(shlex.quote(t) for t in (tests or project.tests))
    return [
        "/bin/sh",
        "-c",
        f"cd /work && PYTHONPATH={path} exec python3 -S -B {DEPS_INSIDE}/{REPORT} {args}",
    ]
