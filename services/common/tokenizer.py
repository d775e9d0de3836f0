"""The debug model's character-level tokenizer, built with the `tokenizers` library and saved
as a standard HF `tokenizer.json`, so the engine loads it exactly as it would a real model's;
a model directory's tokenizer (`load_tokenizer`: its tokenizer.json, or a tiktoken BPE file as
Kimi-K2 ships, converted); and a model directory's end-of-sequence ids (`model_eos_ids`,
`end_of_turn_id`), which real HF models declare in config.json / generation_config.json rather
than with an `<eos>` token."""

from __future__ import annotations

import base64
import functools
import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from services.common.chat import ChatTemplate, ChatTemplateError

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIALS = [PAD, EOS, UNK]
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 \n:<>=?.,!-+*/|#()[]'\""


def build_char_tokenizer() -> Tokenizer:
    vocab = {t: i for i, t in enumerate(SPECIALS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # every character is its own pre-token, newline included
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    return tok


def save_tokenizer(tok: Tokenizer, model_dir: Path, chat_template: str | None = None) -> None:
    tok.save(str(model_dir / "tokenizer.json"))
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "model_max_length": 1 << 20,
    }
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The directory's tokenizer.json, or its tiktoken.model (Kimi-K2) converted (tiktoken_tokenizer)."""
    p = Path(model_dir)
    if not (p / "tokenizer.json").is_file() and (p / TIKTOKEN_FILE).is_file():
        f = p / TIKTOKEN_FILE
        return tiktoken_tokenizer(f, f.stat().st_mtime_ns)
    return Tokenizer.from_file(str(p / "tokenizer.json"))


# --------------------------------------------------------------------------- tiktoken (Kimi-K2)

TIKTOKEN_FILE = "tiktoken.model"
# Kimi-K2's pre-tokenizer split (its tokenization_kimi.py pat_str): Han runs, cased words with
# English contractions, 1-3 digits, punctuation runs, newlines, spaces.
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of byte-level BPE vocabularies."""
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = dict(zip(keep, keep, strict=True)), 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {b: chr(c) for b, c in chars.items()}


@functools.lru_cache(maxsize=4)
def tiktoken_tokenizer(path: Path, _mtime_ns: int = 0) -> Tokenizer:
    """A tiktoken BPE file (one `base64(token) rank` per line, ranks 0..n-1) as an HF tokenizers
    byte-level BPE that encodes every text to the same ids: the merges are the ranks (each token
    of rank r is the merge of two lower-ranked tokens, tried in rank order; ignore_merges lets a
    whole pre-token that is itself a token win, as tiktoken does). Special tokens come from the
    directory's tokenizer_config.json `added_tokens_decoder` and must continue the ranks' ids.
    Cached per file version (a conversion of Kimi-K2's 163,840 ranks takes seconds)."""
    ranks: dict[bytes, int] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not 0..{len(ranks) - 1}")
    chars = _byte_chars()

    def text(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    vocab = {text(t): r for t, r in ranks.items()}
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for t, r in ranks.items():
        for i in range(1, len(t)):
            left, right = t[:i], t[i:]
            if left in ranks and right in ranks:
                merges.append((r, ranks[left], ranks[right], left, right))
    merges.sort()
    bpe = models.BPE(vocab, [(text(a), text(b)) for *_, a, b in merges], fuse_unk=False, ignore_merges=True)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    cfg_file = path.parent / "tokenizer_config.json"
    added = json.loads(cfg_file.read_text()).get("added_tokens_decoder", {}) if cfg_file.is_file() else {}
    specials = sorted((int(i), v["content"]) for i, v in added.items())
    for want, content in specials:
        if want != tok.get_vocab_size(with_added_tokens=True):
            raise ValueError(
                f"{cfg_file}: special token {content!r} has id {want}, the ranks end at {tok.get_vocab_size()}"
            )
        tok.add_special_tokens([AddedToken(content, special=True, normalized=False)])
    return tok


def eos_id(tok: Tokenizer) -> int:
    tid = tok.token_to_id(EOS)
    if tid is None:
        raise ValueError("tokenizer has no <eos> token")
    return tid


# --------------------------------------------------------------------------- model EOS ids

# Stands for an assistant turn's content while finding what the chat template closes it with.
_TURN_SENTINEL = "\x00relay-eot\x00"


def _ids_of(value: Any, where: str) -> list[int]:
    """An HF eos_token_id value: absent/null, an int, or a list of ints."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{where}: eos_token_id must be a token id or a list of them, got {value!r}")
    return list(values)


def model_eos_ids(model_dir: str | Path) -> list[int]:
    """Every id that ends generation for this model: `eos_token_id` (an int or a list) of
    config.json and of generation_config.json, config.json's first, without repeats.

    Both, because HF splits them: Qwen3 base lists only <|endoftext|> in config.json while its
    generation_config.json adds <|im_end|>, and transformers' generate stops on the union."""
    p = Path(model_dir)
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        f = p / name
        if f.is_file():
            ids += _ids_of(json.loads(f.read_text()).get("eos_token_id"), f"{p}/{name}")
    return list(dict.fromkeys(ids))


def _tokenizer_eos(model_dir: Path, tok: Tokenizer) -> int | None:
    """tokenizer_config.json's eos_token (a string or an AddedToken dict), as an id."""
    f = model_dir / "tokenizer_config.json"
    if not f.is_file():
        return None
    value = json.loads(f.read_text()).get("eos_token")
    text = value.get("content") if isinstance(value, dict) else value
    return tok.token_to_id(text) if isinstance(text, str) else None


def end_of_turn_id(model_dir: str | Path, tok: Tokenizer, template: ChatTemplate | None = None) -> int:
    """The one id that ends a model turn, for the orchestrator's bookkeeping (it strips it from the
    action text and the chat template must close the turn with exactly it).

    With a chat template: the model EOS id whose text the template writes right after an
    assistant message (Qwen: <|im_end|>, Llama-3: <|eot_id|>). Otherwise tokenizer_config.json's
    eos_token, else the first model EOS id, else the char tokenizer's <eos>."""
    p = Path(model_dir)
    ids = model_eos_ids(p)
    if template is not None and ids:
        messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _TURN_SENTINEL}]
        try:
            rendered = template.render(messages, add_generation_prompt=False)
        except ChatTemplateError:
            rendered = ""  # a template that needs more (a system turn, tools): use the fallbacks
        at = rendered.find(_TURN_SENTINEL)
        if at >= 0:
            tail = rendered[at + len(_TURN_SENTINEL) :]
            for i in ids:
                text = tok.decode([i], skip_special_tokens=False)
                if text and tail.startswith(text):
                    return i
    declared = _tokenizer_eos(p, tok)
    if declared is not None and (not ids or declared in ids):
        return declared
    if ids:
        return ids[0]
    return eos_id(tok)
