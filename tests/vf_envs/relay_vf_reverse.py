"""A verifiers single-turn environment written with the verifiers API only (no relay imports):
reverse three letters, rewarded by a rubric function per answer position. Loaded by relay's
sandbox with verifiers' load_environment (tests/test_verifiers_envs.py)."""

from __future__ import annotations

import random

import verifiers as vf
from datasets import Dataset

LETTERS = "abcdefgh"


def load_environment(num_examples: int = 64, seed: int = 0) -> vf.Environment:
    rng = random.Random(seed)
    rows = []
    for _ in range(num_examples):
        word = "".join(rng.choice(LETTERS) for _ in range(3))
        rows.append({"question": f"reverse {word}:", "answer": word[::-1]})

    def positions(completion: vf.Messages, answer: str, **_: object) -> float:
        """Share of the answer's characters right at their index, plus its exact length."""
        text = (completion[-1].get("content") or "") if isinstance(completion, list) else str(completion)
        right = sum(1 for i, c in enumerate(answer) if i < len(text) and text[i] == c)
        return (right + (len(text) == len(answer))) / (len(answer) + 1)

    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[positions]))
