"""The bf16 engine and the bf16 trainer compute the same function (Router Replay's KL floor).

bench/r3/numerics.py runs one random model in the engine (bf16, CPU torch path) and in the trainer
(autocast over float32 weights, and bf16 parameters as FSDP2's mixed precision computes) with the
engine's expert ids replayed, and compares every layer and the final log-probs.

Measured with that harness (4-layer MoE, dim 256, 64 experts top-8, 4 x 64 tokens, HF init;
`.venv/bin/python bench/r3/numerics.py`), engine vs trainer with replay: 0 for autocast and for
bf16 parameters (bitwise equal hidden states and log-probs). Without the alignments below the
two sides are 1.3-1.75e-3 mean / 5.9-7.8e-3 max apart in |dlogp| (KL 1.6-2.9e-6). The alignments:
router logits in float32 from the compute dtype's input and gate values (trainer/replay.py,
services/engine/layers/moe.py Router.round_weight_), routing weights rounded to the model dtype and the
expert sum in float32 with one rounding (ExpertWeights.combine, ReplayRouter), q/k-norm + RoPE in
float32 with one rounding and compute-dtype cos/sin (trainer/model.py RelayAttention,
services/engine/layers/rope.py norm_rope), the residual stream rounded where the engine rounds it
(residual_stream_like_engine: float32 with model.fp32_residual, the default, else bf16) and the RMSNorms multiplying by bf16 weight values (RelayRMSNorm:
with norm weights that are not bf16 values, as after training, `--perturb-norms`, autocast is
1.9e-3 mean / 8.0e-3 max apart without it). The bounds below leave room for a stray bf16 ulp from
a kernel, not for a formulation difference (those give ~1e-3 mean).

Both sides' LM-head logits are float32 by default (ops/lm_head.py, `logits_fp32`);
the bf16-output head (`logits_fp32` off) is bitwise equal on CPU too. `floor_sources` emulates
the GPU's accumulation-order differences on the trainer side and shows what rounding the logits
to bf16 adds (docs/replay.md "bf16 numerics")."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from services.engine.layers.moe import ExpertWeights, Router
from trainer.model import build_model
from trainer.replay import moe_routers

# bench/ is not an installed package: load the harness by path (as bench/tests/test_r3.py does).
_spec = importlib.util.spec_from_file_location(
    "bench_r3_numerics", Path(__file__).resolve().parents[1] / "bench" / "r3" / "numerics.py"
)
assert _spec is not None and _spec.loader is not None
numerics = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = numerics  # its dataclasses look their module up there
_spec.loader.exec_module(numerics)
TRAINER_PATHS, dense_config, measure, moe_config = (
    numerics.TRAINER_PATHS,
    numerics.dense_config,
    numerics.measure,
    numerics.moe_config,
)

LOGP_MEAN = 1e-6  # reached: 0.0 (before: 1.3e-3 / 1.75e-3)
LOGP_MAX = 1e-4  # reached: 0.0 (before: 5.9e-3 / 7.8e-3)
HIDDEN_MEAN = 1e-6  # per layer, residual stream after the layer; reached: 0.0


@pytest.fixture(scope="module", params=["moe", "dense"])
def result(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    m = moe_config(3) if request.param == "moe" else dense_config(3)
    # perturb_norms: norm weights that are not bf16 values, as after training (see below)
    return measure(m, rows=2, seq=48, seed=3, perturb_norms=True, workdir=tmp_path_factory.mktemp("numerics"))


def measure_moe(tmp_path_factory: pytest.TempPathFactory, name: str, **switches: bool) -> dict[str, Any]:
    """The MoE result fixture's measurement with some numerics switch turned off."""
    return measure(
        moe_config(3),
        rows=2,
        seq=48,
        seed=3,
        perturb_norms=True,
        workdir=tmp_path_factory.mktemp(name),
        **switches,
    )


@pytest.fixture(scope="module")
def result_bf16_logits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return measure_moe(tmp_path_factory, "n16", logits_fp32=False)


