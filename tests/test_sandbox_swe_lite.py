"""swe-lite: the generator (determinism, variety, bugs exposed by the hidden tests) and whole
episodes through the real sandbox HTTP service, driven by a scripted tool-calling agent."""

from __future__ import annotations

import json
import random
import re
import shutil
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_sandbox_service import Sandbox

from services.common.auth import auth_headers
from services.sandbox.envs.swe_lite import TEMPLATES, generate_task


def tool(name: str, **args: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def hidden_outcomes(core_src: str, seed: int) -> list[tuple[str, bool]]:
    """The hidden cases run host-side against `core_src` (trusted generated code only)."""
    task = generate_task(seed)
    mod = types.ModuleType("core")
    exec(compile(core_src, "core.py", "exec"), mod.__dict__)
    out = []
    for c in json.loads(task.hidden["cases.json"])["cases"]:
        try:
            got = json.dumps(getattr(mod, c["fn"])(*c["args"]), sort_keys=True)
            out.append((c["kind"], got == c["expected"]))
        except Exception:
            out.append((c["kind"], False))
    return out


# ------------------------------------------------------------------ generator


def test_deterministic_by_seed() -> None:
    a, b = generate_task(123), generate_task(123)
    assert a.digest() == b.digest() and a.files == b.files and a.hidden == b.hidden
    assert generate_task(124).digest() != a.digest()


def test_thousands_of_distinct_tasks() -> None:
    tasks = [generate_task(s) for s in range(1100)]
    assert len({t.digest() for t in tasks}) == 1100
    assert len({t.files[t.core_path] for t in tasks}) >= 1000
    # every template and every one of its bugs shows up
    assert len({(t.buggy_fn, t.bug) for t in tasks}) >= 2 * len(TEMPLATES)


def test_hidden_tests_fail_until_fixed() -> None:
    for seed in range(300):
        t = generate_task(seed)
        buggy = hidden_outcomes(t.files[t.core_path], seed)
        assert [ok for kind, ok in buggy if kind == "bug"] == [False] * 8, seed
        assert all(ok for kind, ok in buggy if kind == "regression"), seed
        assert all(ok for _, ok in hidden_outcomes(t.fixed_core, seed)), seed
        assert t.files[t.core_path] != t.fixed_core and t.bug[0] in t.fixed_core


# ------------------------------------------------------------------ through the service


@pytest.fixture(scope="module")
def sb(redis_server: str, tmp_path_factory: pytest.TempPathFactory, bwrap: str) -> Iterator[Sandbox]:
    root = Path(tempfile.mkdtemp(prefix="relay-swe-test-"))
    root.chmod(0o711)
    uid_base = random.randrange(1_000_000, 50_000_000, 1000)
    s = Sandbox(
        tmp_path_factory.mktemp("swe"), redis_server, workdir_root=str(root), uid_base=uid_base
    ).wait_ready()
    yield s
    s.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def client(sb: Sandbox) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sb.url, timeout=60, headers=auth_headers()) as c:
        yield c


def step(c: httpx.Client, sid: str, action: str) -> dict:
    r = c.post(f"/v1/sessions/{sid}/step", json={"action": action, "eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_scripted_agent_solves_task(client: httpx.Client) -> None:
    seed = 7
    task = generate_task(seed)
    r = client.post("/v1/sessions", json={"env": "swe-lite", "seed": seed})
    assert r.status_code == 200, r.text
    s = r.json()
    sid = s["session_id"]
    assert "<tools>" in s["prompt"] and task.issue in s["prompt"] and s["max_turns"] == 30
    # Turn 1: look around and run the tests: they fail.
    obs = step(client, sid, "Let me look.\n" + tool("bash", cmd="ls -R") + tool("run_tests"))
    assert not obs["done"] and task.core_path.split("/")[1] in obs["observation"]
    assert "exit_code: 1" in obs["observation"] and "FAIL" in obs["observation"]
    # Turn 2: read the file, and a malformed call that must come back as an error, not a crash.
    obs = step(client, sid, tool("read_file", path=task.core_path) + "<tool_call>{oops</tool_call>")
    assert task.files[task.core_path] in obs["observation"]
    assert "error: tool call is not valid JSON" in obs["observation"]
    # Turn 3: write the fix and re-run the tests: they pass.
    obs = step(
        client, sid, tool("write_file", path=task.core_path, content=task.fixed_core) + tool("run_tests")
    )
    assert "exit_code: 0" in obs["observation"] and "0 failed" in obs["observation"], obs["observation"]
    # Turn 4: no tool call -> done.
    assert step(client, sid, "Fixed.")["done"] is True
    score = client.post(f"/v1/sessions/{sid}/score").json()
    assert score["reward"] == 1.0, score
    assert score["info"]["solved"] is True and score["info"]["tool_errors"] == 1
    assert score["info"]["tool_calls"] == 6 and score["info"]["turns"] == 4


def test_wrong_fix_and_no_fix_score_zero(client: httpx.Client) -> None:
    seed = 11
    task = generate_task(seed)

    def score_with(core: str | None) -> dict:
        sid = client.post("/v1/sessions", json={"env": "swe-lite", "seed": seed}).json()["session_id"]
        if core is not None:
            r = client.put(f"/v1/sessions/{sid}/files", json={"path": task.core_path, "content": core})
            assert r.status_code == 200, r.text
        return client.post(f"/v1/sessions/{sid}/score").json()

    assert score_with(None)["reward"] == 0.0  # the unfixed repository
    # The buggy function made to return None: still wrong.
    wrong = task.files[task.core_path].replace(
        f"def {task.buggy_fn}(",
        f"def {task.buggy_fn}(*a):\n    return None\n\n\ndef _old_{task.buggy_fn}(",
        1,
    )
    assert score_with(wrong)["reward"] == 0.0
    # The bug fixed but another function broken: a regression zeroes the reward.
    other = next(n for n in re.findall(r"^def (\w+)\(", task.fixed_core, re.M) if n != task.buggy_fn)
    broken = task.fixed_core.replace(
        f"def {other}(", f"def {other}(*a):\n    return 12345\n\n\ndef _old_{other}(", 1
    )
    res = score_with(broken)
    assert res["reward"] == 0.0 and res["info"]["regressions_failed"] == 3
    assert res["info"]["bug_tests_passed"] == 8
    assert score_with("this is not python")["reward"] == 0.0
    assert score_with(task.fixed_core)["reward"] == 1.0


def test_tools_run_inside_the_sandbox(client: httpx.Client) -> None:
    sid = client.post("/v1/sessions", json={"env": "swe-lite", "seed": 3}).json()["session_id"]
    obs = step(
        client,
        sid,
        tool("bash", cmd="cat /etc/shadow; ls /hidden; id -u") + tool("read_file", path="/etc/passwd"),
    )
    o = obs["observation"]
    assert "No such file" in o and "root:x:" not in o and "error: no such file: /etc/passwd" in o
    obs = step(client, sid, tool("bash", cmd="sleep 30", timeout_s=1) + tool("nope"))
    assert "(timed out)" in obs["observation"] and "unknown tool 'nope'" in obs["observation"]
    client.delete(f"/v1/sessions/{sid}")
