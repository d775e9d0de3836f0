"""guess: find a hidden number 0..15 from '<' '>' '=' feedback in up to 6 turns. The task that
shows whether multi-turn masks and the off-policy correction are right (it fails without the
importance-ratio correction). Perfect binary search averages 0.7625."""

from __future__ import annotations

import random
import re

from services.sandbox.envs.base import Environment, Info, register_env

LOW, HIGH = 0, 15
# Leading ASCII digits only ('\d' would also match non-ASCII digits); capped so a
# pathological action never turns into a huge int conversion.
_NUMBER = re.compile(r"[0-9]{1,6}")


@register_env("guess")
class Guess(Environment):
    description = (
        "guess a hidden number 0-15 in up to 6 turns: 'guess 0-15:' -> '7' then EOS; the env replies "
        "' <\\n' (hidden is lower), ' >\\n' (higher), ' =\\n' (solved) or ' ?\\n' (no number); "
        "reward = 1 - 0.1*(turns-1) if solved, else 0"
    )
    max_turns = 6

    def reset(self, seed: int) -> str:
        self.secret = random.Random(seed).randint(LOW, HIGH)
        self.turns = 0
        self.solved_at: int | None = None
        self.malformed = 0
        return f"guess {LOW}-{HIGH}:"

    def step(self, action: str, eos: bool = True) -> tuple[str, bool]:
        if self.solved_at is not None or self.turns >= self.max_turns:
            return "", True
        self.turns += 1
        out_of_turns = self.turns >= self.max_turns
        # The guess is the answer's leading number; what follows it is ignored (lenient, so a
        # random policy still stumbles on rewards: ~0.04 at init).
        m = _NUMBER.match(action)
        if m is None:
            self.malformed += 1
            return " ?\n", out_of_turns
        value = int(m.group())
        if value == self.secret:
            self.solved_at = self.turns
            return " =\n", True
        return (" <\n" if self.secret < value else " >\n"), out_of_turns

    def score(self) -> tuple[float, Info]:
        reward = 0.0 if self.solved_at is None else round(1.0 - 0.1 * (self.solved_at - 1), 6)
        return reward, {
            "turns": self.turns,
            "solved": self.solved_at is not None,
            "malformed": self.malformed,
        }
