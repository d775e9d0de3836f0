"""FP8 in the engine and the trainer: dispatch, Triton kernels under the interpreter, the
engine with quantization="fp8", the trainer's FP8 linear/converter and the train/infer mismatch.
All on CPU (reference path; Triton kernels through TRITON_INTERPRET=1 in a subprocess)."""

from __future__ import annotations

import copy
import os
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import triton_interp
from helpers.engine_forward import engine_logits
from pydantic import ValidationError
from torch import nn

from ops.fp8.dispatch import fp8_gemm_dispatch, fp8_matmul, grouped_fp8_gemm_dispatch, resolve_backend
from ops.fp8.recipe import (
    Fp8Linear as RefFp8Linear,
)
from ops.fp8.recipe import (
    convert_to_fp8,
    dequantize_act,
    dequantize_weight,
    fp8_gemm_reference,
    group_offsets,
    grouped_fp8_gemm,
    quantize_act,
    quantize_weight,
)
from services.common.config import EngineConfig, ModelConfig, TrainerSection
from services.common.weights_dir import read_model_dir
from services.engine import LLMEngine
from services.engine.layers.fp8 import Fp8Experts, Fp8Linear, convert_model, engine_skip
from services.engine.models.causal_lm import CausalLM
from trainer.fp8 import CONVERTER_NAME, Fp8BlockwiseConverter, Fp8TrainLinear, convert, fp8_linear
from trainer.model import build_model, save_weights_dir

