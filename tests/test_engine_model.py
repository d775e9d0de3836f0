"""The engine's plain-PyTorch decoder computes the trainer's (torchtitan) function: float32 CPU
log-probs match for the same weights and tokens, full-sequence and incremental with the KV cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.config import EngineConfig, ModelConfig, load_config
from services.engine import LLMEngine
from services.engine.batch import ForwardBatch, Span
from trainer.model import build_model, save_weights_dir

TOL = 1e-5


@pytest.fixture(scope="module", params=["debug", "untied-mha-noqk"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(torchtitan model, engine) holding identical weights. The second variant exercises an
    untied lm_head, plain multi-head attention and no QK-norm (the Llama layout)."""
    m = load_config("debug").model
    if request.param != "debug":
        m = ModelConfig(**{**m.model_dump(), "n_kv_heads": 4, "qk_norm": False, "tie_embeddings": False})
    tt = build_model(m, seed=1).eval()
    with torch.no_grad():  # trainer init leaves norms at 1: perturb them so they are really tested
        for name, p in tt.named_parameters():
            if "norm" in name:
                p.mul_(1 + 0.3 * torch.randn_like(p))
    d = save_weights_dir(m, tt.state_dict(), tmp_path_factory.mktemp("parity") / "w", {"version": 0})
    eng = LLMEngine(d, EngineConfig(device="cpu", max_batch_size=4, max_seq_len=m.max_seq_len))
    return m, tt, eng


def reference(tt: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(tt(tokens).float(), dim=-1)


def span(eng: LLMEngine, seq: int, start: int, tokens: list[int]) -> Span:
    """Sequence `seq` holds the seq-th run of pages, enough for max_seq_len positions."""
    n = eng.kv.blocks_for(eng.kv.max_seq_len)
    return Span(list(range(seq * n, (seq + 1) * n)), start, tokens)


def forward(eng: LLMEngine, spans: list[Span]) -> torch.Tensor:
    """Log-probs at every fed token of every span, concatenated in span order."""
    with torch.inference_mode():
        batch = ForwardBatch.build(spans, eng.device, eng.kv.max_seq_len, eng.kv.block_size)
        return torch.log_softmax(eng.model.logits(eng.model(batch, eng.kv)).float(), dim=-1)


def test_loads_hf_directory(pair) -> None:
    m, _tt, eng = pair
    assert eng.model_config == m
    assert (eng.model.lm_head is None) == m.tie_embeddings


def test_full_sequence_matches_torchtitan(pair) -> None:
    m, tt, eng = pair
    tokens = torch.randint(0, m.vocab_size, (3, 48), generator=torch.Generator().manual_seed(0))
    ref = reference(tt, tokens)
    out = forward(eng, [span(eng, i, 0, tokens[i].tolist()) for i in range(3)]).view(3, 48, -1)
    torch.testing.assert_close(out, ref, atol=TOL, rtol=0)


def test_incremental_decode_matches_torchtitan(pair) -> None:
    """Prefill a prompt, then feed one token per step reading K/V back from the cache."""
    m, tt, eng = pair
    tokens = torch.randint(0, m.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    ref = reference(tt, tokens)
    outs = [forward(eng, [span(eng, s, 0, tokens[s, :7].tolist()) for s in range(2)]).view(2, 7, -1)]
    for pos in range(7, 40):
        outs.append(forward(eng, [span(eng, s, pos, [int(tokens[s, pos])]) for s in range(2)]).view(2, 1, -1))
    torch.testing.assert_close(torch.cat(outs, dim=1), ref, atol=TOL, rtol=0)


def test_mixed_prefill_and_decode_batch_matches_torchtitan(pair) -> None:
    """One forward holding a decode step of one sequence and prefills of different lengths of
    others (the continuous-batching case) gives each sequence its own correct log-probs."""
    m, tt, eng = pair
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, m.vocab_size, (30,), generator=g)
    b = torch.randint(0, m.vocab_size, (11,), generator=g)
    c = torch.randint(0, m.vocab_size, (5,), generator=g)
    forward(eng, [span(eng, 0, 0, a[:29].tolist())])  # sequence 0 holds a's first 29 tokens
    out = forward(
        eng, [span(eng, 1, 0, b.tolist()), span(eng, 0, 29, [int(a[29])]), span(eng, 2, 0, c.tolist())]
    )
    torch.testing.assert_close(out[:11], reference(tt, b[None])[0], atol=TOL, rtol=0)
    torch.testing.assert_close(out[11], reference(tt, a[None])[0, 29], atol=TOL, rtol=0)
    torch.testing.assert_close(out[12:], reference(tt, c[None])[0], atol=TOL, rtol=0)


def test_rejects_mismatched_state(pair, tmp_path: Path) -> None:
    _m, _tt, eng = pair
    state = {k: v.clone() for k, v in eng.model.state_dict().items()}
    state.pop("model.norm.weight")
    with pytest.raises(ValueError, match="model.norm.weight"):
        eng.model.load_hf_state(state)
