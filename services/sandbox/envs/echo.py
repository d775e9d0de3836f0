"""echo and echo-turns: repeat a symbol. echo is the fastest-learning single-turn task; echo-turns
is its 3-turn version, the smallest task that exercises observations in the context (masked out
of the loss) without the long credit assignment of `guess`."""

from __future__ import annotations

import random

from services.sandbox.envs.base import Environment, Info, positional_score, register_env

SYMBOLS = "abcdefghij"


@register_env("echo")
class Echo(Environment):
    description = (
        "repeat one of 10 symbols a-j: 'echo c:' -> 'c' then EOS; reward = share of 2 positions right"
    )
    max_turns = 1

    def reset(self, seed: int) -> str:
        self.symbol = random.Random(seed).choice(SYMBOLS)
        self.answer: str | None = None
        self.eos = False
        return f"echo {self.symbol}:"

    def step(self, action: str, eos: bool = True) -> tuple[str, bool]:
        self.answer, self.eos = action, eos
        return "", True

    def score(self) -> tuple[float, Info]:
        if self.answer is None:
            return 0.0, {"answered": False, "exact": False}
        reward = positional_score(self.answer, self.symbol, self.eos)
        return reward, {"answered": True, "exact": reward == 1.0}


@register_env("echo-turns")
class EchoTurns(Environment):
    description = (
        "3 turns of echo: 'echo c:' -> 'c' EOS, then observation '\\nd:' -> 'd' EOS, ...; "
        "reward = mean over the 3 turns of share of 2 positions right"
    )
    max_turns = 3

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        self.symbols = [rng.choice(SYMBOLS) for _ in range(self.max_turns)]
        self.turn_scores: list[float] = []
        return f"echo {self.symbols[0]}:"

    def step(self, action: str, eos: bool = True) -> tuple[str, bool]:
        turn = len(self.turn_scores)
        if turn >= self.max_turns:  # the sandbox refuses this with 409; stay safe if called directly
            return "", True
        self.turn_scores.append(positional_score(action, self.symbols[turn], eos))
        if turn + 1 == self.max_turns:
            return "", True
        return f"\n{self.symbols[turn + 1]}:", False

    def score(self) -> tuple[float, Info]:
        # Turns never taken (episode cut short) count as 0, so stopping early never pays.
        reward = sum(self.turn_scores) / self.max_turns
        exact = sum(1 for s in self.turn_scores if s == 1.0)
        return reward, {"turns": len(self.turn_scores), "exact_turns": exact}
