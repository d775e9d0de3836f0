"""A deterministic chat model as a real HF directory: a character tokenizer plus whole-word tokens
and Qwen's `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, a ChatML template with tools, and
weights that make the model an exact bigram table. Every layer's output projections are zero, so
the residual stream is the one-hot token embedding and `lm_head` alone picks the next token:
`bigram_chat_dir(dest, chains)` makes the model follow each chain of tokens (greedy and at T=1,
the logit gap is ~57), and end anything else with `<|endoftext|>`. Served by the real engine, it
writes known assistant turns, tool calls included, through any client."""

from __future__ import annotations

import json
import string
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from services.common.config import ModelConfig
from services.common.modeldir import hf_config
from services.common.weights_dir import write_model_dir
from trainer.model import build_model, to_hf_state

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHARS = sorted(set(string.printable) - set("\t\r\x0b\x0c"))
VOCAB = 160  # >= the tokenizer's size; also the model width, so embeddings can be one-hot

# ChatML with tools in the shape of Qwen's template: tool schemas in a system turn, assistant
# tool calls as Hermes blocks, tool results in a user turn.
TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{% for t in tools %}{{ '\\n' + (t | tojson) }}{% endfor %}"
    "{{ '\\n</tools><|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{% elif m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' + (m.content or '') }}"
    "{% for c in m.tool_calls or [] %}{% set f = c.function if c.function is defined else c %}"
    '{{ \'<tool_call>\\n{"name": "\' + f.name + \'", "arguments": \' }}'
    "{{ f.arguments if f.arguments is string else (f.arguments | tojson) }}{{ '}\\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tokenizer(words: Sequence[str]) -> Tokenizer:
    vocab = {t: i for i, t in enumerate([ENDOFTEXT, IM_START, IM_END, *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=ENDOFTEXT))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([ENDOFTEXT, IM_START, IM_END])
    tok.add_tokens(list(words))
    return tok


def bigram_chat_dir(
    dest: Path, chains: Sequence[Sequence[str]], words: Sequence[str] = (), template: str = TEMPLATE
) -> Path:
    """An HF directory at `dest` whose model follows every chain (token texts: characters,
    `words` or the specials): after chain[i] comes chain[i + 1]. A token that no chain continues
    is followed by <|endoftext|>. EOS: <|im_end|> and <|endoftext|> (generation_config.json)."""
    tok = build_tokenizer(words)
    assert tok.get_vocab_size() <= VOCAB

    def tid(t: str) -> int:
        i = tok.token_to_id(t)
        assert i is not None, f"{t!r} is not a token"
        return i

    m = bigram_model_config()
    hf = to_hf_state(m, build_model(m, seed=0).state_dict())
    for name, w in hf.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            hf[name] = torch.zeros_like(w)  # each layer adds nothing: h = embedding
    hf["model.embed_tokens.weight"] = torch.eye(VOCAB)
    succ = {t: tid(ENDOFTEXT) for t in range(VOCAB)}
    for chain in chains:
        for a, b in zip(chain, chain[1:], strict=False):
            old = succ[tid(a)]
            assert old in (tid(ENDOFTEXT), tid(b)), f"chains disagree on what follows {a!r}"
            succ[tid(a)] = tid(b)
    head = torch.zeros(VOCAB, VOCAB)
    for t, nxt in succ.items():
        head[nxt, t] = 5.0  # logit 5 * sqrt(dim) over 0: greedy and T=1 agree
    hf["lm_head.weight"] = head
    tokdir = dest.parent / f"{dest.name}-tokenizer"
    tokdir.mkdir(parents=True)
    tok.save(str(tokdir / "tokenizer.json"))
    tok_cfg = {"eos_token": ENDOFTEXT, "pad_token": ENDOFTEXT, "chat_template": template}
    (tokdir / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    d = write_model_dir(dest, hf, hf_config(m, tid(ENDOFTEXT)), tokdir, {"version": 0})
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [tid(IM_END), tid(ENDOFTEXT)]}))
    return d


def bigram_model_config() -> ModelConfig:
    """The ModelConfig of bigram_chat_dir's model (what a decode_server needs)."""
    return ModelConfig(
        arch="qwen3", vocab_size=VOCAB, dim=VOCAB, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
        hidden_dim=64, max_seq_len=4096, rope_theta=1e6, tie_embeddings=False, tokenizer="hf",
    )  # fmt: skip
