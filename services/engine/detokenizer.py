"""Incremental detokenisation and stop-string detection, per sequence, during generation.

Decoding one token at a time is wrong for real tokenizers: a byte-level BPE token may hold half
of a UTF-8 character, and SentencePiece-style decoders drop a token's leading space when it is
decoded alone. So each step decodes a short window of ids (a few already-emitted ones for
context, then the new ones) and emits only the text beyond the context's, holding it back while
it ends in an incomplete character (U+FFFD). Cost is O(window) per token, not O(output).

Stop strings are searched only in the text that could contain a new match: the newly emitted
text plus the last len(longest stop) - 1 characters before it, so a stop string spread over
several tokens is found at the token that completes it.
"""

from __future__ import annotations

from tokenizers import Tokenizer

# Prompt tokens decoded with the first output tokens, so leading spaces and merges render as they
# would in the full text.
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, context: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(context)
        self.prefix = 0  # ids[prefix:read] were emitted and are decoded again as context
        self.read = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        """Add one token; return the text it completes (possibly "" while a character is split)."""
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Text of tokens still held back (an incomplete character at the end of the output)."""
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return after[len(before) :]


class OutputText:
    """A sequence's output text so far, cut before the first stop string once one appears."""

    def __init__(self, tokenizer: Tokenizer, prompt: list[int], stops: list[str]):
        self.detok = IncrementalDetokenizer(tokenizer, prompt[-CONTEXT_TOKENS:])
        self.stops = [s for s in stops if s]
        self.window = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.stop_str: str | None = None

    def push(self, token: int) -> bool:
        """Add one token's text; True when it completed a stop string (the text is then cut)."""
        return self._extend(self.detok.push(token))

    def finish(self) -> bool:
        """The output ended: add any held-back text. True if that completed a stop string."""
        return self._extend(self.detok.flush()) if self.stop_str is None else False

    def _extend(self, delta: str) -> bool:
        if not delta:
            return False
        start = max(0, len(self.text) - self.window)
        self.text += delta
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        cut, self.stop_str = min(hits)
        self.text = self.text[:cut]
        return True
