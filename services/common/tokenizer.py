"""The debug model's character-level tokenizer, built with the `tokenizers` library and saved
as a standard HF `tokenizer.json`, so the engine loads it exactly as it would a real model's;
and a model directory's end-of-sequence ids (`model_eos_ids`, `end_of_turn_id`), which real HF
models declare in config.json / generation_config.json rather than with an `<eos>` token."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

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
    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


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