REPO = Path(__file__).resolve().parents[1]
# Small Qwen3 shape with full 128-blocks (dim 256) and a ragged FFN (384 = 3 blocks, K ragged: no).
M_CFG = ModelConfig(
    vocab_size=512,
    dim=256,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=64,
    hidden_dim=384,
    max_seq_len=64,
    tie_embeddings=False,
)
ENGINE_LINEARS = [
    f"model.layers.{i}.{p}"
    for i in range(2)
    for p in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
]
TRAINER_LINEARS = [
    f"layers.{i}.{p}"
    for i in range(2)
    for p in ("attention.wq", "attention.wk", "attention.wv", "attention.wo")
    + ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def mean_kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over positions of KL(ref || other) of the next-token distributions."""
    lp_ref, lp = torch.log_softmax(ref_logits.double(), -1), torch.log_softmax(logits.double(), -1)
    return (lp_ref.exp() * (lp_ref - lp)).sum(-1).mean().item()


def trainer_state(seed: int) -> dict[str, torch.Tensor]:
    """torchtitan init with a larger output head, so next-token distributions are spread out and
    a KL between two models is a meaningful number (the default head makes logits ~0)."""
    model = build_model(M_CFG, seed=seed)
    with torch.no_grad():
        model.output.weight.normal_(0, 0.5, generator=gen(seed + 100))
    return model.state_dict()


@pytest.fixture(scope="module")
def weight_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fp8")
    return (
        save_weights_dir(M_CFG, trainer_state(0), root / "step_0", {"version": 0}),
        save_weights_dir(M_CFG, trainer_state(1), root / "step_1", {"version": 1}),
    )


def engine_cfg(quantization: str) -> EngineConfig:
    return EngineConfig(device="cpu", max_batch_size=4, max_seq_len=64, quantization=quantization)  # type: ignore[arg-type]


# ------------------------------------------------------------------ dispatch and CPU GEMM


def test_resolve_backend_by_device_and_m() -> None:
    cpu = torch.device("cpu")
    assert resolve_backend("auto", 64, cpu) == "reference"
    assert resolve_backend("reference", 64, torch.device("cuda")) == "reference"
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(RuntimeError, match="needs CUDA"):
            resolve_backend("triton", 64, cpu)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        resolve_backend("torch", 64, cpu)
    with pytest.raises(ValueError, match="unknown fp8 backend"):
        resolve_backend("cutlass", 64, cpu)


@pytest.mark.parametrize("shape", [(7, 256, 384), (33, 200, 300)], ids=["aligned", "ragged"])
def test_fp8_matmul_equals_dequantised_matmul(shape: tuple[int, int, int]) -> None:
    m, n, k = shape
    x = torch.randn(m, k, generator=gen(1))
    w = torch.randn(n, k, generator=gen(2))
    wq, ws = quantize_weight(w)
    out = fp8_matmul(x.view(1, m, k), wq, ws, torch.float32)
    assert out.shape == (1, m, n)
    xq, xs = quantize_act(x)
    want = (dequantize_act(xq, xs).double() @ dequantize_weight(wq, ws).double().T).float()
    torch.testing.assert_close(out[0], want, rtol=1e-5, atol=1e-4)
    assert rel_err(out[0], x @ w.T) < 0.06  # the E4M3 error itself (docs/fp8.md: ~3.7e-2)


def test_grouped_dispatch_cpu_equals_per_expert_reference() -> None:
    sizes = [5, 0, 17, 9]
    t, n, k = sum(sizes), 160, 300
    x = torch.randn(t, k, generator=gen(3))
    w = torch.randn(len(sizes), n, k, generator=gen(4))
    xq, xs = quantize_act(x)
    qs = [quantize_weight(w[e]) for e in range(len(sizes))]
    wq, ws = torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])
    offs = group_offsets(sizes)
    out = grouped_fp8_gemm_dispatch(xq, xs, wq, ws, offs, torch.float32)
    rows = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    want = torch.stack(
        [dequantize_act(xq, xs)[i] @ dequantize_weight(*qs[int(e)]).T for i, e in enumerate(rows)]
    )
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(
        out, grouped_fp8_gemm(xq, xs, wq, ws, offs, torch.float32, backend="reference")
    )


# ------------------------------------------------------------------ Triton kernels (interpreter)

TRITON_CHECK = textwrap.dedent(
    """
    import json, torch
    from ops.fp8.recipe import quantize_act, quantize_weight, fp8_gemm_reference, grouped_fp8_gemm
    from ops.fp8.triton_gemm import (
        GemmConfig, pick_config, triton_fp8_gemm, triton_grouped_fp8_gemm, triton_quantize_act)
    g = torch.Generator().manual_seed(0)
    res = {"dense": [], "grouped": None, "quant": None}
    cases = [((5, 200, 300), None), ((64, 256, 512), None), ((70, 130, 260), GemmConfig(16, 64, 2, 1, 4, 2)),
             ((40, 256, 640), GemmConfig(32, 128, 3, 8, 4, 2)), ((300, 256, 256), None)]
    for (m, n, k), cfg in cases:
        x, w = torch.randn(m, k, generator=g) * 3, torch.randn(n, k, generator=g)
        aq, as_ = quantize_act(x); wq, ws = quantize_weight(w)
        ref = fp8_gemm_reference(aq, as_, wq, ws)
        out = triton_fp8_gemm(aq, as_, wq, ws, torch.float32, cfg)
        used = cfg or pick_config(m, n, k)
        res["dense"].append({"shape": [m, n, k], "split_k": used.split_k,
                             "err": ((out - ref).abs().max() / ref.abs().max()).item()})
    sizes = [10, 0, 25, 3]; t, n, k = sum(sizes), 160, 300
    x, w = torch.randn(t, k, generator=g), torch.randn(len(sizes), n, k, generator=g)
    aq, as_ = quantize_act(x); qs = [quantize_weight(w[e]) for e in range(len(sizes))]
    wq = torch.stack([q for q, _ in qs]); ws = torch.stack([s for _, s in qs])
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    ref = grouped_fp8_gemm(aq, as_, wq, ws, offs, torch.float32, backend="reference")
    res["grouped"] = max(((triton_grouped_fp8_gemm(aq, as_, wq, ws, offs, torch.float32, block_m=bm) - ref).abs().max()
                          / ref.abs().max()).item() for bm in (16, 32))
    x = torch.randn(37, 300, generator=g) * torch.exp(2 * torch.randn(37, 300, generator=g))
    out = {}
    for pow2 in (False, True):
        q, s = triton_quantize_act(x, pow2); rq, rs = quantize_act(x, pow2)
        diff = q.float() != rq.float()
        out[str(pow2)] = {"scales_equal": bool(torch.equal(s, rs)), "mismatch": diff.float().mean().item(),
                          "mismatch_only_lost_roundups": bool(
                              ((q.float()[diff].abs() < rq.float()[diff].abs())
                               & (q.float()[diff] * rq.float()[diff] >= 0)).all()),
                          "scale_strides": list(s.stride())}
    res["quant"] = out
    print(json.dumps(res))
    """
)


@pytest.mark.slow  # ~10-30 s: the Triton interpreter runs every program in Python
def test_triton_kernels_under_interpreter_match_reference() -> None:
    res = triton_interp.run_script_interpreted(TRITON_CHECK, timeout_s=300)
    # Same fp32 block products and scales; only the summation order differs (split-K, dot order).
    for case in res["dense"]:
        assert case["err"] < 1e-5, case
    assert any(c["split_k"] > 1 for c in res["dense"])  # the split-K reduction path ran
    assert res["grouped"] < 1e-5
    for pow2, q in res["quant"].items():
        assert q["scales_equal"], (pow2, q)  # div_rn: the same IEEE scale as torch
        assert q["scale_strides"] == [1, 37]  # column-major, as torch's block-wise scaled_mm wants
        # The interpreter's fp32->e4m3 cast sometimes loses a round-up (module docstring): every
        # mismatch must be that defect (smaller magnitude, same sign), and they must be rare.
        assert q["mismatch"] < 0.05 and q["mismatch_only_lost_roundups"], (pow2, q)


# ------------------------------------------------------------------ engine


def test_engine_config_quantization_field() -> None:
    assert EngineConfig().quantization == "none"
    with pytest.raises(ValidationError, match="quantization"):
        EngineConfig(quantization="int4")  # type: ignore[arg-type]


def test_engine_fp8_logits_close_to_fp32(weight_dirs: tuple[Path, Path]) -> None:
    ref = LLMEngine(weight_dirs[0], engine_cfg("none"))
    eng = LLMEngine(weight_dirs[0], engine_cfg("fp8"))
    names = [n for n, mod in eng.model.named_modules() if isinstance(mod, Fp8Linear)]
    assert names == ENGINE_LINEARS
    assert type(eng.model.lm_head) is nn.Linear and type(eng.model.model.embed_tokens) is nn.Embedding
    # The fp8 weights are exactly the 128x128 quantisation of the checkpoint's.
    q_proj = eng.model.model.layers[1].self_attn.q_proj
    wq, ws = quantize_weight(ref.model.model.layers[1].self_attn.q_proj.weight)
    assert torch.equal(q_proj.weight_fp8.view(torch.uint8), wq.view(torch.uint8))
    assert torch.equal(q_proj.weight_scale, ws)

    tokens = torch.randint(0, M_CFG.vocab_size, (3, 48), generator=gen(7))
    lr, lf = engine_logits(ref.model, M_CFG, tokens), engine_logits(eng.model, M_CFG, tokens)
    rel, kl = rel_err(lf, lr), mean_kl(lr, lf)
    top1 = (lr.argmax(-1) == lf.argmax(-1)).float().mean().item()
    print(f"fp8 engine vs fp32: logits rel err {rel:.3e}, KL {kl:.3e}, top-1 agreement {top1:.3f}")
    assert 0 < rel < 0.05 and 0 < kl < 2e-3 and top1 > 0.9

    # End to end through the scheduler/sampler: greedy decoding runs and mostly agrees.
    from services.common.schemas import GenerateRequest, SamplingParams

    reqs = [GenerateRequest(input_ids=[5, 6, 7, 8], sampling=SamplingParams(temperature=0.0, max_tokens=6))]
    out_f, out_r = eng.generate(reqs)[0], ref.generate(copy.deepcopy(reqs))[0]
    assert len(out_f.choices[0].output_ids) == 6
    assert out_f.choices[0].output_ids[0] == out_r.choices[0].output_ids[0]


def test_engine_fp8_weight_update_requantises(weight_dirs: tuple[Path, Path]) -> None:
    eng = LLMEngine(weight_dirs[0], engine_cfg("fp8"))
    buf = eng.model.model.layers[0].mlp.down_proj.weight_fp8
    eng.load_weights(weight_dirs[1], 1)
    assert eng.model.model.layers[0].mlp.down_proj.weight_fp8 is buf  # in place (CUDA graphs keep it)
    fresh = LLMEngine(weight_dirs[1], engine_cfg("fp8"))
    for (name, a), (_, b) in zip(
        eng.model.state_dict().items(), fresh.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), name  # fmt: skip
    tokens = torch.randint(0, M_CFG.vocab_size, (2, 32), generator=gen(8))
    assert torch.equal(engine_logits(eng.model, M_CFG, tokens), engine_logits(fresh.model, M_CFG, tokens))
    # A bad update names the tensor and leaves the loaded weights alone.
    before = buf.clone()
    state = dict(eng.read_weights(weight_dirs[0]).state)
    state["model.layers.0.mlp.down_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="down_proj.weight"):
        from services.engine.layers.fp8 import load_hf_state

        load_hf_state(eng.model, state)
    assert torch.equal(buf.view(torch.uint8), before.view(torch.uint8))


def test_engine_fp8_fused_projections_equal_separate(weight_dirs: tuple[Path, Path]) -> None:
    """The GPU path's fused q/k/v and gate/up GEMMs (model.fuse_projections) in FP8: one
    quantisation + GEMM gives exactly the separate linears' outputs, the parts' buffers are views
    of the fused ones, and a weight update reaches the fused GEMM."""
    eng = LLMEngine(weight_dirs[0], engine_cfg("fp8"))
    attn, mlp = eng.model.model.layers[1].self_attn, eng.model.model.layers[1].mlp
    x = torch.randn(5, M_CFG.dim, generator=gen(11))
    separate = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
    separate_mlp = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
    assert len(eng.model.fuse_projections()) == 2 * M_CFG.n_layers
    assert attn.qkv is not None and attn.qkv.fp8 is not None and mlp.gate_up is not None
    assert attn.k_proj.weight_fp8.data_ptr() == attn.qkv.weight[attn.q_proj.out_features].data_ptr()
    assert (
        attn.k_proj.weight_scale.data_ptr()
        == attn.qkv.fp8.weight_scale[attn.q_proj.out_features // 128].data_ptr()
    )
    assert torch.equal(attn.qkv(x), separate)
    assert torch.equal(mlp.gate_up(x), separate_mlp)
    # Weight loads still see only the HF names, and reach the fused buffers.
    assert {n for n, _ in eng.model.named_modules() if isinstance(_, Fp8Linear)} == set(ENGINE_LINEARS)
    eng.load_weights(weight_dirs[1], 1)
    fresh = LLMEngine(weight_dirs[1], engine_cfg("fp8")).model.model.layers[1].self_attn
    expect = torch.cat([fresh.q_proj(x), fresh.k_proj(x), fresh.v_proj(x)], dim=-1)
    assert not torch.equal(expect, separate)
    assert torch.equal(attn.qkv(x), expect)


def test_fp8_rows_that_straddle_a_scale_block_are_not_fused() -> None:
    from services.engine.layers.fp8 import fuse_fp8_rows

    torch.manual_seed(0)
    parts = [Fp8Linear.from_linear(nn.Linear(256, n, bias=False)) for n in (192, 128)]
    before = [p.weight_fp8 for p in parts]
    assert fuse_fp8_rows(parts) is None  # 192 rows: the second scale block holds both parts
    assert all(p.weight_fp8 is b for p, b in zip(parts, before, strict=True))
    # The last part may be ragged: its trailing block is its own.
    assert (
        fuse_fp8_rows([Fp8Linear.from_linear(nn.Linear(256, n, bias=False)) for n in (128, 192)]) is not None
    )


# ------------------------------------------------------------------ trainer


def test_trainer_fp8_linear_matches_engine_bitwise_and_grads_flow() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(384, 200, bias=True)
    eng = Fp8Linear.from_linear(lin)
    tr = copy.deepcopy(lin)
    convert(nn.Sequential(tr))  # re-classes in place
    assert isinstance(tr, Fp8TrainLinear) and tr.weight.dtype == torch.float32
    x = torch.randn(2, 9, 384, generator=gen(9), requires_grad=True)
    out = tr(x)
    with torch.no_grad():
        assert torch.equal(out, eng(x))  # same recipe, same kernels: the same bits
    g = torch.randn(out.shape, generator=gen(10))
    out.backward(g)
    g2, x2 = g.reshape(-1, 200), x.detach().reshape(-1, 384)
    xq, xs = quantize_act(x2)
    wq, ws = quantize_weight(lin.weight.detach())
    torch.testing.assert_close(tr.weight.grad, g2.T @ dequantize_act(xq, xs))  # STE through q(x)
    torch.testing.assert_close(x.grad.reshape(-1, 384), g2 @ dequantize_weight(wq, ws))
    torch.testing.assert_close(tr.bias.grad, g2.sum(0))
    # The master weight is what the optimizer updates; the next forward re-quantises it.
    opt = torch.optim.SGD(tr.parameters(), lr=0.1)
    opt.step()
    assert not torch.equal(tr.weight, lin.weight)
    eng.load_weight(tr.weight.detach(), tr.bias.detach())
    with torch.no_grad():
        assert torch.equal(tr(x), eng(x))


def test_trainer_fp8_dgrad_uses_block_scaled_gemm() -> None:
    w = torch.randn(256, 384, generator=gen(11), requires_grad=True)
    x = torch.randn(40, 384, generator=gen(12), requires_grad=True)
    out = fp8_linear(x, w, fp8_dgrad=True)
    g = torch.randn(out.shape, generator=gen(13))
    out.backward(g)
    gq, gs = quantize_act(g)
    wq, ws = quantize_weight(w.detach())
    want = fp8_gemm_reference(gq, gs, wq.t().contiguous(), ws.t().contiguous())
    assert torch.equal(x.grad, want)
    assert rel_err(x.grad, g @ w.detach()) < 0.06


def test_trainer_converter_min_weights_keeps_small_linears_high_precision() -> None:
    model = build_model(M_CFG, seed=0)
    sizes = {n: model.get_submodule(n).weight.numel() for n in TRAINER_LINEARS}
    threshold = sorted(set(sizes.values()))[1]  # above the smallest linears, equal to some
    conv = Fp8BlockwiseConverter(min_weights=threshold)
    conv.convert(model)
    want = [n for n in TRAINER_LINEARS if sizes[n] >= threshold]
    assert 0 < len(want) < len(TRAINER_LINEARS) and any(sizes[n] == threshold for n in want)
    assert conv.converted == want
    for n in TRAINER_LINEARS:
        assert (type(model.get_submodule(n)) is Fp8TrainLinear) == (n in want), n
    tokens = torch.randint(0, M_CFG.vocab_size, (2, 24), generator=gen(15))
    model(tokens).float().sum().backward()  # mixed FP8 and high-precision linears train together
    assert all(p.grad is not None for p in model.parameters())


def test_trainer_fp8_min_weights_rejects_negative() -> None:
    with pytest.raises(ValidationError, match="fp8_min_weights"):
        TrainerSection(fp8_min_weights=-1)


def test_trainer_converter_keeps_params_and_trains() -> None:
    from torchtitan.protocols.model_converter import _registry_model_converter_cls

    assert _registry_model_converter_cls[CONVERTER_NAME] is Fp8BlockwiseConverter
    model = build_model(M_CFG, seed=0)
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    conv = Fp8BlockwiseConverter()
    conv.convert(model)
    assert conv.converted == TRAINER_LINEARS
    assert type(model.output) is nn.Linear  # the head stays high precision
    assert list(model.state_dict()) == list(keys)  # same names: checkpoints/HF export unchanged
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights
    tokens = torch.randint(0, M_CFG.vocab_size, (2, 24), generator=gen(14))
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, M_CFG.vocab_size), tokens[:, 1:].reshape(-1)
    )
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    wq = model.layers["0"].attention.wq.weight
    assert not torch.equal(wq, keys["layers.0.attention.wq.weight"])


def test_trainer_section_fp8_field() -> None:
    assert TrainerSection().fp8 is False
    assert TrainerSection(fp8=True).fp8 is True
    assert TrainerSection().fp8_backward is True  # dgrad and wgrad in FP8 too (trainer/fp8.py)
    with pytest.raises(ValidationError, match="trainer.fp8"):
        TrainerSection(fp8=True, nproc=2, tp=2, device="cuda")
    assert TrainerSection(fp8=True, compile=True).compile  # the FP8 linears are custom ops


def test_mismatch_kl_fp8_trainer_below_bf16_trainer(weight_dirs: tuple[Path, Path]) -> None:
    """An FP8 engine samples; the trainer scores. (a) a high-precision trainer, (b) the FP8 trainer
    with the same recipe: (b)'s mismatch KL must be far below (a)'s (bench/fp8/mismatch.py does
    this on GPU in bf16 for a Qwen3 shape)."""
    eng = LLMEngine(weight_dirs[0], engine_cfg("fp8"))
    model_hp = build_model(M_CFG)
    model_hp.load_state_dict(trainer_state(0))
    model_f8 = copy.deepcopy(model_hp)
    convert(model_f8)
    tokens = torch.randint(0, M_CFG.vocab_size, (3, 48), generator=gen(15))
    le = engine_logits(eng.model, M_CFG, tokens)
    with torch.no_grad():
        kl_a = mean_kl(le, model_hp(tokens))
        kl_b = mean_kl(le, model_f8(tokens))
    print(f"mismatch KL(engine fp8 || trainer): (a) fp32 trainer {kl_a:.3e}, (b) fp8 trainer {kl_b:.3e}")
    assert kl_a > 1e-6  # the quantisation is visible...
    assert kl_b < kl_a / 20  # ...and training through the same recipe removes nearly all of it


def test_reference_fp8_linear_untouched_by_subclass() -> None:
    """convert_model builds the engine subclass; the common module keeps its own class."""
    model = nn.Sequential(nn.Linear(256, 128), nn.Linear(128, 256))
    assert convert_model(model) == ["0", "1"]
    assert all(type(m) is Fp8Linear and isinstance(m, RefFp8Linear) for m in model)
    x = torch.randn(5, 256, generator=gen(16))
    xq, xs = quantize_act(x)
    torch.testing.assert_close(
        model[0](x),
        fp8_gemm_dispatch(xq, xs, model[0].weight_fp8, model[0].weight_scale, torch.float32) + model[0].bias,
    )


# ------------------------------------------------------------------ engine MoE experts (grouped)

MOE_CFG = ModelConfig(
    arch="qwen3_moe",
    vocab_size=512,
    dim=256,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=64,
    hidden_dim=384,
    max_seq_len=64,
    tie_embeddings=False,
    n_routed_experts=4,
    n_experts_per_tok=2,
    moe_hidden_dim=192,  # gate_up has 384 rows: a 128-row weight tile spans gate and up rows
    first_k_dense=1,
)


def random_moe_engine_model(seed: int) -> CausalLM:
    model = CausalLM(MOE_CFG, 64).eval()
    g = gen(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                # torchtitan's init std (0.02); a wider head so next-token distributions spread out.
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if name == "lm_head.weight" else 0.02))
    return model


def per_expert_state(model: CausalLM) -> dict[str, torch.Tensor]:
    """The model's parameters under HF per-expert names (what save_pretrained writes)."""
    state: dict[str, torch.Tensor] = {}
    i = MOE_CFG.moe_hidden_dim
    for name, p in model.named_parameters():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj":
            for e in range(MOE_CFG.n_routed_experts):
                state[f"{prefix}.{e}.gate_proj.weight"] = p[e, :i].detach().clone()
                state[f"{prefix}.{e}.up_proj.weight"] = p[e, i:].detach().clone()
        elif leaf == "down_proj" and prefix.endswith("experts"):
            for e in range(MOE_CFG.n_routed_experts):
                state[f"{prefix}.{e}.down_proj.weight"] = p[e].detach().clone()
        else:
            state[name] = p.detach().clone()
    return state


def test_engine_fp8_moe_experts_grouped_reference() -> None:
    from services.engine.layers.moe import ExpertWeights, Router

    ref_model = random_moe_engine_model(20)
    fp8_model = copy.deepcopy(ref_model)
    names = convert_model(fp8_model)
    assert "model.layers.1.mlp.experts" in names and "model.layers.0.mlp.gate_proj" in names
    assert isinstance(fp8_model.model.layers[1].mlp.experts, Fp8Experts)
    assert isinstance(fp8_model.model.layers[1].mlp.gate, Router)  # the router stays float32
    assert not any(isinstance(m, ExpertWeights) for m in fp8_model.modules())

    # The experts compute exactly: sum_k w_k * deq(q(silu(deq(q(x)) Wgu^T) * ...)) Wd^T per expert.
    ex = fp8_model.model.layers[1].mlp.experts
    src = ref_model.model.layers[1].mlp.experts
    x = torch.randn(9, MOE_CFG.dim, generator=gen(21))
    ids = torch.randint(0, 4, (9, 2), generator=gen(22))
    wts = torch.rand(9, 2, generator=gen(23))
    with torch.no_grad():
        out = ex(x, ids, wts)
        want = torch.zeros_like(x)
        for t in range(9):
            for j in range(2):
                e = int(ids[t, j])
                wgu = dequantize_weight(*quantize_weight(src.gate_up_proj[e]))
                wd = dequantize_weight(*quantize_weight(src.down_proj[e]))
                h = dequantize_act(*quantize_act(x[t : t + 1])) @ wgu.T
                gate, up = h.chunk(2, dim=-1)
                a = dequantize_act(*quantize_act(torch.nn.functional.silu(gate) * up))
                want[t] += wts[t, j] * (a @ wd.T)[0]
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
        assert rel_err(out, src(x, ids, wts)) < 0.06

    # Whole decoder: with these random weights every layer's output is as large as the residual,
    # so the ~3.7% E4M3 error of each linear compounds (measured: rel 8.4e-2 with everything fp8).
    # The grouped fp8 experts must add little on top of the fp8 attention/dense linears alone.
    tokens = torch.randint(0, MOE_CFG.vocab_size, (2, 40), generator=gen(24))
    lr, lf = engine_logits(ref_model, MOE_CFG, tokens), engine_logits(fp8_model, MOE_CFG, tokens)
    linears_only = copy.deepcopy(ref_model)
    convert_to_fp8(linears_only, skip=engine_skip, linear_cls=Fp8Linear)
    ll = engine_logits(linears_only, MOE_CFG, tokens)
    rel, kl, rel_lin = rel_err(lf, lr), mean_kl(lr, lf), rel_err(ll, lr)
    top1 = (lr.argmax(-1) == lf.argmax(-1)).float().mean().item()
    print(
        f"fp8 MoE decoder vs fp32: logits rel err {rel:.3e} (linears only {rel_lin:.3e}), KL {kl:.3e}, top-1 {top1:.3f}"
    )
    assert 0 < rel < 0.1 and rel < 1.25 * rel_lin and top1 > 0.8

    # Weight update from per-expert HF names (what the trainer writes) and from fused names: the
    # same fp8 bits as converting the model that holds those weights.
    from services.engine.layers.fp8 import load_hf_state

    other = random_moe_engine_model(25)
    want_model = copy.deepcopy(other)
    convert_model(want_model)
    for state in (per_expert_state(other), {k: v.detach() for k, v in other.named_parameters()}):
        target = copy.deepcopy(fp8_model)
        load_hf_state(target, state)
        for (name, a), (_, b) in zip(
            target.state_dict().items(), want_model.state_dict().items(), strict=True
        ):
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), name  # fmt: skip
    bad = per_expert_state(other)
    del bad["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(ValueError, match="per-expert tensors incomplete"):
        load_hf_state(copy.deepcopy(fp8_model), bad)


def test_trainer_fp8_experts_equal_engine_fp8_experts_and_grads_are_ste() -> None:
    """The trainer's FP8 routed experts compute the engine's Fp8Experts function bit for bit (same
    fused gate/up quantisation, same 1x128 inputs, same grouped GEMMs), and their gradients are the
    high-precision experts' gradients at the dequantised weights (straight-through)."""
    from trainer.fp8 import Fp8RoutedExperts
    from trainer.moe_routing import RoutedExperts

    e_n, dim, inter, t = MOE_CFG.n_routed_experts, MOE_CFG.dim, MOE_CFG.moe_hidden_dim, 37
    experts = RoutedExperts(dim=dim, hidden_dim=inter, num_experts=e_n, use_grouped_mm=False)
    g = gen(30)
    with torch.no_grad():
        for w in (experts.w1, experts.w2, experts.w3):
            w.copy_(torch.randn(w.shape, generator=g) * 0.05)
    wts = [w.detach().clone() for w in (experts.w1, experts.w2, experts.w3)]
    assert convert(nn.ModuleDict({"experts": experts})) == ["experts"]
    assert type(experts) is Fp8RoutedExperts

    x = torch.randn(t, dim, generator=g, requires_grad=True)
    ids = torch.randint(0, e_n, (t,), generator=g)
    order = ids.argsort(stable=True)
    counts = torch.bincount(ids, minlength=e_n)
    out_sorted = experts(x[order], counts)
    out = torch.empty_like(out_sorted).index_copy(0, order, out_sorted)

    engine = Fp8Experts(e_n, inter, dim)
    engine.load_fused("gate_up_proj", torch.cat([wts[0], wts[2]], dim=1))  # gate rows, then up rows
    engine.load_fused("down_proj", wts[1])
    with torch.no_grad():
        want = engine(x.detach(), ids[:, None], torch.ones(t, 1))
    assert torch.equal(out.detach(), want)
    # Two chained FP8 GEMMs (4 quantisations: x, gate/up, the SiLU-mul output, down): about twice
    # one linear's E4M3 error (< 0.06 above).
    assert rel_err(out.detach(), _experts_loop(x.detach(), ids, *wts)) < 0.12

    grad = torch.randn(t, dim, generator=g)
    out.backward(grad)
    # Straight-through: the plain per-expert function at the dequantised weights, by hand.
    gu = dequantize_weight(engine.gate_up_fp8, engine.gate_up_scale)
    deq = [gu[:, :inter], dequantize_weight(engine.down_fp8, engine.down_scale), gu[:, inter:]]
    leaves = [x.detach().clone().requires_grad_()] + [w.clone().requires_grad_() for w in deq]
    _experts_loop(leaves[0], ids, *leaves[1:]).backward(grad)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, leaves[0].grad, rtol=1e-5, atol=1e-6)
    for w, ref in zip((experts.w1, experts.w2, experts.w3), leaves[1:], strict=True):
        assert w.grad is not None and ref.grad is not None
        # Sums over an expert's tokens: the group GEMM and the token loop add in other orders.
        torch.testing.assert_close(w.grad, ref.grad, rtol=1e-4, atol=1e-5)


