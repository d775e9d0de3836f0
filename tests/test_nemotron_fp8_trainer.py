"""trainer.fp8 on Nemotron-H (trainer/fp8.py on trainer/nemotron.py), CPU: the trainer converts the
same tensors to FP8 as an FP8 engine (attention, Mamba-2 in/out projections, MLP and shared-expert
linears, the squared-ReLU routed experts; embeddings, lm_head, norms, routers, conv1d and the SSM
parameters stay high precision), its forward is the engine's FP8 forward (the experts bit for bit,
the model's log-probs to float32 rounding), the experts' backward is straight-through (or, with
fp8_backward, its FP8 formula), experts with no FP8 recipe are an error, and a trainer step with
trainer.fp8 runs."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers.moe import engine_samples, nemotron_model, small_nemotron
from torch import nn

from ops.fp8.recipe import dequantize_weight, fp8_gemm_reference, quantize_act, quantize_weight
from services.common.config import EngineConfig, ModelConfig
from services.engine import LLMEngine
from services.engine.layers.fp8 import Fp8Linear, Fp8Relu2Experts
from trainer.batch import micro_batches
from trainer.fp8 import Fp8Relu2RoutedExperts, Fp8TrainLinear, convert
from trainer.loss import token_logprobs
from trainer.model import adapter, save_weights_dir
from trainer.nemotron import Relu2Experts, relu2
from trainer.replay import micro_batch_routes, routing

TOL = 1e-5  # float32 log-probs, engine vs trainer


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelConfig, nn.Module, Path]:
    m = small_nemotron()
    model = nemotron_model(m, seed=3)
    d = save_weights_dir(m, model.state_dict(), tmp_path_factory.mktemp("w") / "step_0", {"version": 0})
    return m, model, d


def fp8_engine(d: Path, m: ModelConfig) -> LLMEngine:
    cfg = EngineConfig(
        device="cpu", max_batch_size=8, max_seq_len=m.max_seq_len, block_size=4, quantization="fp8"
    )
    return LLMEngine(d, cfg)


def test_trainer_converts_what_the_engine_holds_in_fp8(
    published: tuple[ModelConfig, nn.Module, Path],
) -> None:
    m, model, d = published
    eng = fp8_engine(d, m)
    engine_fp8 = {n for n, mod in eng.model.named_modules() if isinstance(mod, (Fp8Linear, Fp8Relu2Experts))}
    trainer = copy.deepcopy(model)
    names = convert(trainer)
    hf = adapter(m).to_hf_map
    # Each converted trainer module by its HF name (the engine's module names); experts by layer.
    as_hf = {
        f"backbone.layers.{n.split('.')[1]}.mixer.experts"
        if n.endswith("moe.experts")
        else hf[f"{n}.weight"][:-7]
        for n in names
    }
    assert as_hf == engine_fp8
    kinds = {type(trainer.get_submodule(n)) for n in names}
    assert kinds == {Fp8TrainLinear, Fp8Relu2RoutedExperts}
    mamba = trainer.layers["0"].mamba
    assert type(mamba.conv1d) is nn.Conv1d and type(trainer.output) is nn.Linear
    assert type(trainer.layers["2"].moe.router.gate) is nn.Linear
    assert list(trainer.state_dict()) == list(model.state_dict())  # same names: checkpoints unchanged


@pytest.mark.parametrize("replay", [True, False])
def test_fp8_engine_equals_fp8_trainer_nemotron(
    published: tuple[ModelConfig, nn.Module, Path], replay: bool
) -> None:
    """decode.engine.quantization = "fp8" samples (chunked scan for the prompt, recurrent steps
    after it); trainer.fp8 on the same weights scores the samples: the engine's log-probs to 1e-5,
    with its routes replayed or routing on its own (then every top-k set is the engine's)."""
    m, model, d = published
    samples = engine_samples(d, m, quantization="fp8")
    trainer = copy.deepcopy(model)
    convert(trainer)
    (mb,) = micro_batches(samples, 10_000)
    (routes,) = micro_batch_routes(samples, m, False, 10_000)
    with torch.no_grad(), routing(trainer, routes, replay=replay) as rec:
        logp, _ = token_logprobs(trainer, mb.tokens)
    mask = mb.loss_mask > 0
    torch.testing.assert_close(logp[mask], mb.logp_infer[mask], rtol=0, atol=TOL)
    if not replay:
        assert rec.total.sum().item() > 0 and torch.equal(rec.agree, rec.total)
    # The quantisation is visible: the high-precision trainer is further from the engine.
    with torch.no_grad(), routing(model, routes, replay=True):
        hp, _ = token_logprobs(model, mb.tokens)
    off = (hp[mask] - mb.logp_infer[mask]).abs().max().item()
    print(f"FP8 engine vs high-precision trainer: log-probs up to {off:.2e} apart")
    assert off > 100 * TOL


def experts_case(
    seed: int,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights (up [E, I, D], down [E, D, I]), inputs, routed ids (expert 0 busy, the last idle),
    sorting order and counts, at widths that leave partial 128-tiles."""
    e_n, dim, inter, t = 8, 160, 136, 37
    g = torch.Generator().manual_seed(seed)
    weights = [
        torch.randn(e_n, inter, dim, generator=g) * 0.05,
        torch.randn(e_n, dim, inter, generator=g) * 0.05,
    ]
    x = torch.randn(t, dim, generator=g)
    ids = torch.randint(0, e_n, (t,), generator=g)
    ids[:3] = 0
    ids[ids == e_n - 1] = 1
    return weights, x, ids, ids.argsort(stable=True), torch.bincount(ids, minlength=e_n)


def fp8_experts(weights: list[torch.Tensor], fp8_backward: bool) -> Relu2Experts:
    e_n, inter, dim = weights[0].shape
    experts = Relu2Experts(dim, inter, e_n)
    with torch.no_grad():
        experts.w1.copy_(weights[0])
        experts.w2.copy_(weights[1])
    assert convert(nn.ModuleDict({"experts": experts}), fp8_dgrad=fp8_backward) == ["experts"]
    assert type(experts) is Fp8Relu2RoutedExperts and experts.fp8_backward is fp8_backward
    return experts


def test_fp8_relu2_experts_equal_engine_and_backward_is_straight_through() -> None:
    weights, x0, ids, order, counts = experts_case(50)
    t, dim = x0.shape
    experts = fp8_experts(weights, fp8_backward=False)
    x = x0.clone().requires_grad_()
    out_sorted = experts(x[order], counts)
    out = torch.empty_like(out_sorted).index_copy(0, order, out_sorted)
    engine = Fp8Relu2Experts(weights[0].shape[0], weights[0].shape[1], dim)
    engine.load_fused("up_proj", weights[0])
    engine.load_fused("down_proj", weights[1])
    with torch.no_grad():
        want = engine(x0, ids[:, None], torch.ones(t, 1))
    assert torch.equal(out.detach(), want)
    # Straight-through: the squared-ReLU experts at the dequantised weights, by autograd.
    grad = torch.randn(t, dim, generator=torch.Generator().manual_seed(51))
    out.backward(grad)
    up = dequantize_weight(engine.up_fp8, engine.up_scale).requires_grad_()
    down = dequantize_weight(engine.down_fp8, engine.down_scale).requires_grad_()
    xr = x0.clone().requires_grad_()
    ref = torch.stack([relu2(xr[i] @ up[ids[i]].t()) @ down[ids[i]].t() for i in range(t)])
    ref.backward(grad)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
    for w, r in ((experts.w1, up), (experts.w2, down)):
        torch.testing.assert_close(w.grad, r.grad, rtol=1e-4, atol=1e-5)


def test_fp8_relu2_experts_fp8_backward_is_its_formula() -> None:
    """fp8_backward: both dgrads block-scaled FP8 GEMMs (grad quantised 1x128, each expert's tiles
    transposed), the squared ReLU's backward 2 relu(h) da on the forward's h, the weight gradients
    against the GEMMs' inputs before quantisation; checked token by token against the references."""
    weights, x0, ids, order, counts = experts_case(52)
    t, dim = x0.shape
    e_n, inter, _ = weights[0].shape
    grad = torch.randn(t, dim, generator=torch.Generator().manual_seed(53))
    runs = {}
    for mode in (False, True):
        experts = fp8_experts(weights, fp8_backward=mode)
        x = x0.clone().requires_grad_()
        out = experts(x[order], counts)
        out.backward(grad[order])
        runs[mode] = (out.detach(), x.grad, experts.w1.grad, experts.w2.grad)
    assert torch.equal(runs[True][0], runs[False][0])  # the forward does not depend on the mode
    _, gx, gw1, gw2 = runs[True]
    up_q, up_s = zip(*(quantize_weight(weights[0][e]) for e in range(e_n)), strict=True)
    dn_q, dn_s = zip(*(quantize_weight(weights[1][e]) for e in range(e_n)), strict=True)
    xs_sorted, g_sorted, e_sorted = x0[order], grad[order], ids[order]
    xq, xs = quantize_act(xs_sorted)
    gq, gs = quantize_act(g_sorted)
    want_gx = torch.empty(t, dim)
    want_w1, want_w2 = torch.zeros(e_n, inter, dim), torch.zeros(e_n, dim, inter)
    for i in range(t):
        e, r = int(e_sorted[i]), slice(i, i + 1)
        h = fp8_gemm_reference(xq[r], xs[r], up_q[e], up_s[e])[0]
        a = relu2(h)
        da = fp8_gemm_reference(gq[r], gs[r], dn_q[e].t().contiguous(), dn_s[e].t().contiguous())[0]
        dh = (da * 2 * torch.relu(h))[None]
        dq, ds = quantize_act(dh)
        want_gx[i] = fp8_gemm_reference(dq, ds, up_q[e].t().contiguous(), up_s[e].t().contiguous())[0]
        want_w2[e] += g_sorted[i][:, None] * a[None, :]
        want_w1[e] += dh[0][:, None] * xs_sorted[i][None, :]
    torch.testing.assert_close(gx[order], want_gx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw1, want_w1, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw2, want_w2, rtol=1e-4, atol=1e-5)
    assert gw2[e_n - 1].abs().max() == 0  # an expert without tokens gets no gradient
    # The straight-through gradients up to E4M3 rounding of grad_out and of h's gradient.
    for got, ste in zip(runs[True][1:], runs[False][1:], strict=True):
        assert ((got - ste).norm() / ste.norm()).item() < 0.1


def test_experts_without_an_fp8_recipe_are_an_error() -> None:
    from torchtitan.models.moe.moe import GroupedExperts

    model = nn.ModuleDict(
        {"moe": nn.ModuleDict({"experts": GroupedExperts(32, 16, 4, use_grouped_mm=False)})}
    )
    with pytest.raises(
        ValueError, match=r"trainer.fp8: no FP8 recipe for the routed experts moe.experts \(GroupedExperts\)"
    ):
        convert(model)
