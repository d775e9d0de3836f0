"""The debug model's character-level tokenizer, built with the `tokenizers` library and saved
as a standard HF `tokenizer.json`, so the engine loads it exactly as it would a real model's."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

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


def save_tokenizer(tok: Tokenizer, model_dir: Path) -> None:
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "pad_token": PAD,
                "unk_token": UNK,
                "model_max_length": 1 << 20,
            },
            indent=2,
        )
    )


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


def eos_id(tok: Tokenizer) -> int:
    tid = tok.token_to_id(EOS)
    if tid is None:
        raise ValueError("tokenizer has no <eos> token")
    return tid
