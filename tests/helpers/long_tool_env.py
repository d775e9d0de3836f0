"""`long-tools`: a scripted long episode for the sandbox (a plugin: `sandbox.plugins =
["helpers.long_tool_env"]` with tests/ on PYTHONPATH). The task asks for CALLS calls of the
`bash` tool; each call runs for real in the session's sandbox and appends a line to calls.log.
The episode ends after the CALLS-th call; the reward is the share of CALLS lines calls.log holds,
so 1.0 says every call the model made was executed."""

from __future__ import annotations

from services.common.tools import (
    ToolSpec,
    parse_tool_calls,
    render_tool_results,
    render_tools_prompt,
    run_tool_calls,
)
from services.sandbox.envs.base import Environment, Info, register_env
from services.sandbox.isolation import Limits

CALLS = 105
TOOLS = [
    ToolSpec(
        "bash",
        "run a shell command in the repository",
        {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
    )
]
# What the scripted model calls every turn: logs the call, prints the count and a fixed-width line.
CMD = "echo call >> calls.log && wc -l < calls.log && seq -s ' ' 100 120"
LIMITS = Limits(timeout_s=10, cpu_s=10, memory_mb=256, output_bytes=4096)


def tool_output(n: int) -> str:
    """The bash tool's output on the n-th call (1-based), as the environment returns it."""
    return f"exit_code: 0\n{n}\n{' '.join(str(i) for i in range(100, 121))}\n"


@register_env("long-tools")
class LongTools(Environment):
    description = f"call the bash tool {CALLS} times; reward = share of the calls that ran"
    max_turns = 1000
    needs_workspace = True

    def reset(self, seed: int) -> str:
        self.calls = 0
        return f"{render_tools_prompt(TOOLS)}\n\nRun `{CMD}` {CALLS} times, one call per turn."

    def _bash(self, cmd: str) -> str:
        assert self.workspace is not None
        r = self.workspace.run(cmd, limits=LIMITS)
        return f"exit_code: {r.exit_code}\n{r.stdout}{r.stderr}"

    def step(self, action: str, eos: bool = True) -> tuple[str, bool]:
        _content, calls = parse_tool_calls(action, TOOLS)
        if not calls:
            return "", True
        results = run_tool_calls(calls, {"bash": self._bash})
        self.calls += len(results)
        if self.calls >= CALLS:
            return "", True
        return render_tool_results(results, "plain"), False

    def score(self) -> tuple[float, Info]:
        assert self.workspace is not None
        r = self.workspace.run("wc -l < calls.log", limits=LIMITS)
        logged = int(r.stdout.strip() or 0)
        return min(logged, CALLS) / CALLS, {"logged": logged, "calls": self.calls}
