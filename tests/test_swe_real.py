"""Real-repository SWE tasks: the factory's verification on two projects (the injected bug fails
exactly the recorded tests, the unmutated project passes them all), and whole `swe-real` episodes
through the sandbox's HTTP API driven by a scripted agent: the real fix scores 1, a wrong fix 0,
a fix that breaks another test 0.

Needs bubblewrap and root (the copy-on-write base is an overlay mount); the projects' bases are
built once (pip: the sdist, pytest) into the shared cache, `.cache/swe-real`."""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_sandbox_service import Sandbox

from services.common.auth import auth_headers
from services.sandbox.isolation import WorkspaceManager
from services.sandbox.swe_real.base import ensure_base
from services.sandbox.swe_real.projects import BY_NAME
from services.sandbox.swe_real.tasks import Task, build, run_tests, workspace, write_index

PROJECTS = (BY_NAME["inflection"], BY_NAME["text-unidecode"])


def tool(name: str, **args: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


@pytest.fixture(scope="module")
def root() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="relay-swe-real-"))
    d.chmod(0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def mgr(root: Path, bwrap: str) -> Iterator[WorkspaceManager]:
    if os.geteuid() != 0:
        pytest.skip("the copy-on-write base needs root (overlay mounts)")
    m = WorkspaceManager(root=root / "verify", uid_base=random.randrange(1_000_000, 50_000_000, 1000))
    yield m
    m.shutdown()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("swe-real") / "verified.jsonl"  # verify for real, no cache


@pytest.fixture(scope="module")
def tasks(mgr: WorkspaceManager, results: Path) -> list[Task]:
    out = build(seed=0, total=4, projects=PROJECTS, mgr=mgr, max_tries=40, results=results)
    assert {t.project for t in out} == {p.name for p in PROJECTS}, out
    return out


def test_build_resumes_from_its_results(
    mgr: WorkspaceManager, tasks: list[Task], results: Path, tmp_path: Path
) -> None:
    """A build stopped mid-append (its last line cut) and run again: the same tasks, no suite
    run again (mutations and baselines come from the results file), and progress lines."""
    resumed = tmp_path / "verified.jsonl"
    resumed.write_text(results.read_text() + '{"id": "inflection.cut-off", "fail')
    lines: list[str] = []
    again = build(
        seed=0,
        total=4,
        projects=PROJECTS,
        mgr=mgr,
        max_tries=40,
        results=resumed,
        log=lines.append,
        progress_s=0,
    )
    assert [t.id for t in again] == [t.id for t in tasks]
    assert lines[-1].startswith(f"progress: {len(tasks)}/4 tasks kept") and " 0 suite runs" in lines[-1], (
        lines
    )


def test_verified_tasks_fail_with_the_bug_and_pass_without(mgr: WorkspaceManager, tasks: list[Task]) -> None:
    for p in PROJECTS:
        ws = workspace(mgr, p)
        try:
            clean = run_tests(ws, p)
        finally:
            mgr.release(ws)
        assert clean.failed == [] and clean.passed > 100, (p.key, clean.output[-2000:])
    for t in tasks:
        p = BY_NAME[t.project]
        m = t.mutation_obj()
        src = (ensure_base(p) / "src" / m.path).read_text()
        assert src[m.start : m.end] == m.before and m.before != m.after
        ws = workspace(mgr, p)
        try:
            ws.seed_files({m.path: m.apply(src)})
            run = run_tests(ws, p)
        finally:
            mgr.release(ws)
        assert sorted(run.failed) == sorted(t.fail_to_pass) and t.fail_to_pass, t.id
        buggy = m.apply(src)
        line = buggy[buggy.rfind("\n", 0, m.start) + 1 : buggy.find("\n", m.start)].strip()
        # an issue says what fails, not where: the buggy line is not in it
        assert t.fail_to_pass[0].split("::")[-1] in t.statement and line not in t.statement
    # the base itself was never written: sessions only ever wrote their upper layers
    for t in tasks:
        m = t.mutation_obj()
        assert (ensure_base(BY_NAME[t.project]) / "src" / m.path).read_text()[m.start : m.end] == m.before


@pytest.fixture(scope="module")
def sb(
    tasks: list[Task], root: Path, redis_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Sandbox, list[Task]]]:
    index = tmp_path_factory.mktemp("swe-index") / "tasks.jsonl"
    write_index(tasks, index)
    old = os.environ.get("RELAY_SWE_TASKS")
    os.environ["RELAY_SWE_TASKS"] = str(index)
    try:
        s = Sandbox(
            tmp_path_factory.mktemp("swe-sb"),
            redis_server,
            workdir_root=str(root / "sessions"),
            uid_base=random.randrange(1_000_000, 50_000_000, 1000),
        ).wait_ready()
    finally:
        if old is None:
            os.environ.pop("RELAY_SWE_TASKS")
        else:
            os.environ["RELAY_SWE_TASKS"] = old
    yield s, tasks
    s.stop()


