"""swe-lite: fix an injected bug in a small generated Python repository, with tools.

`generate_task(seed)` builds a repository deterministically from the seed: a package with a
`core.py` of three small functions drawn from TEMPLATES (names, constants and inputs vary with
the seed), one of which carries an injected bug; a README with a bug report; visible tests and a
tiny test runner (`python3 run_tests.py`; the sandbox's system Python has no pytest). Hidden
tests live outside the repository (the workspace's private directory, mounted read-only at
/hidden only while scoring): `BUG_CASES` calls of the buggy function chosen so that the buggy code
fails every one of them, plus regression calls of the two other functions.

Reward = share of the bug cases passing, and 0 if any regression case fails (a "fix" that breaks
the rest of the module is not a fix). The unfixed repository scores 0, the reference fix 1.

Tools, called Hermes/Qwen style (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
services/common/tools.py) and executed in the session's bubblewrap sandbox: `bash`, `read_file`,
`write_file`, `run_tests`. A turn with no tool call ends the episode; so does max_turns.

Scoring runs the hidden runner under `python3 -I`; it reads a random nonce from stdin before
importing the agent's code and only a result line carrying that nonce counts, and results are
compared as JSON, so a returned object with a lying `__eq__` does not pass. (Code that digs the
nonce out of the runner's frames could still forge a result: this is a training task, not an
adversarial benchmark.)
"""

from __future__ import annotations

import hashlib
import json
import random
import secrets
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from services.common.tools import (
    ToolSpec,
    parse_tool_calls,
    render_tool_results,
    render_tools_prompt,
    run_tool_calls,
)
from services.sandbox.envs.base import Environment, Info, register_env
from services.sandbox.isolation import Limits

BUG_CASES = 8
REGRESSION_CASES = 3

Rng = random.Random


@dataclass(frozen=True)
class Template:
    names: tuple[str, ...]
    doc: str
    src: str  # the correct function; {f} is its name, other {k} come from params(rng)
    bugs: tuple[tuple[str, str], ...]  # (correct snippet, buggy snippet) after formatting
    params: Callable[[Rng], dict[str, Any]]
    inputs: Callable[[Rng, dict[str, Any]], list[Any]]  # one call's positional args


def _ints(rng: Rng, n: int, lo: int = -20, hi: int = 20) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sun", "moon", "star", "tree", "leaf", "rock", "wave"]

