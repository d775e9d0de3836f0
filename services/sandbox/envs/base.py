"""The environment interface and the registry that maps task names to environment classes.

One `Environment` instance is one episode: the sandbox builds it, calls `reset(seed)` for the
prompt, `step(action, eos)` once per model turn, and `score()` at the end. Environments are plain
in-process Python objects; the service around them (sessions, expiry, limits, HTTP) lives in
services/sandbox/sessions.py and server.py, so an environment never deals with any of that.

Users add environments without touching this package: decorate a class with
`@register_env("name")` in any importable module and list that module in `sandbox.plugins`.
"""

from __future__ import annotations

import importlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, TypeAlias, TypeVar

if TYPE_CHECKING:
    from services.sandbox.isolation import Workspace

InfoValue: TypeAlias = float | int | str | bool
Info: TypeAlias = dict[str, InfoValue]
ScoreResult: TypeAlias = float | tuple[float, Mapping[str, InfoValue]]


class EnvError(RuntimeError):
    """An environment broke its contract (bad reward, unimportable plugin, name clash)."""


class Environment(ABC):
    """One episode of one task.

    Class attributes (read by `GET /v1/envs` before any instance exists):
      name         set by `@register_env`
      description  one line shown to users
      max_turns    model turns per episode; the sandbox ends the episode after this many steps
                   even if `step` never returns done=True (an instance may lower it in `reset`)
      needs_workspace  give each episode an isolated working directory (see below)
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    max_turns: int = 1
    # True: the sandbox gives each episode an isolated working directory (`self.workspace`, set
    # before `reset`) whose `run(cmd)`, `read_file`, `write_file` execute under bubblewrap.
    needs_workspace: ClassVar[bool] = False
    workspace: Workspace | None = None

    @classmethod
    def workspace_base(cls, seed: int) -> tuple[Path | None, dict[Path, str] | None]:
        """With needs_workspace: the directory the episode's workspace starts from (a
        copy-on-write view of it; None: empty) and host directories mounted read-only inside
        ({host: path inside}). Called before the instance exists, with reset's seed."""
        return None, None

    @abstractmethod
    def reset(self, seed: int) -> str:
        """Start the episode; everything random must come from `random.Random(seed)` so the
        same seed replays the same episode. Returns the prompt text."""

    @abstractmethod
    def step(self, action: str, eos: bool = True) -> tuple[str, bool]:
        """Take one model turn. `action` is the decoded completion with the EOS token stripped;
        `eos` says whether the turn ended with EOS (False: it hit max_tokens). Returns
        (observation, done); the observation is appended to the context and masked out of the
        loss. Must not raise on malformed actions: score them low instead."""

    def credit(self) -> list[list[float]] | None:
        """Optional dense credit for `orchestrator.advantage = "token"`: for each model turn taken
        so far, one value in [0, 1] per character of that turn's action, then one for how the
        turn ended (EOS or cut). It says which parts of an answer were right, so the trainer can
        credit each token instead of the whole answer. None (the default): episode reward only."""
        return None

    @abstractmethod
    def score(self) -> ScoreResult:
        """Reward in [0, 1], or (reward, info) with scalar info values for logging. May be
        called before the episode is done (e.g. the orchestrator ran out of turns)."""


E = TypeVar("E", bound=type[Environment])

_REGISTRY: dict[str, type[Environment]] = {}


def register_env(name: str) -> Callable[[E], E]:
    """Class decorator: make `cls` available as task `name` (what TaskSpec.env names)."""
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"environment name {name!r} must be non-empty and have no whitespace")

    def deco(cls: E) -> E:
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise TypeError(f"@register_env({name!r}) must decorate an Environment subclass, got {cls!r}")
        old = _REGISTRY.get(name)
        # The same class imported twice under two module names (e.g. pytest's importlib mode,
        # then a plugin import) is a re-registration, not a clash; two different classes are.
        if old is not None and old.__qualname__ != cls.__qualname__:
            raise EnvError(
                f"environment {name!r} is registered twice: {old.__module__}.{old.__qualname__} "
                f"and {cls.__module__}.{cls.__qualname__}"
            )
        if cls.max_turns < 1:
            raise ValueError(f"environment {name!r}: max_turns must be >= 1, got {cls.max_turns}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def env_names() -> list[str]:
    return sorted(_REGISTRY)


def get_env_class(name: str) -> type[Environment]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown env {name!r}; known: {', '.join(env_names()) or '(none)'}") from None


def make_env(name: str) -> Environment:
    return get_env_class(name)()


def load_plugins(modules: list[str]) -> None:
    """Import each module so its `@register_env` decorators run (SandboxSection.plugins)."""
    for mod in modules:
        try:
            importlib.import_module(mod)
        except Exception as e:
            raise EnvError(f"sandbox.plugins: cannot import {mod!r}: {type(e).__name__}: {e}") from e


def normalize_score(name: str, result: ScoreResult) -> tuple[float, Info]:
    """Split `score()`'s result into (reward, info) and check the contract, so a plugin bug is
    an error naming the env rather than a pydantic failure deep in the response."""
    if isinstance(result, tuple):
        reward, raw_info = result
        info: Info = dict(raw_info)
    else:
        reward, info = result, {}
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise EnvError(f"env {name!r}: score() returned {type(reward).__name__}, expected a float")
    reward = float(reward)
    if math.isnan(reward) or not 0.0 <= reward <= 1.0:
        raise EnvError(f"env {name!r}: score() returned reward {reward}, outside [0, 1]")
    for k, v in info.items():
        if not isinstance(k, str) or not isinstance(v, float | int | str | bool):
            raise EnvError(f"env {name!r}: score() info[{k!r}] = {v!r} is not a str/int/float/bool")
    return reward, info


def positional_credit(action: str, target: str, eos: bool) -> list[float]:
    """Per character of `action`: 1.0 where it equals the target's character at that index;
    then the end of the answer: 1.0 only for exactly len(target) characters ended by EOS."""
    right = [float(i < len(target) and a == target[i]) for i, a in enumerate(action)]
    return [*right, float(eos and len(action) == len(target))]


def positional_score(action: str, target: str, eos: bool) -> float:
    """Share of the len(target)+1 answer positions right (positional_credit summed): each target
    character at its index, plus the end-of-answer position. Token-positional, so partial
    credit guides early learning."""
    return sum(positional_credit(action, target, eos)) / (len(target) + 1)


def normalize_credit(name: str, credit: object, action_lens: list[int]) -> list[list[float]] | None:
    """Check `credit()`'s result against the actions the env was given (one list per turn, one
    value per character plus the end, each in [0, 1]), naming the env when a plugin breaks it."""
    if credit is None:
        return None
    if not isinstance(credit, list) or len(credit) != len(action_lens):
        n = len(credit) if isinstance(credit, list) else type(credit).__name__
        raise EnvError(f"env {name!r}: credit() gave {n} turn(s), the episode has {len(action_lens)}")
    out: list[list[float]] = []
    for turn, (values, n) in enumerate(zip(credit, action_lens, strict=True)):
        if not isinstance(values, list) or len(values) != n + 1:
            got = len(values) if isinstance(values, list) else type(values).__name__
            raise EnvError(
                f"env {name!r}: credit() turn {turn} has {got} values, expected {n + 1} "
                "(one per action character, then the end)"
            )
        vals = [float(v) for v in values]
        if any(math.isnan(v) or not 0.0 <= v <= 1.0 for v in vals):
            raise EnvError(f"env {name!r}: credit() turn {turn} has a value outside [0, 1]")
        out.append(vals)
    return out
