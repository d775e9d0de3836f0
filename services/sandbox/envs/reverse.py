"""reverse: reverse three letters. The calibrated single-turn toy task (a ~100k-param
model goes from ~0.02 to 0.9 in ~100 GRPO steps)."""

from __future__ import annotations

import random

from services.sandbox.envs.base import Environment, Info, positional_credit, positional_score, register_env

LETTERS = "abcde"
LENGTH = 3


@register_env("reverse")
class Reverse(Environment):
    description = (
        "reverse 3 letters from a-e: 'rev bca:' -> 'acb' then EOS; reward = share of 4 positions right"
    )
    max_turns = 1

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        self.word = "".join(rng.choice(LETTERS) for _ in range(LENGTH))
        self.target = self.word[::-1]
        self.answer: str | None = None
        self.eos = False
        return f"rev {self.word}:"

    def step(self, action: str, eos: bool = True) -> tuple[str, bool]:
        self.answer, self.eos = action, eos
        return "", True

    def credit(self) -> list[list[float]] | None:
        if self.answer is None:
            return []
        return [positional_credit(self.answer, self.target, self.eos)]

    def score(self) -> tuple[float, Info]:
        if self.answer is None:  # scored without an answer (e.g. the model's turn failed)
            return 0.0, {"answered": False, "exact": False}
        reward = positional_score(self.answer, self.target, self.eos)
        return reward, {"answered": True, "exact": reward == 1.0}


@register_env("reverse-turns")
class ReverseTurns(Environment):
    description = (
        "3 turns of reverse: 'rev bca:' -> 'acb' EOS, then observation '\\nrev dea:' -> 'aed' EOS, ...; "
        "reward = mean over the 3 turns of share of 4 positions right"
    )
    max_turns = 3

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        self.words = ["".join(rng.choice(LETTERS) for _ in range(LENGTH)) for _ in range(self.max_turns)]
        self.turn_scores: list[float] = []
        self.turn_credit: list[list[float]] = []
        return f"rev {self.words[0]}:"

    def step(self, action: str, eos: bool = True) -> tuple[str, bool]:
        turn = len(self.turn_scores)
        if turn >= self.max_turns:  # the sandbox refuses this with 409; stay safe if called directly
            return "", True
        credit = positional_credit(action, self.words[turn][::-1], eos)
        self.turn_credit.append(credit)
        self.turn_scores.append(sum(credit) / (LENGTH + 1))
        if turn + 1 == self.max_turns:
            return "", True
        return f"\nrev {self.words[turn + 1]}:", False

    def credit(self) -> list[list[float]] | None:
        return self.turn_credit

    def score(self) -> tuple[float, Info]:
        # Turns never taken (episode cut short) count as 0, so stopping early never pays.
        exact = sum(1 for s in self.turn_scores if s == 1.0)
        return sum(self.turn_scores) / self.max_turns, {"turns": len(self.turn_scores), "exact_turns": exact}
