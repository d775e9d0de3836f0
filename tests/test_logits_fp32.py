"""Float32 LM-head logits on both sides (ops/lm_head.py): the engine's
`logits()` and the trainer's heads (chunked and plain, forward and backward) return the bf16
GEMM's float32 accumulator instead of rounding it to bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ops.lm_head import float32_logits, gemm_dtype
from services.common.config import EngineConfig, ModelConfig
from services.common.schemas import GenerateRequest, SamplingParams
from services.engine import LLMEngine
from services.engine.batch import ForwardBatch, Span
from trainer.chunked import chunked_logprobs, enable_chunked_output, float32_head
from trainer.loss import logprobs_from_logits
from trainer.model import build_model, save_weights_dir

M = ModelConfig(
    arch="qwen3",
    vocab_size=512,
    dim=128,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=32,
    hidden_dim=256,
    max_seq_len=64,
    qk_norm=True,
    tie_embeddings=False,
)


def _reference(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The exact logits of the bf16 inputs (float64 products and sums)."""
    return h.bfloat16().double() @ w.bfloat16().double().t()


def _bound(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 summation error bound scale: K * 2^-24 * sum |h_k w_k| (loose, per logit)."""
    return h.shape[-1] * 2.0**-24 * (h.bfloat16().double().abs() @ w.bfloat16().double().abs().t())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = build_model(M, seed=0)
    with torch.no_grad():  # transformers-like init: logits of order 1, where the bf16 ulp is ~0.008
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    return save_weights_dir(M, model.state_dict(), tmp_path_factory.mktemp("w") / "w", {"version": 0})


def test_float32_logits_equal_float64_reference() -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(9, 256, generator=g).bfloat16()
    w = (torch.randn(1000, 256, generator=g) * 0.05).bfloat16()
    got = float32_logits(h, w)
    assert got.dtype == torch.float32 and got.shape == (9, 1000)
    err = (got.double() - _reference(h, w)).abs()
    assert bool((err <= _bound(h, w)).all()), float(err.max())
    # the bf16-output GEMM it replaces is off by up to half a bf16 ulp: visibly worse
    old = torch.nn.functional.linear(h, w).double()
    assert float((old - _reference(h, w)).abs().max()) > 100 * float(err.max())
    # float32 inputs: a plain float32 GEMM
    h32, w32 = h.float() + 1e-3, w.float()
    assert torch.equal(float32_logits(h32, w32), h32 @ w32.t())


def test_float32_logits_under_autocast_rounds_inputs_like_the_gemm() -> None:
    """Under autocast (float32 weights) the products are those of the bf16-cast inputs, as
    nn.Linear's bf16 GEMM would use, but the output stays float32."""
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(5, 64, generator=g), torch.randn(300, 64, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert gemm_dtype(h, w) == torch.bfloat16
        got = float32_logits(h, w)
    assert got.dtype == torch.float32
    err = (got.double() - _reference(h, w)).abs()
    assert bool((err <= _bound(h, w)).all()), float(err.max())


def test_engine_logits_are_float32_and_exact(model_dir: Path) -> None:
    for fp32, want in ((True, torch.float32), (False, torch.bfloat16)):
        eng = LLMEngine(
            model_dir, EngineConfig(device="cpu", dtype="bfloat16", max_batch_size=2, logits_fp32=fp32)
        )
        assert eng.model.logits_fp32 is fp32
        hidden = torch.randn(3, M.dim, generator=torch.Generator().manual_seed(2)).bfloat16()
        with torch.inference_mode():
            got = eng.model.logits(hidden)
        assert got.dtype == want
        w = eng.model.lm_head.weight.detach()  # type: ignore[union-attr]
        err = (got.double() - _reference(hidden, w)).abs()
        if fp32:
            assert bool((err <= _bound(hidden, w)).all()), float(err.max())
        else:  # rounded to bf16: half an ulp of |logit| ~ 1 is ~4e-3
            assert float(err.max()) > 1e-4


def test_engine_logprobs_come_from_float32_logits(model_dir: Path) -> None:
    """The sampler takes the float32 logits as they are: the log-prob the engine returns for each
    sampled token is log_softmax of the float32 logits at its position (one prefill of the whole
    sequence in a fresh engine)."""
    cfg = EngineConfig(device="cpu", dtype="bfloat16", max_batch_size=2)
    eng = LLMEngine(model_dir, cfg)
    prompt = [5, 17, 300, 42, 7]
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=3)
    (resp,) = eng.generate([GenerateRequest(input_ids=prompt, sampling=params)])
    out = resp.choices[0]
    ref = LLMEngine(model_dir, cfg)
    tokens = prompt + out.output_ids
    n = ref.kv.blocks_for(ref.kv.max_seq_len)
    with torch.inference_mode():
        batch = ForwardBatch.build([Span(list(range(n)), 0, tokens)], ref.device, ref.kv.max_seq_len, 16)
        logits = ref.model.logits(ref.model(batch, ref.kv))
    assert logits.dtype == torch.float32
    logp = torch.log_softmax(logits, dim=-1)
    for i, (tok, lp) in enumerate(zip(out.output_ids, out.logprobs, strict=True)):
        # bf16 KV written by decode steps vs one prefill: the same values on the CPU torch path
        assert lp == pytest.approx(float(logp[len(prompt) - 1 + i, tok]), abs=1e-5), i


@pytest.mark.parametrize("mode", ["bf16_params", "autocast"])
def test_chunked_float32_head_equals_full_float32_head(mode: str) -> None:
    """Forward and gradients of the chunked head (logits recomputed in the backward) equal the
    plain float32 head's through log_softmax; the gradient follows the float32 logits."""
    g = torch.Generator().manual_seed(4)
    dt = torch.bfloat16 if mode == "bf16_params" else torch.float32
    h0 = torch.randn(2, 11, 64, generator=g).to(dt)
    w0 = (torch.randn(700, 64, generator=g) * 0.1).to(dt)
    t = torch.randint(0, 700, (2, 11), generator=g)
    coef = torch.randn(2, 11, generator=g)
    ctx = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if mode == "autocast"
        else torch.autocast("cpu", enabled=False)
    )
    results = []
    for chunked in (True, False):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        with ctx:
            if chunked:
                logp, ent = chunked_logprobs(h, w, t, chunk=5, fp32=True)
            else:
                logits = float32_head(h, w)
                assert logits.dtype == torch.float32
                logp, ent = logprobs_from_logits(logits, t)
        (logp * coef).sum().backward()
        results.append((logp.detach(), ent.detach(), h.grad, w.grad))
    (lc, ec, ghc, gwc), (lf, ef, ghf, gwf) = results
    torch.testing.assert_close(lc, lf, rtol=0, atol=2e-6)
    torch.testing.assert_close(ec, ef, rtol=0, atol=2e-6)
    assert ghc is not None and ghf is not None and gwc is not None and gwf is not None
    assert ghc.dtype == h0.dtype and gwc.dtype == w0.dtype and gwf.dtype == w0.dtype
    # both round dlogits to bf16 (at most an ulp apart) before the bf16 gradient GEMMs
    torch.testing.assert_close(ghc.float(), ghf.float(), rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(gwc.float(), gwf.float(), rtol=2e-2, atol=2e-3)
    # and the forward is the float32 logits' log-prob, not the bf16-rounded logits'
    ref = torch.log_softmax(_reference(h0, w0), -1).gather(-1, t[..., None]).squeeze(-1)
    assert float((lc.double() - ref).abs().max()) < 1e-5
    rounded = (
        torch.log_softmax(_reference(h0, w0).bfloat16().double(), -1).gather(-1, t[..., None]).squeeze(-1)
    )
    assert float((rounded - ref).abs().max()) > 1e-4  # what bf16 logits would have given


def test_chunked_head_follows_the_switch() -> None:
    """trainer.logits_fp32 reaches the head: enable_chunked_output sets it (again on a second call),
    the plain head returns float32 logits with it and model-dtype logits without."""
    model = build_model(M, seed=0).to(torch.bfloat16)
    tokens = torch.randint(0, M.vocab_size, (1, 8), generator=torch.Generator().manual_seed(5))
    enable_chunked_output(model)
    with torch.no_grad():
        assert model(tokens).dtype == torch.float32
        enable_chunked_output(model, logits_fp32=False)
        assert model(tokens).dtype == torch.bfloat16
    enable_chunked_output(model, logits_fp32=True)
    assert model.output.logits_fp32 is True  # type: ignore[union-attr]


def test_config_switch_defaults_on() -> None:
    from services.common.config import TrainerSection

    assert EngineConfig().logits_fp32 is True
    assert TrainerSection().logits_fp32 is True
    with pytest.raises(Exception, match="logits_fp32"):
        EngineConfig(logits_fp32="maybe")  # type: ignore[arg-type]


def test_replay_bench_runs_both_logits_precisions(tmp_path: Path) -> None:
    """bench/r3/replay.py --logits fp32,bf16: one phase per precision, each recording it (the
    engine's too), and one headline row per precision."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location(
        "bench_r3_replay_logits", Path(__file__).resolve().parents[1] / "bench" / "r3" / "replay.py"
    )
    assert spec is not None and spec.loader is not None
    r3 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(r3)
    out = tmp_path / "r3.json"
    argv = ["--device", "cpu", "--smoke", "--inits", "hf", "--no-fsdp", "--no-sanity"]
    assert r3.main([*argv, "--logits", "fp32,bf16", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    for key, fp32 in (("bf16/hf", True), ("bf16/hf/bf16_logits", False)):
        phase = res[key]
        assert "error" not in phase, phase.get("error")
        assert phase["logits_fp32"] is fp32 and phase["engine"]["engine_logits_fp32"] is fp32
        assert phase["autocast"]["replay_on"]["tokens"] == phase["engine"]["sampled_tokens"] > 0
    assert res["headline"]["hf/autocast"]["logits_fp32"] is True
    assert res["headline"]["hf/autocast/bf16_logits"]["logits_fp32"] is False
    with pytest.raises(SystemExit):
        r3.parse_args([*argv, "--logits", "fp16", "--out", str(out)])
