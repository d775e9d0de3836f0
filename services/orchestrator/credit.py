"""Token credit: per-token advantages from an environment's per-character credit.

With one reward per answer, every token of the answer gets the same advantage, so a token that
was right in an answer that was mostly wrong is pushed down with the rest. An environment that
knows which parts of an answer were right says so with `Environment.credit()`: per model turn,
one value per character of the action it was given, then one for how the turn ended. Here each
model token gets the mean credit of the characters it decoded to (the EOS token: the turn's end
value), and its advantage is that credit minus the group's mean credit at the same (turn, token
index): the group-relative baseline of GRPO, taken per position instead of per answer.

Tokens the credit cannot be placed on (no characters, or a turn the env never saw because its
step timed out), and positions that no other sample of the group reaches (a rambling tail: no
baseline to compare with), keep the sample's sequence advantage, so nothing silently goes
untrained.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from tokenizers import Tokenizer

# Token-by-token decoding is O(n); when it does not add up to the action text (byte-level pieces
# of one character) prefix decoding is O(n^2), so it is only tried for turns up to this long.
PREFIX_DECODE_MAX_TOKENS = 512


@dataclass(frozen=True)
class ActionSpan:
    """One model turn inside a sample: tokens[start : start + n_text] decoded to the action the
    env was given; `eos` says whether the next token is the turn's EOS."""

    start: int
    n_text: int
    eos: bool


def char_bounds(tok: Tokenizer, ids: list[int], action: str) -> list[int] | None:
    """End offset in `action` of each token of `ids` (decoded together they are `action`), or
    None when the tokens cannot be lined up with the text."""
    ends: list[int] = []
    pos = 0
    for t in ids:
        pos += len(tok.decode([t]))
        ends.append(pos)
    if pos == len(action):
        return ends
    if len(ids) > PREFIX_DECODE_MAX_TOKENS:
        return None
    ends = [len(tok.decode(ids[: i + 1])) for i in range(len(ids))]
    return ends if ends and ends[-1] == len(action) else None


def token_credit(
    tok: Tokenizer, tokens: list[int], spans: list[ActionSpan], credit: list[list[float]]
) -> dict[tuple[int, int], tuple[int, float]]:
    """(turn, token index in the turn) -> (position in the sample, credit) for every model token
    the credit can be placed on."""
    out: dict[tuple[int, int], tuple[int, float]] = {}
    for turn, (span, values) in enumerate(zip(spans, credit, strict=False)):
        ids = tokens[span.start : span.start + span.n_text]
        action = tok.decode(ids)
        if len(values) != len(action) + 1:
            continue  # the env saw a different text than this decode (should not happen)
        ends = char_bounds(tok, ids, action) if ids else []
        if ends is None:
            continue
        begin = 0
        for i, end in enumerate(ends):
            if end > begin:
                chars = values[begin:end]
                out[(turn, i)] = (span.start + i, sum(chars) / len(chars))
            begin = end
        if span.eos:
            out[(turn, len(ids))] = (span.start + len(ids), values[-1])
    return out


def group_token_advantages(
    tok: Tokenizer,
    samples_tokens: list[list[int]],
    samples_spans: list[list[ActionSpan]],
    credits: list[list[list[float]] | None],
    sequence_advantages: list[float],
    loss_masks: list[list[int]],
    prior: float = 0.0,
) -> list[list[float]] | None:
    """Per-token advantages for one group (one list per sample, aligned with its tokens, 0.0
    outside the loss mask), or None when no sample of the group has credit. `prior`
    (orchestrator.baseline_prior) counts that many more samples of full credit (1.0) in each
    position's baseline: a position every sample got wrong gets -prior / (n + prior) instead of 0."""
    if all(c is None for c in credits):
        return None
    placed = [
        token_credit(tok, toks, spans, c) if c is not None else {}
        for toks, spans, c in zip(samples_tokens, samples_spans, credits, strict=True)
    ]
    by_key: dict[tuple[int, int], list[float]] = defaultdict(list)
    for p in placed:
        for key, (_, value) in p.items():
            by_key[key].append(value)
    # A position only one sample reaches has no group baseline (its own value would cancel it).
    baseline = {key: (sum(v) + prior) / (len(v) + prior) for key, v in by_key.items() if len(v) > 1}
    out: list[list[float]] = []
    for p, seq_adv, mask in zip(placed, sequence_advantages, loss_masks, strict=True):
        adv = [seq_adv if m else 0.0 for m in mask]
        for key, (pos, value) in p.items():
            if mask[pos] and key in baseline:
                adv[pos] = value - baseline[key]
        out.append(adv)
    return out
