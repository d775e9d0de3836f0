"""A verifiers tool environment written with the verifiers API only (no relay imports): the
model may call `lookup(key)` and must answer with the value; rewarded by a rubric function that
scores the final answer against the dataset's (partial credit per
character, 1 for the exact value). Loaded by relay's sandbox with verifiers'
load_environment (tests/test_verifiers_envs.py)."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

TABLE = {"k": "v42", "a": "ab", "b": "ba"}


def lookup(key: str) -> str:
    """The value stored under key."""
    return TABLE.get(key, "none")


def load_environment(max_turns: int = 3) -> vf.Environment:
    rows = [{"question": f"value of {k}?", "answer": v} for k, v in TABLE.items()]

    def answer_positions(completion: vf.Messages, answer: str, **_: object) -> float:
        """1 for the exact value; partial credit per character at its index and for the length."""
        final = completion[-1] if isinstance(completion, list) and completion else {}
        text = ((final.get("content") or "") if hasattr(final, "get") else "").strip()
        right = sum(1 for i, c in enumerate(answer) if i < len(text) and text[i] == c)
        return (right + (len(text) == len(answer))) / (len(answer) + 1)

    return vf.ToolEnv(
        dataset=Dataset.from_list(rows),
        tools=[lookup],
        rubric=vf.Rubric(funcs=[answer_positions]),
        max_turns=max_turns,
    )
