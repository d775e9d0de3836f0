"""swe-real: fix a bug injected into a real Python project, checked by the project's own tests.

Tasks come from the real-repository factory (services/sandbox/swe_real/, built by `make tasks`):
a project at an exact version from its sdist, one AST mutation that some of its tests catch, and
an issue written from those tests. The episode's workspace is a copy-on-write view of the
project's cached base (an overlay: nothing is copied at start) with the bug applied; pytest and
the test dependencies are mounted read-only at /opt/relay-deps.

Tools (Hermes/Qwen calls, run under bubblewrap in the session): `bash`, `view_file` (numbered
lines, a range), `edit_file` (replace one exact occurrence of a string), `run_tests` (the
project's suite or some of it). A turn without a tool call ends the episode.

Score: the project's source files as the agent left them are copied into a fresh view of the base
(so edited or added tests count for nothing) and the whole suite runs. Reward = the share of the
task's failing tests that pass, and 0 if any test that passed before the bug fails.
The task index is `$RELAY_SWE_TASKS` (default `.cache/swe-real/tasks.jsonl`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

from services.common.tools import (
    ToolSpec,
    parse_tool_calls,
    render_tool_results,
    render_tools_prompt,
    run_tool_calls,
)
from services.sandbox.envs.base import Environment, Info, register_env
from services.sandbox.envs.swe_lite import _format_exec
from services.sandbox.isolation import Limits
from services.sandbox.swe_real.base import DEFAULT_CACHE, DEPS_INSIDE, ensure_base, test_command
from services.sandbox.swe_real.projects import BY_NAME
from services.sandbox.swe_real.tasks import RUN_LIMITS, Task, read_index, run_tests

TOOLS = [
    ToolSpec(
        "bash",
        "Run a shell command in the repository root (no network). Returns exit code, stdout, stderr.",
        {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
    ),
    ToolSpec(
        "view_file",
        "Show a file of the repository with line numbers, optionally only lines start..end.",
        {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "start": {"type": "integer"},
                "end": {"type": "integer"},
            },
            "required": ["path"],
        },
    ),
    ToolSpec(
        "edit_file",
        "Replace the one occurrence of `old` in a file with `new` (old must occur exactly once).",
        {
            "type": "object",
            "properties": {"path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}},
            "required": ["path", "old", "new"],
        },
    ),
    ToolSpec(
        "run_tests",
        "Run the project's test suite, or only the given pytest node ids / files (space-separated).",
        {"type": "object", "properties": {"tests": {"type": "string"}}},
    ),
]


def task_index() -> Path:
    return Path(os.environ.get("RELAY_SWE_TASKS", str(DEFAULT_CACHE / "tasks.jsonl")))


_TASKS: dict[Path, list[Task]] = {}


def tasks() -> list[Task]:
    path = task_index()
    if path not in _TASKS:
        if not path.exists():
            raise FileNotFoundError(
                f"no swe-real task index at {path}: run `make tasks` (or set RELAY_SWE_TASKS)"
            )
        _TASKS[path] = read_index(path)
    return _TASKS[path]


def task_for(seed: int) -> Task:
    ts = tasks()
    return ts[seed % len(ts)]


@register_env("swe-real")
class SweReal(Environment):
    description = (
        "fix a bug injected into a real Python project (its own pytest suite) with bash/view/edit/run_tests; "
        "reward = share of the failing tests fixed, 0 if another test breaks"
    )
    max_turns = 100
    needs_workspace = True
    observation_format: ClassVar[str] = "plain"  # "qwen" for chat-template models
    tool_limits: ClassVar[Limits] = Limits(
        timeout_s=60, cpu_s=60, memory_mb=2048, output_bytes=16384, tmp_mb=128
    )

    @classmethod
    def workspace_base(cls, seed: int) -> tuple[Path | None, dict[Path, str] | None]:
        t = task_for(seed)
        base = ensure_base(BY_NAME[t.project])
        return base / "src", {base / "deps": DEPS_INSIDE}

    def reset(self, seed: int) -> str:
        assert self.workspace is not None, "swe-real needs a workspace (the sandbox provides one)"
        self.task = task_for(seed)
        self.project = BY_NAME[self.task.project]
        m = self.task.mutation_obj()
        base = ensure_base(self.project)
        self.workspace.seed_files({m.path: m.apply((base / "src" / m.path).read_text())})
        self.tool_calls = 0
        self.handlers = {
            "bash": self._bash,
            "view_file": self._view_file,
            "edit_file": self._edit_file,
            "run_tests": self._run_tests,
        }
        return (
            f"{render_tools_prompt(TOOLS)}\n\n"
            f"You are in a checkout of {self.project.name} {self.project.version} (your current directory). "
            f"Fix this issue:\n\n{self.task.statement}\n\n"
            "Use the tools to inspect and edit the code. Reply without a tool call when you are done."
        )

    # ------------------------------------------------------------------ tools

    def _bash(self, cmd: str) -> str:
        assert self.workspace is not None
        return _format_exec(self.workspace.run(cmd, limits=self.tool_limits))

    def _view_file(self, path: str, start: int = 1, end: int | None = None) -> str:
        assert self.workspace is not None
        text, truncated, exists = self.workspace.read_file(path, 1 << 20)
        if not exists:
            return f"error: no such file: {path}"
        lines = text.splitlines()
        end = len(lines) if end is None else min(end, len(lines))
        shown = "\n".join(f"{i:6d}\t{lines[i - 1]}" for i in range(max(start, 1), end + 1))
        if len(shown) > self.tool_limits.output_bytes:
            shown = shown[: self.tool_limits.output_bytes] + "\n[... truncated: ask for a smaller range ...]"
        return shown or f"(no lines in {start}..{end}; the file has {len(lines)})"

    def _edit_file(self, path: str, old: str, new: str) -> str:
        assert self.workspace is not None
        text, truncated, exists = self.workspace.read_file(path, 1 << 20)
        if not exists:
            return f"error: no such file: {path}"
        if truncated:
            return f"error: {path} is too large to edit here; use bash"
        n = text.count(old) if old else 0
        if n != 1:
            return f"error: `old` occurs {n} times in {path}; it must occur exactly once"
        self.workspace.write_file(path, text.replace(old, new, 1))
        return f"edited {path}"

    def _run_tests(self, tests: str = "") -> str:
        assert self.workspace is not None
        r = self.workspace.run(test_command(self.project, tests.split() or None), limits=self.tool_limits)
        out = "\n".join(ln for ln in r.stdout.splitlines() if not ln.startswith("RELAY-REPORT "))
        return _format_exec(
            type(r)(r.exit_code, out[-self.tool_limits.output_bytes :], r.stderr, timed_out=r.timed_out)
        )

    # ------------------------------------------------------------------ episode

    def step(self, action: str, eos: bool = True) -> tuple[str, bool]:
        _content, calls = parse_tool_calls(action, TOOLS)
        if not calls:
            return "", True
        results = run_tool_calls(calls, self.handlers)
        self.tool_calls += len(results)
        return render_tool_results(results, self.observation_format), False  # type: ignore[arg-type]

    def score(self) -> tuple[float, Info]:
        assert self.workspace is not None
        files: dict[str, str] = {}
        for rel in self.project.src:  # the agent's version of the project's source files
            text, truncated, exists = self.workspace.read_file(rel, 4 << 20)
            if exists and not truncated:
                files[rel] = text
        base = ensure_base(self.project)
        mgr = self.workspace.manager
        fresh = mgr.create(base / "src", {base / "deps": DEPS_INSIDE})
        try:
            fresh.seed_files(files)
            run = run_tests(fresh, self.project, RUN_LIMITS)
        finally:
            mgr.release(fresh)
        reward, info = reward_of(self.task, run.failed)
        return reward, {**info, "tool_calls": self.tool_calls, "task": self.task.id}


def reward_of(task: Task, failed_after: list[str]) -> tuple[float, dict[str, Any]]:
    """Share of the task's failing tests that pass now; 0 if any other test fails."""
    target = set(task.fail_to_pass)
    broken = [f for f in failed_after if f not in target]
    fixed = len(target - set(failed_after))
    reward = 0.0 if broken else fixed / len(target)
    return reward, {"fixed": fixed, "to_fix": len(target), "broken": len(broken), "solved": reward == 1.0}
