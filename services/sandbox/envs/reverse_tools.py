"""reverse-tools: a multi-turn tool-use task whose episode lengths are heavy-tailed.

Each turn is a `reverse` sub-task answered through a tool call: the env shows `rev bca:`, the
model calls the submit tool with the reversed word in brackets, `[acb]` then EOS, and the env
answers with the tool's result (` ok`, ` no`, or ` ?` for a malformed call) and the next sub-task.
The call syntax stays inside the char tokenizer's alphabet (services/common/tokenizer.py), so a
model trained from random init can learn it: the brackets are two fixed positions, the letters
are `reverse`'s.

The number of turns of an episode is drawn from its seed, from a truncated power law
P(n) ~ n^-TAIL_ALPHA on 1..MAX_TURNS: about 63% of episodes are one turn, 16% two, ~3% ten or
more, and the longest are MAX_TURNS (20x the median), as agentic software-engineering runs are
mostly short with a few very long ones. The length does not depend on the policy (a wrong answer
does not end the episode), so the load of a run is the same whatever the model has learnt.

Reward: the mean over the episode's turns of the share of the answer's positions right (the 5
characters of `[acb]` and the end: EOS right after them), as `positional_score`; the per-character
credit is the same positions (`orchestrator.advantage = "token"`).
"""

from __future__ import annotations

import bisect
import itertools
import random

from services.sandbox.envs.base import Environment, Info, positional_credit, register_env

LETTERS = "abcde"
LENGTH = 3
MAX_TURNS = 20
TAIL_ALPHA = 2.0
OPEN, CLOSE = "[", "]"
OK, WRONG, MALFORMED = " ok", " no", " ?"


def turns_pmf(max_turns: int = MAX_TURNS, alpha: float = TAIL_ALPHA) -> list[float]:
    """P(n turns) for n = 1..max_turns (index n-1): the truncated power law episodes are drawn from."""
    weights = [n**-alpha for n in range(1, max_turns + 1)]
    total = sum(weights)
    return [w / total for w in weights]


_CDF = list(itertools.accumulate(turns_pmf()))


def draw_turns(rng: random.Random) -> int:
    """An episode's number of turns (inverse CDF of turns_pmf: one uniform draw)."""
    return min(bisect.bisect_right(_CDF, rng.random()) + 1, MAX_TURNS)


def tool_call(word: str) -> str:
    return f"{OPEN}{word}{CLOSE}"


@register_env("reverse-tools")
class ReverseTools(Environment):
    description = (
        "1-20 turns (heavy-tailed, from the seed) of 'rev bca:' -> tool call '[acb]' EOS; the tool answers "
        "' ok'/' no'/' ?' and the next word; reward = mean over turns of share of 6 positions right"
    )
    max_turns = MAX_TURNS  # the longest episode; each instance sets its own in reset()

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        self.max_turns = draw_turns(rng)
        self.words = ["".join(rng.choice(LETTERS) for _ in range(LENGTH)) for _ in range(self.max_turns)]
        self.turn_scores: list[float] = []
        self.turn_credit: list[list[float]] = []
        self.malformed = 0
        return f"rev {self.words[0]}:"

    def step(self, action: str, eos: bool = True) -> tuple[str, bool]:
        turn = len(self.turn_scores)
        if turn >= self.max_turns:  # the sandbox refuses this with 409; stay safe if called directly
            return "", True
        target = tool_call(self.words[turn][::-1])
        credit = positional_credit(action, target, eos)
        self.turn_credit.append(credit)
        self.turn_scores.append(sum(credit) / (len(target) + 1))
        result = self._run_tool(action, target)
        if turn + 1 == self.max_turns:
            return result, True
        return f"{result}\nrev {self.words[turn + 1]}:", False

    def _run_tool(self, action: str, target: str) -> str:
        """The submit tool: the call is the text up to the first CLOSE; a turn with no call in
        the bracket syntax gets the error result."""
        if not action.startswith(OPEN) or CLOSE not in action:
            self.malformed += 1
            return MALFORMED
        return OK if action[: action.index(CLOSE) + 1] == target else WRONG

    def credit(self) -> list[list[float]] | None:
        return self.turn_credit

    def score(self) -> tuple[float, Info]:
        # Turns never taken (episode cut short) count as 0, so stopping early never pays.
        exact = sum(1 for s in self.turn_scores if s == 1.0)
        return sum(self.turn_scores) / self.max_turns, {
            "turns": len(self.turn_scores),
            "episode_turns": self.max_turns,
            "exact_turns": exact,
            "malformed": self.malformed,
        }