TEMPLATES: tuple[Template, ...] = (
    Template(
        ("clamp", "bound", "limit_value"),
        "Clamp x into the closed range [lo, hi].",
        """
def {f}(x, lo, hi):
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x
""",
        (("if x < lo:", "if x > lo:"), ("        return hi", "        return lo")),
        lambda rng: {},
        lambda rng, p: (lambda lo: [rng.randint(-50, 50), lo, lo + rng.randint(0, 30)])(rng.randint(-30, 10)),
    ),
    Template(
        ("count_chars", "tally_letters", "count_matching"),
        "Count the characters of s (case-insensitive) that are among {chars!r}.",
        """
def {f}(s):
    return sum(1 for c in s.lower() if c in {chars!r})
""",
        (("s.lower()", "s"), ("if c in", "if c not in")),
        lambda rng: {"chars": "".join(sorted(rng.sample("abcdefghijklmnopqrstuvwxyz", rng.randint(3, 6))))},
        lambda rng, p: [
            "".join(
                rng.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ")
                for _ in range(rng.randint(3, 20))
            )
        ],
    ),
    Template(
        ("running_sum", "prefix_sums", "cumulative"),
        "Running totals of xs, starting from {start}: element i is start + xs[0] + ... + xs[i].",
        """
def {f}(xs):
    out = []
    total = {start}
    for x in xs:
        total += x
        out.append(total)
    return out
""",
        (
            (
                "        total += x\n        out.append(total)",
                "        out.append(total)\n        total += x",
            ),
            ("total += x", "total = x"),
        ),
        lambda rng: {"start": rng.choice([0, 0, 1, 10, 100])},
        lambda rng, p: [_ints(rng, rng.randint(1, 7))],
    ),
    Template(
        ("is_palindrome", "reads_same_backwards", "palindromic"),
        "True when s reads the same backwards, ignoring case and non-alphanumeric characters.",
        """
def {f}(s):
    cleaned = [c.lower() for c in s if c.isalnum()]
    return cleaned == cleaned[::-1]
""",
        (("c.lower()", "c"), (" if c.isalnum()", "")),
        lambda rng: {},
        lambda rng, p: [
            (
                lambda w: rng.choice(
                    [w + w[::-1], w + " " + w[::-1].upper(), w.capitalize() + ", " + w[::-1], w]
                )
            )("".join(rng.choice("abcxyz") for _ in range(rng.randint(1, 5))))
        ],
    ),
    Template(
        ("mean", "average", "arithmetic_mean"),
        "Arithmetic mean of xs; {default} for an empty list.",
        """
def {f}(xs):
    if not xs:
        return {default}
    return sum(xs) / len(xs)
""",
        (("sum(xs) / len(xs)", "sum(xs) // len(xs)"), ("/ len(xs)", "/ (len(xs) + 1)")),
        lambda rng: {"default": rng.choice([0.0, -1.0, 0.5])},
        lambda rng, p: [_ints(rng, rng.randint(1, 6))],
    ),
    Template(
        ("argmax", "index_of_max", "position_of_largest"),
        "Index of the largest element of the non-empty list xs; the first one on ties.",
        """
def {f}(xs):
    best = 0
    for i in range(1, len(xs)):
        if xs[i] > xs[best]:
            best = i
    return best
""",
        (("xs[i] > xs[best]", "xs[i] >= xs[best]"), ("range(1, len(xs))", "range(1, len(xs) - 1)")),
        lambda rng: {},
        lambda rng, p: [_ints(rng, rng.randint(2, 8), 0, 5)],
    ),
    Template(
        ("dedupe", "unique_in_order", "drop_repeats"),
        "The elements of xs without repeats, in order of first appearance.",
        """
def {f}(xs):
    seen = set()
    out = []
    for x in xs:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out
""",
        (("            seen.add(x)\n", ""), ("    return out", "    return sorted(out)")),
        lambda rng: {},
        lambda rng, p: [_ints(rng, rng.randint(2, 9), 0, 6)],
    ),
    Template(
        ("rotate", "rotate_right", "shift_right"),
        "xs rotated right by k places (k may exceed len(xs)); [] for an empty list.",
        """
def {f}(xs, k):
    if not xs:
        return []
    k %= len(xs)
    return xs[-k:] + xs[:-k] if k else list(xs)
""",
        (("xs[-k:] + xs[:-k]", "xs[k:] + xs[:k]"), ("    k %= len(xs)\n", "    k = min(k, len(xs) - 1)\n")),
        lambda rng: {},
        lambda rng, p: [_ints(rng, rng.randint(1, 7)), rng.randint(0, 12)],
    ),
    Template(
        ("word_count", "count_words", "word_frequencies"),
        "Occurrences of each word of text, lower-cased, with {punct!r} stripped from both ends.",
        """
def {f}(text):
    counts = {{}}
    for w in text.split():
        w = w.strip({punct!r}).lower()
        if w:
            counts[w] = counts.get(w, 0) + 1
    return counts
""",
        ((".lower()", ""), ("counts.get(w, 0) + 1", "1")),
        lambda rng: {"punct": rng.choice([".,!?", ".,;:", "!?.", ".,"])},
        lambda rng, p: [
            " ".join(
                (lambda w: rng.choice([w, w.capitalize(), w + rng.choice(p["punct"])]))(rng.choice(WORDS[:5]))
                for _ in range(rng.randint(2, 9))
            )
        ],
    ),
    Template(
        ("digit_sum", "sum_of_digits", "add_digits"),
        "Sum of the base-{base} digits of abs(n).",
        """
def {f}(n):
    n = abs(n)
    total = 0
    while n:
        total += n % {base}
        n //= {base}
    return total
""",
        (("total += n % {base}", "total = n % {base}"), ("total += n % {base}", "total += n // {base}")),
        lambda rng: {"base": rng.choice([10, 10, 2, 8, 16])},
        lambda rng, p: [rng.randint(-5000, 5000)],
    ),
    Template(
        ("scale", "scale_all", "multiply_each"),
        "Each element of xs multiplied by factor, rounded to {nd} decimals.",
        """
def {f}(xs, factor):
    return [round(x * factor, {nd}) for x in xs]
""",
        (("x * factor", "x + factor"), ("round(x * factor, {nd})", "int(x * factor)")),
        lambda rng: {"nd": rng.choice([1, 2, 3])},
        lambda rng, p: [_ints(rng, rng.randint(1, 6)), rng.choice([0.5, 1.5, 2.25, -0.75, 3.1])],
    ),
    Template(
        ("fizzbuzz", "fizz_words", "number_words"),
        "For i in 1..n: '{w1}{w2}' if i is divisible by {a} and {b}, '{w1}' if by {a}, '{w2}' if by {b}, else str(i).",
        """
def {f}(n):
    out = []
    for i in range(1, n + 1):
        if i % {a} == 0 and i % {b} == 0:
            out.append("{w1}{w2}")
        elif i % {a} == 0:
            out.append("{w1}")
        elif i % {b} == 0:
            out.append("{w2}")
        else:
            out.append(str(i))
    return out
""",
        (("range(1, n + 1)", "range(1, n)"), ("== 0 and i %", "== 0 or i %")),
        lambda rng: (
            dict(zip(("a", "b"), rng.sample([2, 3, 4, 5, 7], 2), strict=True))
            | {"w1": rng.choice(["Fizz", "Foo", "Ping"]), "w2": rng.choice(["Buzz", "Bar", "Pong"])}
        ),
        lambda rng, p: [rng.randint(1, 40)],
    ),
)