def test_trainer_fp8_experts_fp8_backward_is_its_formula_without_recompute() -> None:
    """trainer.fp8_backward on MoE experts: the forward is the engine's, and the gradients are the
    straight-through ones of the function the forward computed, from what it saved: both dgrads
    block-scaled FP8 GEMMs (grad quantised 1x128, each expert's weight tiles transposed), the
    SiLU-mul backward on the forward's gate/up, the weight gradients over each expert's tokens
    against the GEMMs' inputs before quantisation. Checked token by token against the references, and near
    the straight-through gradients of the STE path (measured 0.043-0.048 apart: E4M3 rounding of
    grad_out and of the SiLU-mul's input gradient)."""
    from trainer.fp8 import Fp8RoutedExperts
    from trainer.moe_routing import RoutedExperts

    e_n, dim, inter, t = MOE_CFG.n_routed_experts, MOE_CFG.dim, MOE_CFG.moe_hidden_dim, 37
    g = gen(33)
    weights = [
        torch.randn(shape, generator=g) * 0.05
        for shape in ((e_n, inter, dim), (e_n, dim, inter), (e_n, inter, dim))
    ]

    def run(fp8_backward: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        experts = RoutedExperts(dim=dim, hidden_dim=inter, num_experts=e_n, use_grouped_mm=False)
        with torch.no_grad():
            for w, v in zip((experts.w1, experts.w2, experts.w3), weights, strict=True):
                w.copy_(v)
        convert(nn.ModuleDict({"experts": experts}), fp8_dgrad=fp8_backward, fp8_wgrad=fp8_backward)
        assert type(experts) is Fp8RoutedExperts and experts.fp8_backward is fp8_backward
        xl = x0.clone().requires_grad_()
        out = experts(xl[order], counts)
        out.backward(grad[order])
        assert xl.grad is not None
        return out.detach(), xl.grad, [w.grad for w in (experts.w1, experts.w2, experts.w3)]  # type: ignore[misc]

    x0 = torch.randn(t, dim, generator=g)
    ids = torch.randint(0, e_n, (t,), generator=g)
    ids[:3] = 0  # expert 0 has rows, the last expert none
    ids[ids == e_n - 1] = 1
    order = ids.argsort(stable=True)
    counts = torch.bincount(ids, minlength=e_n)
    grad = torch.randn(t, dim, generator=g)
    out_ste, gx_ste, gw_ste = run(False)
    out, gx, gw = run(True)
    assert torch.equal(out, out_ste)  # the forward does not depend on the backward's mode

    # By hand, token by token in sorted order (each token's expert e), with the references.
    xs_sorted, g_sorted, e_sorted = x0[order], grad[order], ids[order]
    gu_w = [torch.cat([weights[0][e], weights[2][e]]) for e in range(e_n)]
    gu_q, gu_s = zip(*(quantize_weight(w) for w in gu_w), strict=True)
    dn_q, dn_s = zip(*(quantize_weight(weights[1][e]) for e in range(e_n)), strict=True)
    xq, xs = quantize_act(xs_sorted)
    gq, gs = quantize_act(g_sorted)
    want_gx = torch.empty(t, dim)
    want_gw = [torch.zeros(e_n, inter, dim), torch.zeros(e_n, dim, inter), torch.zeros(e_n, inter, dim)]
    for i in range(t):
        e, r = int(e_sorted[i]), slice(i, i + 1)
        gu = fp8_gemm_reference(xq[r], xs[r], gu_q[e], gu_s[e])[0]
        gate, up = gu[:inter], gu[inter:]
        a = torch.nn.functional.silu(gate) * up
        da = fp8_gemm_reference(gq[r], gs[r], dn_q[e].t().contiguous(), dn_s[e].t().contiguous())[0]
        sig = torch.sigmoid(gate)
        dgu = torch.cat([da * up * sig * (1 + gate * (1 - sig)), da * gate * sig])[None]
        dq, ds = quantize_act(dgu)
        want_gx[i] = fp8_gemm_reference(dq, ds, gu_q[e].t().contiguous(), gu_s[e].t().contiguous())[0]
        want_gw[1][e] += g_sorted[i][:, None] * a[None, :]
        gw13 = dgu[0][:, None] * xs_sorted[i][None, :]
        want_gw[0][e] += gw13[:inter]
        want_gw[2][e] += gw13[inter:]
    torch.testing.assert_close(gx[order], want_gx, rtol=1e-5, atol=1e-6)
    for got, want in zip(gw, want_gw, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert gw[1][e_n - 1].abs().max() == 0  # an expert without tokens gets no gradient
    # The same gradients up to E4M3 rounding of grad_out and of the SiLU-mul's input gradient.
    assert rel_err(gx, gx_ste) < 0.1
    for got, ste in zip(gw, gw_ste, strict=True):
        assert rel_err(got, ste) < 0.1


SWIGLU_CHECK = textwrap.dedent(
    """
    import json, torch
    from trainer.swiglu_bwd import BLOCK, _swiglu_bwd_kernel, swiglu_backward_reference
    g = torch.Generator().manual_seed(0)
    res = {}
    for t, inter, dtype in ((37, 96, torch.float32), (5, 300, torch.bfloat16)):
        gu = (torch.randn(t, 2 * inter, generator=g) * 3).to(dtype)
        da = torch.randn(t, inter, generator=g).to(dtype)
        out = torch.full((t, 2 * inter), float("nan"), dtype=dtype)
        n = t * inter
        _swiglu_bwd_kernel[((n + BLOCK - 1) // BLOCK,)](gu, da, out, n, inter, BLOCK=BLOCK)
        want = swiglu_backward_reference(gu, da)
        res[str(dtype)] = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()
    print(json.dumps(res))
    """
)


def test_swiglu_backward_kernel_under_interpreter_matches_autograd() -> None:
    """The FP8 experts' SiLU-mul backward: the torch formula equals autograd's gradient of
    silu(gate) * up, and the Triton pass (interpreter, CPU) equals the formula, every element
    written (NaN-filled output first), at a (T, I) not a multiple of its block."""
    from trainer.swiglu_bwd import swiglu_backward_reference

    gu = (torch.randn(9, 2 * 40, generator=gen(41), dtype=torch.float64) * 3).requires_grad_()
    da = torch.randn(9, 40, generator=gen(42), dtype=torch.float64)
    gate, up = gu.chunk(2, dim=-1)
    (torch.nn.functional.silu(gate) * up).backward(da)
    assert gu.grad is not None
    torch.testing.assert_close(
        swiglu_backward_reference(gu.detach(), da), gu.grad, rtol=1e-5, atol=1e-6
    )  # float32 math
    res = triton_interp.run_script_interpreted(SWIGLU_CHECK, timeout_s=120)
    assert res["torch.float32"] < 1e-6, res
    assert res["torch.bfloat16"] < 1e-2, res  # one bf16 rounding of the same float32 math


def _experts_loop(
    x: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """One expert per token (top-1, weight 1): silu(x W1^T) * (x W3^T) W2^T, token by token."""
    rows = []
    for i in range(x.shape[0]):
        e = int(ids[i])
        h = torch.nn.functional.silu(x[i] @ w1[e].T) * (x[i] @ w3[e].T)
        rows.append(h @ w2[e].T)
    return torch.stack(rows)


def test_mismatch_kl_fp8_moe_trainer_below_bf16_trainer(tmp_path: Path) -> None:
    """An FP8 MoE engine (dense linears and grouped experts in FP8) against the trainer: with the
    trainer's experts in FP8 too, the mismatch KL must fall well below a high-precision trainer's
    (before, the trainer's experts stayed high precision and an FP8 MoE engine still mismatched)."""
    model_hp = build_model(MOE_CFG, seed=0)
    with torch.no_grad():
        model_hp.output.weight.normal_(0, 0.5, generator=gen(31))  # spread next-token distributions
    path = save_weights_dir(MOE_CFG, model_hp.state_dict(), tmp_path / "step_0", {"version": 0})
    eng = LLMEngine(path, engine_cfg("fp8"))
    assert any(isinstance(m, Fp8Experts) for m in eng.model.modules())
    model_f8 = copy.deepcopy(model_hp)
    names = convert(model_f8)
    assert sum(n.endswith("moe.experts") for n in names) == MOE_CFG.n_layers - MOE_CFG.first_k_dense
    tokens = torch.randint(0, MOE_CFG.vocab_size, (3, 48), generator=gen(32))
    le = engine_logits(eng.model, MOE_CFG, tokens)
    with torch.no_grad():
        kl_a, kl_b = mean_kl(le, model_hp(tokens)), mean_kl(le, model_f8(tokens))
    print(f"MoE mismatch KL(engine fp8 || trainer): (a) fp32 trainer {kl_a:.3e}, (b) fp8 trainer {kl_b:.3e}")
    assert kl_a > 1e-6
    assert kl_b < kl_a / 20


# ------------------------------------------------------------------ trainer end to end


def test_trainer_run_with_fp8_learns(
    redis_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`trainer.fp8 = true` through the real trainer (Redis, publish, checkpoint): it trains, the
    published weights are the float32 master weights, and the favoured tokens still gain mass."""
    from test_trainer_run import Feeder, favoured_mass, make_cfg

    import trainer.fp8
    from trainer.train import run as run_trainer

    converted: list[list[str]] = []
    backward: list[tuple[object, object]] = []
    min_weights: list[object] = []
    real_convert = trainer.fp8.convert

    def recording_convert(model: nn.Module, *args: object, **kw: object) -> list[str]:
        converted.append(real_convert(model, *args, **kw))  # type: ignore[arg-type]
        mod = model.get_submodule(converted[-1][0])
        backward.append((getattr(mod, "fp8_dgrad", None), getattr(mod, "fp8_wgrad", None)))
        min_weights.append(kw.get("min_weights"))  # the converter passes its options by name
        return converted[-1]

    monkeypatch.setattr(trainer.fp8, "convert", recording_convert)

    run_dir = tmp_path / "run"
    # fp8_min_weights = 1 filters no linear here; it checks the option reaches the converter.
    cfg = make_cfg(run_dir, fp8=True, fp8_min_weights=1)
    feeder = Feeder(cfg, redis_server, run_dir)
    feeder.start()
    try:
        assert run_trainer(cfg, run_dir, redis_server) == 0
    finally:
        feeder.stop.set()
        feeder.join(10)
    assert feeder.error is None
    assert converted and len(converted[0]) == 7 * cfg.model.n_layers  # the fp8 path really ran
    assert backward == [(True, True)]  # trainer.fp8_backward (default): both backward GEMMs in FP8
    assert min_weights == [1]
    n = cfg.run.max_steps
    tensors = read_model_dir(run_dir / "weights" / f"step_{n}")[1]
    assert all(t.dtype == torch.float32 for t in tensors.values())
    before, after = (
        favoured_mass(run_dir / "weights" / "step_0"),
        favoured_mass(run_dir / "weights" / f"step_{n}"),
    )
    print(f"fp8 trainer: favoured mass {before:.3f} -> {after:.3f}")
    assert after > before + 0.1, (before, after)
