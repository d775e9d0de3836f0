"""Prompt-design variants of echo / echo-turns, registered as plugins, to find out why the
letter echo collapses to a constant answer while reverse learns."""

from __future__ import annotations

import random

from services.sandbox.envs.base import Environment, Info, positional_score, register_env


def make(name: str, symbols: str, prompt: str, obs: str, turns: int) -> None:
    @register_env(name)
    class Variant(Environment):
        description = f"echo variant {name}"
        max_turns = turns

        def reset(self, seed: int) -> str:
            rng = random.Random(seed)
            self.symbols = [rng.choice(symbols) for _ in range(turns)]
            self.scores: list[float] = []
            return prompt.format(self.symbols[0])

        def step(self, action: str, eos: bool = True) -> tuple[str, bool]:
            t = len(self.scores)
            self.scores.append(positional_score(action, self.symbols[t], eos))
            if t + 1 == turns:
                return "", True
            return obs.format(self.symbols[t + 1]), False

        def score(self) -> tuple[float, Info]:
            return sum(self.scores) / turns, {}


make("echo-digits", "0123456789", "echo {}:", "\n{}:", 1)
make("echo-bare", "abcdefghij", "{}:", "\n{}:", 1)
make("echo-say", "abcdefghij", "say {}=", "\n{}=", 1)
make("echo-digits-turns", "0123456789", "echo {}:", "\n{}:", 3)
make("echo-bare-turns", "abcdefghij", "{}:", "\n{}:", 3)