def episode(c: httpx.Client, seed: int, actions: list[str]) -> dict:
    r = c.post("/v1/sessions", json={"env": "swe-real", "seed": seed})
    assert r.status_code == 200, r.text
    sid = r.json()["session_id"]
    assert "Fix this issue" in r.json()["prompt"]
    for a in actions:
        r = c.post(f"/v1/sessions/{sid}/step", json={"action": a, "eos": True})
        assert r.status_code == 200, r.text
    r = c.post(f"/v1/sessions/{sid}/score")
    assert r.status_code == 200, r.text
    return r.json()


def fix_edit(t: Task, src: str) -> dict[str, str]:
    """edit_file arguments that undo the mutation: the mutated line, back to the original."""
    m = t.mutation_obj()
    buggy = m.apply(src)
    line_start = buggy.rfind("\n", 0, m.start) + 1
    line_end = buggy.find("\n", m.start)
    old = buggy[line_start:line_end]
    at = m.start - line_start  # the mutated segment, exactly where it is (not the first look-alike)
    new = old[:at] + m.before + old[at + len(m.after) :]
    assert buggy.count(old) == 1, "pick a task whose mutated line is unique"
    return {"path": m.path, "old": old, "new": new}


def test_scripted_agent_fixes_wrong_fix_and_breaking_fix(sb: tuple[Sandbox, list[Task]]) -> None:
    s, tasks = sb
    seed = next(
        i
        for i, t in enumerate(tasks)
        if (lambda src: _unique_line(t, src))(
            (ensure_base(BY_NAME[t.project]) / "src" / t.mutation["path"]).read_text()
        )
    )
    t = tasks[seed]
    p = BY_NAME[t.project]
    src = (ensure_base(p) / "src" / t.mutation["path"]).read_text()
    edit = fix_edit(t, src)
    with httpx.Client(base_url=s.url, timeout=300, headers=auth_headers()) as c:
        # the real fix: look, edit, run the failing tests, answer
        good = episode(
            c,
            seed,
            [
                tool("view_file", path=edit["path"], start=1, end=20),
                tool("edit_file", **edit),
                tool("run_tests", tests=" ".join(t.fail_to_pass[:3])),
                "done",
            ],
        )
        assert good["reward"] == 1.0 and good["info"]["solved"], good
        # a wrong fix: something else edited, the bug left in place
        wrong = episode(c, seed, [tool("bash", cmd=f"echo '# looked at it' >> {edit['path']}"), "done"])
        assert wrong["reward"] == 0.0 and wrong["info"]["fixed"] == 0, wrong
        # the fix plus a regression elsewhere in the module (every function now raises)
        breaking = episode(
            c,
            seed,
            [
                tool("edit_file", **edit),
                tool(
                    "bash",
                    cmd=f"echo 'def __getattr__(name): raise AttributeError(name)' >> {edit['path']} && "
                    f"sed -i '0,/^def /s//def _gone_/' {edit['path']}",
                ),  # fmt: skip
                "done",
            ],
        )
        assert breaking["reward"] == 0.0 and breaking["info"]["broken"] > 0, breaking
        # editing the tests to pass counts for nothing: they are restored for scoring
        cheat = episode(c, seed, [tool("bash", cmd="rm -rf test_* tests test"), "done"])
        assert cheat["reward"] == 0.0, cheat


def _unique_line(t: Task, src: str) -> bool:
    try:
        fix_edit(t, src)
    except AssertionError:
        return False
    return True
