"""A plugin environment defined outside services/: importing this module registers it, which is
all `sandbox.plugins = ["test_sandbox_plugin"]` does. test_sandbox_service.py serves it from a
real sandbox process (with tests/ on PYTHONPATH)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from services.common.config import SandboxSection
from services.sandbox.envs import Environment, env_names, load_plugins, make_env, register_env

PLUGIN_ENV = "test-add1"


@register_env(PLUGIN_ENV)
class AddOne(Environment):
    description = "add one mod 10: 'add 4:' -> '5' then EOS"
    max_turns = 1

    def reset(self, seed: int) -> str:
        self.n = random.Random(seed).randrange(10)
        self.answer: str | None = None
        return f"add {self.n}:"

    def step(self, action: str, eos: bool = True) -> tuple[str, bool]:
        self.answer = action if eos else None
        return "", True

    def score(self) -> tuple[float, dict[str, bool]]:
        right = self.answer == str((self.n + 1) % 10)
        return float(right), {"right": right}


def test_plugin_loads_by_module_name(monkeypatch: pytest.MonkeyPatch) -> None:
    # Under pytest's default import mode tests/ is already importable; make it explicit.
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    section = SandboxSection(plugins=["test_sandbox_plugin"])
    load_plugins(section.plugins)
    assert PLUGIN_ENV in env_names()
    env = make_env(PLUGIN_ENV)
    n = int(env.reset(3)[4:-1])
    env.step(str((n + 1) % 10))
    assert env.score()[0] == 1.0
    assert "test_sandbox_plugin" in sys.modules