@pytest.fixture(scope="module")
def result_bf16_residual(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """ModelConfig.fp32_residual off on both sides: the bf16 residual stream (the engine reads the
    key from config.json, where hf_config writes it)."""
    return measure_moe(tmp_path_factory, "nres16", fp32_residual=False)


def _check_equal(r: dict[str, Any], path: str) -> None:
    for i, layer in enumerate(r["layers"]):
        assert layer["resid"]["mean"] <= HIDDEN_MEAN, (path, i, layer)
        assert layer["attn"]["mean"] <= HIDDEN_MEAN, (path, i, layer)
        assert layer["mlp"]["mean"] <= HIDDEN_MEAN, (path, i, layer)
        if "router_w" in layer:
            assert layer["router_w"]["max"] <= 1e-6, (path, i, layer)
    assert r["logp_abs_mean"] <= LOGP_MEAN, r
    assert r["logp_abs_max"] <= LOGP_MAX, r
    assert r["kl_full_mean"] <= 1e-9, r


@pytest.mark.parametrize("path", TRAINER_PATHS)
def test_bf16_engine_equals_bf16_trainer_with_replay(result: dict[str, Any], path: str) -> None:
    """In the default (float32 logits on both sides)."""
    assert result["logits_fp32"] is True
    _check_equal(result[f"engine_vs_trainer_{path}"], path)


@pytest.mark.parametrize("path", TRAINER_PATHS)
def test_bf16_logits_head_still_equal_with_replay(result_bf16_logits: dict[str, Any], path: str) -> None:
    """logits_fp32 off on both sides (the bf16-output head): still the same function."""
    assert result_bf16_logits["logits_fp32"] is False
    _check_equal(result_bf16_logits[f"engine_vs_trainer_{path}"], path)


@pytest.mark.parametrize("path", TRAINER_PATHS)
def test_bf16_residual_stream_still_equal_with_replay(
    result_bf16_residual: dict[str, Any], path: str
) -> None:
    """fp32_residual off on both sides (a bf16 residual stream): still the same function."""
    assert result_bf16_residual["fp32_residual"] is False
    _check_equal(result_bf16_residual[f"engine_vs_trainer_{path}"], path)


@pytest.mark.parametrize("arch", ["moe", "dense"])
def test_fp32_residual_brings_the_bf16_engine_closer_to_float32(
    arch: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Same model, tokens and expert ids: with the float32 stream the bf16 engine (and each bf16
    trainer path) is nearer the float32 reference, in the last layer's stream and in log-probs.
    (Both sides of each comparison use the same architecture: comparing the dense model with the
    float32 stream against the MoE model without it passes or fails with the CPU's bf16 kernels.)"""
    m = moe_config(3) if arch == "moe" else dense_config(3)
    on, off = (
        measure(m, rows=2, seq=48, seed=3, perturb_norms=True, workdir=tmp_path_factory.mktemp(f"res{flag}"),
                fp32_residual=flag)
        for flag in (True, False)
    )  # fmt: skip
    assert on["fp32_residual"] is True and off["fp32_residual"] is False
    for key in ("engine_bf16_vs_fp32", *(f"trainer_{p}_vs_fp32" for p in TRAINER_PATHS)):
        f32, b16 = on[key], off[key]
        assert f32["logp_abs_mean"] < b16["logp_abs_mean"], (key, f32["logp_abs_mean"], b16["logp_abs_mean"])
        last = len(f32["layers"]) - 1
        assert f32["layers"][last]["resid"]["mean"] < b16["layers"][last]["resid"]["mean"], key


def test_fp32_residual_stream_dtypes(tmp_path: Path) -> None:
    """The engine's hidden state between layers is float32 with the key on and bf16 with it off,
    and the key survives the HF directory (config.json) into the engine; the trainer's blocks
    under bf16 parameters and under autocast carry the same dtypes."""
    import contextlib

    from services.common.config import EngineConfig
    from services.engine import LLMEngine
    from trainer.model import save_weights_dir

    for fp32 in (True, False):
        m = moe_config(2).model_copy(update={"fp32_residual": fp32})
        model = build_model(m, seed=0).eval()
        d = save_weights_dir(m, model.state_dict(), tmp_path / f"w{fp32}", {"version": 0})
        eng = LLMEngine(d, EngineConfig(device="cpu", dtype="bfloat16", max_batch_size=1, max_seq_len=32))
        assert eng.model_config.fp32_residual is fp32 and eng.model.fp32_residual is fp32
        seen: list[torch.dtype] = []
        hook = eng.model.model.layers[0].register_forward_hook(lambda _m, _i, o, s=seen: s.append(o.dtype))
        tokens = torch.randint(0, m.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
        numerics.run_engine(eng, tokens)
        hook.remove()
        assert seen == [torch.float32 if fp32 else torch.bfloat16], (fp32, seen)
        for name, net, amp in (
            ("autocast", model, torch.autocast("cpu", dtype=torch.bfloat16)),
            ("bf16_params", numerics.bf16_params(model), contextlib.nullcontext()),
        ):
            got: list[torch.dtype] = []
            h = net.layers["0"].register_forward_hook(lambda _m, _i, o, s=got: s.append(o.dtype))
            with torch.no_grad(), amp:
                net(tokens)
            h.remove()
            assert got == [torch.float32 if fp32 else torch.bfloat16], (name, fp32, got)


def test_fp32_residual_lowers_the_emulated_kernel_floor() -> None:
    """residual_sources: sublayer outputs moved by one bf16 ulp with probability p (the GPU's
    kernel-order differences, emulated on the trainer side) cost less KL with the float32 stream;
    with nothing emulated both streams are bitwise equal (float32 logits)."""
    res = numerics.residual_sources(moe_config(2), rows=2, seq=32, seed=1)
    ratio = res["kl_bf16_over_fp32_residual"]
    for arm in ("bf16", "fp32"):
        none = res["by_residual"][arm]["rows"]["none"]["fp32_logits"]
        assert none["kl_full_mean"] == 0.0 and none["logits_differ_frac"] == 0.0, arm
    for name in ("body_flip_1e-3", "body_flip_1e-2"):
        assert ratio[name] > 1.0, (name, ratio)


def test_float32_logits_remove_the_head_rounding_term() -> None:
    """floor_sources: with the same hidden states and only the head's float32 sums in another
    order, bf16 logits turn that into whole-ulp differences (a KL hundreds of times larger than
    the float32 head's); with no emulated difference the float32 arms are bitwise equal."""
    rows = numerics.floor_sources(moe_config(2), rows=2, seq=32, seed=1)["rows"]
    none, head = rows["none"], rows["head_order"]
    assert none["fp32_logits"]["logits_differ_frac"] == 0.0
    assert none["fp32_logits"]["kl_full_mean"] == 0.0
    assert head["fp32_logits"]["logits_differ_frac"] > 0.5  # the emulated order noise is there
    assert 0.0 < head["fp32_logits"]["kl_full_mean"] * 100 < head["bf16_logits"]["kl_full_mean"]
    for name in ("body_flip_1e-3", "body_flip_1e-2", "head_order+body_flip_1e-3"):
        for arm in ("bf16_logits", "fp32_logits"):
            assert rows[name][arm]["kl_full_mean"] > 0.0, (name, arm)


def test_harness_sees_bf16_rounding(result: dict[str, Any]) -> None:
    """The comparison is not vacuous: each bf16 side is far from the float32 reference (bf16
    rounding, ~1e-3 in log-prob), and the float32 engine equals the float32 trainer."""
    for key in ("engine_bf16_vs_fp32", *(f"trainer_{p}_vs_fp32" for p in TRAINER_PATHS)):
        assert result[key]["logp_abs_mean"] > 1e-4, (key, result[key])
        assert result[key]["layers"][-1]["resid"]["mean"] > 1e-5, key
    parity = result["fp32_engine_vs_fp32_trainer"]
    assert parity["logp_abs_max"] <= 1e-5, parity
    assert result["tokens"] == 2 * 47


def test_engine_router_holds_model_dtype_values(tmp_path: Path) -> None:
    """After loading a float32 checkpoint, a bf16 engine's float32 gate holds bf16 values (the
    trainer's bf16 gate); a float32 engine keeps the checkpoint's values."""
    from services.common.config import EngineConfig
    from services.engine import LLMEngine
    from trainer.model import save_weights_dir

    m = moe_config(1)
    model = build_model(m, seed=0)
    d = save_weights_dir(m, model.state_dict(), tmp_path / "w", {"version": 0})
    ref = model.layers["0"].moe.router.gate.weight.detach()
    for dtype, want in (("bfloat16", ref.bfloat16().float()), ("float32", ref)):
        eng = LLMEngine(d, EngineConfig(device="cpu", dtype=dtype, max_batch_size=1, max_seq_len=32))
        gate = eng.model.model.layers[0].mlp.gate
        assert isinstance(gate, Router) and gate.weight.dtype == torch.float32
        assert torch.equal(gate.weight, want), dtype
    assert not torch.equal(ref.bfloat16().float(), ref)  # the rounding is visible at all


def test_expert_combine_rounds_once() -> None:
    """sum_k round_bf16(w_k) * y_k in float32, rounded once to bf16."""
    g = torch.Generator().manual_seed(0)
    y = torch.randn(5, 4, 16, generator=g).bfloat16()
    w = torch.rand(5, 4, generator=g)
    want = (w.bfloat16().float()[..., None] * y.float()).sum(1).bfloat16()
    torch.testing.assert_close(ExpertWeights.combine(y, w), want, rtol=0, atol=0)
    assert ExpertWeights.combine(y.float(), w).dtype == torch.float32


def test_trainer_router_logits_in_float32_under_autocast() -> None:
    """Under autocast the replay router's logits are the float32 product of bf16 values, not
    torchtitan's bf16 gate GEMM; in float32 training they are the gate's own output."""
    m = moe_config(1)
    model = build_model(m, seed=0)
    (router,) = moe_routers(model)
    x = torch.randn(7, m.dim, generator=torch.Generator().manual_seed(1))
    w = router.gate.weight.detach()
    want = x.bfloat16().float() @ w.bfloat16().float().T
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = router.gate_logits(x)
        bf16_gemm = router.gate(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert (bf16_gemm.float() - want).abs().max() > 1e-4  # what it replaces rounds visibly
    with torch.no_grad():
        torch.testing.assert_close(router.gate_logits(x), x @ w.T, rtol=1e-6, atol=1e-6)