PKG_ADJ = [
    "tiny",
    "quick",
    "lazy",
    "brave",
    "calm",
    "eager",
    "fuzzy",
    "gentle",
    "happy",
    "jolly",
    "kind",
    "lucky",
]
PKG_NOUN = [
    "otter",
    "falcon",
    "badger",
    "lynx",
    "heron",
    "koala",
    "panda",
    "raven",
    "tapir",
    "wombat",
    "yak",
    "zebra",
]


@dataclass
class SweTask:
    seed: int
    package: str
    buggy_fn: str
    bug: tuple[str, str]
    files: dict[str, str]  # the repository as given to the agent
    fixed_core: str  # reference content of {package}/core.py
    hidden: dict[str, str]  # hidden test files (runner + cases)
    issue: str
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def core_path(self) -> str:
        return f"{self.package}/core.py"

    def digest(self) -> str:
        blob = json.dumps([self.files, self.hidden], sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()


def _compile(src: str, fn: str) -> Callable[..., Any]:
    ns: dict[str, Any] = {}
    exec(compile(src, "<swe-lite>", "exec"), ns)  # our own generated, trusted template code
    return ns[fn]


def _call(fn: Callable[..., Any], args: list[Any]) -> tuple[bool, str]:
    try:
        return True, json.dumps(fn(*json.loads(json.dumps(args))), sort_keys=True)
    except Exception as e:
        return False, type(e).__name__


RUNNER = '''"""swe-lite hidden test runner (not part of the repository)."""
import json, sys

nonce = sys.stdin.readline().strip()
sys.stdin.close()
cases = json.load(open("/hidden/cases.json"))
sys.path.insert(0, "/work")
results = []
try:
    import importlib
    core = importlib.import_module(cases["module"])
    error = None
except BaseException as e:
    core, error = None, f"import failed: {type(e).__name__}: {e}"
for case in cases["cases"]:
    ok = False
    if core is not None:
        try:
            got = getattr(core, case["fn"])(*case["args"])
            ok = json.dumps(got, sort_keys=True) == case["expected"] and type(got).__name__ == case["type"]
        except BaseException:
            ok = False
    results.append({"kind": case["kind"], "ok": ok})
sys.stdout.flush()
sys.__stdout__.write("\\nRELAY-RESULT " + nonce + " " + json.dumps({"results": results, "error": error}) + "\\n")
sys.__stdout__.flush()
'''

TEST_RUNNER = '''"""Run the repository's tests: python3 run_tests.py [tests/test_x.py ...]"""
import importlib.util, pathlib, sys, traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
paths = sys.argv[1:] or sorted(str(p) for p in pathlib.Path("tests").glob("test_*.py"))
passed = failed = 0
for path in paths:
    spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, path)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception:
        print(f"ERROR collecting {path}:\\n{traceback.format_exc(limit=3)}")
        failed += 1
        continue
    for name in sorted(n for n in dir(mod) if n.startswith("test_")):
        try:
            getattr(mod, name)()
            passed += 1
            print(f"PASS {path}::{name}")
        except Exception:
            failed += 1
            print(f"FAIL {path}::{name}\\n{traceback.format_exc(limit=2)}")
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
'''


def generate_task(seed: int) -> SweTask:
    """A deterministic task from the seed (same seed -> byte-identical repository and tests)."""
    rng = random.Random(f"swe-lite:{seed}")
    package = f"{rng.choice(PKG_ADJ)}_{rng.choice(PKG_NOUN)}"
    chosen = rng.sample(range(len(TEMPLATES)), 3)
    bug_slot = rng.randrange(3)
    funcs: list[tuple[Template, str, dict[str, Any], str]] = []
    for ti in chosen:
        t = TEMPLATES[ti]
        fname = rng.choice(t.names)
        params = t.params(rng)
        src = textwrap.dedent(t.src).strip("\n").format(f=fname, **params)
        doc = t.doc.format(**params)
        src = src.replace("):\n", f'):\n    """{doc}"""\n', 1)
        funcs.append((t, fname, params, src))
    t, fname, params, good_src = funcs[bug_slot]
    bug_options = [(a.format(**params), b.format(**params)) for a, b in t.bugs]
    bug = bug_options[rng.randrange(len(bug_options))]
    assert bug[0] in good_src, (fname, bug)
    bad_src = good_src.replace(bug[0], bug[1], 1)
    good_fn, bad_fn = _compile(good_src, fname), _compile(bad_src, fname)

    # Bug cases: inputs where the buggy code differs from the reference (buggy fails them all).
    cases: list[dict[str, Any]] = []
    seen: set[str] = set()
    for _ in range(2000):
        args = t.inputs(rng, params)
        key = json.dumps(args)
        if key in seen:
            continue
        seen.add(key)
        ok, want = _call(good_fn, args)
        if ok and _call(bad_fn, args) != (True, want):
            cases.append({"fn": fname, "args": args, "expected": want, "kind": "bug"})
            if len(cases) == BUG_CASES:
                break
    if len(cases) < BUG_CASES:  # astronomically unlikely with these templates; keep determinism
        raise RuntimeError(f"swe-lite seed {seed}: bug {bug} not exposed by enough inputs")
    for i, (ot, oname, oparams, osrc) in enumerate(funcs):
        if i == bug_slot:
            continue
        ofn = _compile(osrc, oname)
        for _ in range(REGRESSION_CASES):
            args = ot.inputs(rng, oparams)
            ok, want = _call(ofn, args)
            if ok:
                cases.append({"fn": oname, "args": args, "expected": want, "kind": "regression"})
    for c in cases:
        c["type"] = type(json.loads(c["expected"])).__name__

    header = f'"""{package}: small utilities."""\n\n\n'
    fixed_core = header + "\n\n\n".join(s for *_, s in funcs) + "\n"
    buggy_core = fixed_core.replace(good_src, bad_src, 1)
    example = cases[0]
    ok, got = _call(bad_fn, example["args"])
    got_text = repr(json.loads(got)) if ok else f"raises {got}"
    call_text = f"{fname}({', '.join(repr(a) for a in example['args'])})"
    issue = (
        f"Bug report: `{call_text}` returns {got_text}, but it should return "
        f"{json.loads(example['expected'])!r}.\n"
        f"Expected behaviour of `{fname}`: {t.doc.format(**params)}"
    )
    visible = [c for c in cases if c["kind"] == "regression"][:2] + [cases[1]]
    test_lines = [f"from {package}.core import {', '.join(sorted({c['fn'] for c in visible}))}\n"]
    for i, c in enumerate(visible):
        arg_text = ", ".join(repr(a) for a in c["args"])
        test_lines.append(
            f"\ndef test_{c['fn']}_{i}():\n    assert {c['fn']}({arg_text}) == {json.loads(c['expected'])!r}\n"
        )
    files = {
        f"{package}/__init__.py": "",
        f"{package}/core.py": buggy_core,
        "tests/test_core.py": "".join(test_lines),
        "run_tests.py": TEST_RUNNER,
        "README.md": f"# {package}\n\nSmall utility functions. Run the tests with `python3 run_tests.py`.\n\n"
        f"## Open issue\n\n{issue}\n",
    }
    hidden = {
        "runner.py": RUNNER,
        "cases.json": json.dumps({"module": f"{package}.core", "cases": cases}),
    }
    return SweTask(
        seed=seed,
        package=package,
        buggy_fn=fname,
        bug=bug,
        files=files,
        fixed_core=fixed_core,
        hidden=hidden,
        issue=issue,
        meta={"templates": [TEMPLATES[i].names[0] for i in chosen]},
    )


TOOLS = [
    ToolSpec(
        "bash",
        "Run a shell command in the repository root (no network). Returns exit code, stdout, stderr.",
        {
            "type": "object",
            "properties": {"cmd": {"type": "string"}, "timeout_s": {"type": "number"}},
            "required": ["cmd"],
        },
    ),
    ToolSpec(
        "read_file",
        "Read a file of the repository.",
        {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    ),
    ToolSpec(
        "write_file",
        "Create or overwrite a file of the repository with the given content.",
        {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["path", "content"],
        },
    ),
    ToolSpec("run_tests", "Run the repository's visible tests.", {"type": "object", "properties": {}}),
]


def _format_exec(r: Any) -> str:
    parts = [f"exit_code: {r.exit_code}" + (" (timed out)" if r.timed_out else "")]
    if r.stdout:
        parts.append(f"stdout:\n{r.stdout}")
    if r.stderr:
        parts.append(f"stderr:\n{r.stderr}")
    return "\n".join(parts)


@register_env("swe-lite")
class SweLite(Environment):
    description = (
        "fix an injected bug in a generated Python repo with bash/read_file/write_file/run_tests tools; "
        "reward = share of hidden tests passing"
    )
    max_turns = 30
    needs_workspace = True
    observation_format: ClassVar[str] = "plain"  # "qwen" for chat-template models
    tool_limits: ClassVar[Limits] = Limits(timeout_s=10, cpu_s=10, memory_mb=512, output_bytes=8192)
    score_limits: ClassVar[Limits] = Limits(timeout_s=20, cpu_s=15, memory_mb=512, output_bytes=65536)

    def reset(self, seed: int) -> str:
        assert self.workspace is not None, "swe-lite needs a workspace (the sandbox provides one)"
        self.task = generate_task(seed)
        self.workspace.seed_files(self.task.files)
        self.workspace.seed_private(self.task.hidden)
        self.tool_calls = 0
        self.tool_errors = 0
        self.handlers = {
            "bash": self._bash,
            "read_file": self._read_file,
            "write_file": self._write_file,
            "run_tests": self._run_tests,
        }
        return (
            f"{render_tools_prompt(TOOLS)}\n\n"
            f"You are working in the repository `{self.task.package}` (your current directory). "
            f"Fix this issue:\n\n{self.task.issue}\n\n"
            "Use the tools to inspect and edit the code. Reply without a tool call when you are done."
        )

    # ------------------------------------------------------------------ tools

    def _bash(self, cmd: str, timeout_s: float | None = None) -> str:
        assert self.workspace is not None
        return _format_exec(self.workspace.run(cmd, timeout_s=timeout_s, limits=self.tool_limits))

    def _read_file(self, path: str) -> str:
        assert self.workspace is not None
        text, truncated, exists = self.workspace.read_file(path, self.tool_limits.output_bytes)
        if not exists:
            return f"error: no such file: {path}"
        return text + ("\n[... truncated ...]" if truncated else "")

    def _write_file(self, path: str, content: str) -> str:
        assert self.workspace is not None
        return f"wrote {self.workspace.write_file(path, content)} bytes to {path}"

    def _run_tests(self) -> str:
        assert self.workspace is not None
        return _format_exec(self.workspace.run(["python3", "-I", "run_tests.py"], limits=self.tool_limits))

    # ------------------------------------------------------------------ episode

    def step(self, action: str, eos: bool = True) -> tuple[str, bool]:
        _content, calls = parse_tool_calls(action, TOOLS)
        if not calls:
            return "", True  # an answer without a tool call ends the episode
        results = run_tool_calls(calls, self.handlers)
        self.tool_calls += len(results)
        self.tool_errors += sum(r.error for r in results)
        return render_tool_results(results, self.observation_format), False  # type: ignore[arg-type]

    def score(self) -> tuple[float, Info]:
        assert self.workspace is not None
        nonce = secrets.token_hex(16)
        r = self.workspace.run(
            ["python3", "-I", "/hidden/runner.py"],
            stdin=(nonce + "\n").encode(),
            limits=self.score_limits,
            hidden=True,
        )
        marker = f"RELAY-RESULT {nonce} "
        line = next((ln for ln in reversed(r.stdout.splitlines()) if ln.startswith(marker)), None)
        info: Info = {"tool_calls": self.tool_calls, "tool_errors": self.tool_errors, "seed": self.task.seed}
        if line is None:
            return 0.0, {**info, "error": "hidden tests produced no result", "timed_out": r.timed_out}
        out = json.loads(line[len(marker) :])
        bug = [x["ok"] for x in out["results"] if x["kind"] == "bug"]
        reg = [x["ok"] for x in out["results"] if x["kind"] == "regression"]
        bug_share = sum(bug) / len(bug)
        reward = bug_share if all(reg) else 0.0
        info.update(
            {
                "bug_tests_passed": sum(bug),
                "bug_tests": len(bug),
                "regressions_failed": len(reg) - sum(reg),
                "solved": reward == 1.0,
            }
        )
        if out.get("error"):
            info["error"] = str(out["error"])[:200]
        return reward, info
