"""Nemotron-H with decode.engine.quantization = "fp8" on CPU: which linears hold E4M3 weights with
128x128 scales (attention, Mamba-2 in/out projections, MLP, shared and routed experts) and which
stay high precision (embeddings, lm_head, norms, routers, the Mamba-2 convolution and its
dt/A/D parameters), the fp8 bits being the checkpoint's 128x128 quantisation, and the logits
against the same weights unquantised within the bounds the other models' FP8 tests use
(tests/test_fp8_linear.py: logits rel < 0.1 and top-1 > 0.8 as its MoE decoder, KL < 2e-3 as its
engine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.moe import small_nemotron
from torch import nn

from ops.fp8.recipe import quantize_weight
from services.common.config import EngineConfig, ModelConfig
from services.common.schemas import GenerateRequest, SamplingParams
from services.engine import LLMEngine
from services.engine.batch import ForwardBatch, Span, StateMeta
from services.engine.kv_cache import KVCache
from services.engine.layers.fp8 import Fp8Linear, Fp8Relu2Experts
from services.engine.loader import read_checkpoint
from trainer.model import build_model, save_weights_dir

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelConfig, Path]:
    """The trainer's init with a larger output head, as tests/test_fp8_linear.py's models: the
    next-token distributions spread out, so a KL between two models means something."""
    m = small_nemotron()
    model = build_model(m, seed=0)
    with torch.no_grad():
        model.output.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(100))
    d = save_weights_dir(m, model.state_dict(), tmp_path_factory.mktemp("f") / "step_0", {})
    return m, d


def engine(d: Path, m: ModelConfig, quantization: str) -> LLMEngine:
    cfg = EngineConfig(device="cpu", max_batch_size=4, max_seq_len=m.max_seq_len, quantization=quantization)  # type: ignore[arg-type]
    return LLMEngine(d, cfg)


def logits(model: nn.Module, m: ModelConfig, tokens: torch.Tensor) -> torch.Tensor:
    """Every position's logits [B, L, vocab], each row one sequence prefilled in one span."""
    b, bs = tokens.shape[0], 4
    pages = m.max_seq_len // bs
    kv = KVCache.for_model(m, b * pages, bs, m.max_seq_len, torch.float32, CPU, b)
    spans = [Span(list(range(i * pages, (i + 1) * pages)), 0, tokens[i].tolist(), i) for i in range(b)]
    with torch.inference_mode():
        batch = ForwardBatch.build(spans, CPU, m.max_seq_len, bs)
        batch.state = StateMeta.build(spans, CPU)
        return model.logits(model(batch, kv)).view(*tokens.shape, -1)  # type: ignore[operator]


