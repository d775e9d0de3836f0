"""docs/environments.md's worked plugin example must keep working as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from services.common.tokenizer import CHARS
from services.sandbox.envs import load_plugins, make_env, normalize_score

DOC = Path(__file__).resolve().parents[1] / "docs" / "environments.md"


def test_doc_plugin_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = DOC.read_text()
    m = re.search(r"<!-- plugin-example.*?-->\s*```python\n(.*?)```", text, re.S)
    assert m, "plugin example block not found in docs/environments.md"
    (tmp_path / "my_envs").mkdir()
    (tmp_path / "my_envs" / "countdown.py").write_text(m.group(1))
    monkeypatch.syspath_prepend(str(tmp_path))
    load_plugins(["my_envs.countdown"])

    # The REPL snippet in the doc.
    env = make_env("countdown")
    assert env.reset(0) == "count 7:"
    assert env.step("6") == (",", False)

    # A full correct episode scores 1, and everything shown is in the debug tokenizer's charset.
    for seed in range(20):
        env = make_env("countdown")
        context = env.reset(seed)
        n = int(context[len("count ") : -1])
        assert env.max_turns == n
        for k in range(n - 1, -1, -1):
            obs, done = env.step(str(k))
            context += str(k) + obs
        assert done and set(context) <= set(CHARS)
        assert normalize_score("countdown", env.score())[0] == 1.0