def test_fp8_layout_nemotron(published: tuple[ModelConfig, Path]) -> None:
    m, d = published
    ref, eng = engine(d, m, "none"), engine(d, m, "fp8")
    fp8 = {n for n, mod in eng.model.named_modules() if isinstance(mod, Fp8Linear)}
    layers = eng.model.backbone.layers
    want = set()
    for i, kind in enumerate(m.hybrid_pattern):
        parts = {
            "M": ["in_proj", "out_proj"],
            "*": ["q_proj", "k_proj", "v_proj", "o_proj"],
            "-": ["up_proj", "down_proj"],
            "E": ["shared_experts.up_proj", "shared_experts.down_proj"],
        }[kind]
        want |= {f"backbone.layers.{i}.mixer.{p}" for p in parts}
    assert fp8 == want
    experts = [i for i, k in enumerate(m.hybrid_pattern) if k == "E"]
    assert all(isinstance(layers[i].mixer.experts, Fp8Relu2Experts) for i in experts)
    # High precision: embeddings, head, routers, the Mamba-2 convolution and its parameters.
    assert type(eng.model.lm_head) is nn.Linear and type(eng.model.backbone.embeddings) is nn.Embedding
    mamba = layers[0].mixer
    assert type(mamba.conv1d) is nn.Conv1d and mamba.A_log.dtype == torch.float32
    assert all(type(layers[i].mixer.gate.weight) is nn.Parameter for i in experts)
    # The fp8 bits are the 128x128 quantisation of the unquantised engine's weights.
    for ours, theirs in (
        (layers[0].mixer.in_proj, ref.model.backbone.layers[0].mixer.in_proj.weight),
        (layers[1].mixer.q_proj, ref.model.backbone.layers[1].mixer.q_proj.weight),
    ):
        q, s = quantize_weight(theirs)
        assert torch.equal(ours.weight_fp8.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(ours.weight_scale, s)
    e = experts[0]
    for name, src in (("up", "up_proj"), ("down", "down_proj")):
        for x in range(m.n_routed_experts):
            q, s = quantize_weight(getattr(ref.model.backbone.layers[e].mixer.experts, src)[x])
            assert torch.equal(
                getattr(layers[e].mixer.experts, f"{name}_fp8")[x].view(torch.uint8), q.view(torch.uint8)
            )
            assert torch.equal(getattr(layers[e].mixer.experts, f"{name}_scale")[x], s)


def test_fp8_logits_close_to_unquantised_nemotron(published: tuple[ModelConfig, Path]) -> None:
    m, d = published
    ref, eng = engine(d, m, "none"), engine(d, m, "fp8")
    tokens = torch.randint(0, m.vocab_size, (3, 40), generator=torch.Generator().manual_seed(7))
    lr, lf = logits(ref.model, m, tokens).double(), logits(eng.model, m, tokens).double()
    rel = ((lf - lr).norm() / lr.norm()).item()
    lp_r, lp_f = lr.log_softmax(-1), lf.log_softmax(-1)
    kl = (lp_r.exp() * (lp_r - lp_f)).sum(-1).mean().item()
    top1 = (lr.argmax(-1) == lf.argmax(-1)).float().mean().item()
    print(f"fp8 nemotron vs fp32: logits rel err {rel:.3e}, KL {kl:.3e}, top-1 agreement {top1:.3f}")
    assert 0 < rel < 0.1 and 0 < kl < 2e-3 and top1 > 0.8

    # Through the scheduler (chunked prefill, decode steps over the state cache): greedy tokens run
    # and the first agrees; a weight update re-quantises in place.
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    req = [GenerateRequest(input_ids=[5, 9, 14, 20, 3, 7, 11], sampling=greedy)]
    out_f, out_r = eng.generate(req)[0].choices[0], ref.generate(req)[0].choices[0]
    assert len(out_f.output_ids) == 6 and out_f.output_ids[0] == out_r.output_ids[0]
    out_proj = eng.model.backbone.layers[0].mixer.out_proj
    buf, scale = out_proj.weight_fp8, out_proj.weight_scale.clone()
    ckpt = read_checkpoint(d)
    ckpt.state = {k: v * 2 if k.endswith("mixer.out_proj.weight") else v for k, v in ckpt.state.items()}
    eng.runner.load_state(ckpt)
    # In place (captured graphs keep their addresses); twice the weight: the same bits, twice the scales.
    assert out_proj.weight_fp8.data_ptr() == buf.data_ptr()
    assert torch.equal(out_proj.weight_scale, 2 * scale)


def test_fp8_relu2_experts_nemotron(published: tuple[ModelConfig, Path]) -> None:
    """The squared-ReLU experts in fp8 compute, per (token, expert), down(q(relu(up(q(x)))^2)) on
    the 128x128-dequantised weights with 1x128-quantised inputs (q: the activation quantiser),
    and stay within E4M3's error of the unquantised experts."""
    from ops.fp8.recipe import dequantize_act, dequantize_weight, quantize_act

    m, d = published
    ref, eng = engine(d, m, "none"), engine(d, m, "fp8")
    e = m.hybrid_pattern.index("E")
    src, ex = ref.model.backbone.layers[e].mixer.experts, eng.model.backbone.layers[e].mixer.experts
    g = torch.Generator().manual_seed(21)
    x = torch.randn(9, m.dim, generator=g)
    ids = torch.randint(0, m.n_routed_experts, (9, 2), generator=g)
    wts = torch.rand(9, 2, generator=g)
    with torch.no_grad():
        out = ex(x, ids, wts)
        want = torch.zeros_like(x)
        for t in range(9):
            for j in range(2):
                k = int(ids[t, j])
                up = dequantize_weight(*quantize_weight(src.up_proj[k]))
                down = dequantize_weight(*quantize_weight(src.down_proj[k]))
                h = torch.relu(dequantize_act(*quantize_act(x[t : t + 1])) @ up.T) ** 2
                want[t] += wts[t, j] * (dequantize_act(*quantize_act(h)) @ down.T)[0]
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
        plain = src(x, ids, wts)
        # E4M3's ~3.7% per GEMM (tests/test_fp8_linear.py bounds a SwiGLU expert by 0.06); the
        # square doubles the relative error of up's output (measured 6.7e-2 here).
        assert ((out - plain).norm() / plain.norm()).item() < 0.1


def test_fp8_checkpoint_bits_nemotron(published: tuple[ModelConfig, Path], tmp_path: Path) -> None:
    """An FP8 checkpoint of Nemotron-H (E4M3 + 128x128 pow2 scales for every linear the engine
    holds in FP8, the experts per expert, as the trainer publishes for an FP8 engine): the FP8
    engine holds its bits and scales as they are (a re-quantisation gives other scales), and an
    unquantised engine loads the dequantised weights."""
    from helpers.fp8_dirs import fp8_model_dir

    m, d = published
    fp8_dir, state = fp8_model_dir(d, m, tmp_path / "fp8")
    eng = engine(fp8_dir, m, "fp8")
    linears = {n: mod for n, mod in eng.model.named_modules() if isinstance(mod, Fp8Linear)}
    assert "backbone.layers.0.mixer.in_proj" in linears
    for n, mod in linears.items():
        assert torch.equal(mod.weight_fp8.view(torch.uint8), state[f"{n}.weight"].view(torch.uint8)), n
        assert torch.equal(mod.weight_scale, state[f"{n}.weight_scale_inv"]), n
    experts = {n: mod for n, mod in eng.model.named_modules() if isinstance(mod, Fp8Relu2Experts)}
    assert len(experts) == m.hybrid_pattern.count("E")
    for n, mod in experts.items():
        for e in range(m.n_routed_experts):
            for buf, proj in (("up", "up_proj"), ("down", "down_proj")):
                key = f"{n}.{e}.{proj}.weight"
                assert torch.equal(
                    getattr(mod, f"{buf}_fp8")[e].view(torch.uint8), state[key].view(torch.uint8)
                )
                assert torch.equal(getattr(mod, f"{buf}_scale")[e], state[f"{key}_scale_inv"])
    requantised = engine(d, m, "fp8").model.backbone.layers[0].mixer.in_proj.weight_scale
    assert not torch.equal(requantised, linears["backbone.layers.0.mixer.in_proj"].weight_scale)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    req = [GenerateRequest(input_ids=[5, 9, 14, 20], sampling=greedy)]
    assert len(eng.generate(req)[0].choices[0].output_ids) == 4
    assert len(engine(fp8_dir, m, "none").generate(req)[0].choices[0].output_ids) == 4
