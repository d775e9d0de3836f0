"""FP8 checkpoints with their own scales (HF quantization_config "fp8": DeepSeek-V3, Kimi-K2,
Qwen3-*-FP8): ops/fp8/checkpoint.py, the loader's checks, the engine (fp8 buffers hold
the checkpoint's bits; a high-precision engine loads the dequantised weights), the trainer's
load_weights_dir. CPU, tiny random models: a Qwen3, a Qwen3-MoE with an expert width that is a
multiple of 128 and one that is not, a DeepSeek-V3 (MLA's kv_b_proj stays high precision)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.debug_weights import random_model_dir
from helpers.fp8_dirs import QCFG, fp8_model_dir, hf_config_of, quantise_state, write_dir
from helpers.hf_random import engine, engine_logprobs
from helpers.moe import small_ds, small_moe

from ops.fp8.checkpoint import dequantize_state, fp8_pairs, parse_quantization_config
from ops.fp8.recipe import FP8_DTYPE, dequantize_weight, quantize_weight
from services.common.config import EngineConfig, ModelConfig
from services.common.weights_dir import read_model_dir
from services.engine import LLMEngine
from services.engine.layers import fp8 as engine_fp8
from services.engine.layers.fp8 import Fp8Experts
from services.engine.loader import WeightsError, read_checkpoint
from trainer.model import load_weights_dir

# dim 192 and FFN 320: ragged K and N tiles (the last block covers 64 elements).
DENSE = ModelConfig(
    vocab_size=300,
    dim=192,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=48,
    hidden_dim=320,
    max_seq_len=64,
    tie_embeddings=False,
)
MODELS = {
    "qwen3": DENSE,
    # Expert width 128: gate and up tiles concatenate into the fused gate_up tiles (copied exactly).
    "moe128": small_moe(dim=160, hidden_dim=192, n_layers=2, n_routed_experts=4, moe_hidden_dim=128),
    # Expert width 96: a fused gate_up tile straddles gate and up rows (dequantised, re-quantised).
    "moe96": small_moe(dim=160, hidden_dim=192, n_layers=2, n_routed_experts=4, moe_hidden_dim=96),
    "deepseek": small_ds(n_layers=2),
}
TOKENS = [5, 17, 33, 8, 21, 2, 40, 41, 42, 9, 9, 9, 11, 30]
Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, dict[str, torch.Tensor]]]:
    """Per model: (fp8 checkpoint dir, the same weights dequantised to float32 in a plain HF dir,
    the fp8 checkpoint's tensors)."""
    out = {}
    for name, m in MODELS.items():
        root = tmp_path_factory.mktemp(name)
        hp_dir = random_model_dir(m, root / "hp", seed=3, std=0.08)
        cfg = hf_config_of(hp_dir)
        fp8_dir, state = fp8_model_dir(hp_dir, m, root / "fp8")
        # Dequantised here with the recipe's own function, not the module under test.
        deq = {
            k: dequantize_weight(v, state[k + "_scale_inv"]) if k + "_scale_inv" in state else v
            for k, v in state.items()
            if not k.endswith("_scale_inv")
        }
        deq_dir = write_dir(root / "deq", deq, cfg)
        out[name] = (fp8_dir, deq_dir, state)
    return out


def raw(t: torch.Tensor) -> torch.Tensor:
    """Bits of an fp8 tensor (torch.equal has no float8 kernel everywhere); others as they are."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def state_diff(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    return [k for k in sa if not torch.equal(raw(sa[k]), raw(sb[k]))]


def expected_expert_buffers(
    state: dict[str, torch.Tensor], prefix: str, e: int, inter: int
) -> dict[str, torch.Tensor]:
    """What Fp8Experts must hold for expert e of an fp8 checkpoint, computed from the files."""

    def pair(p: str) -> tuple[torch.Tensor, torch.Tensor]:
        key = f"{prefix}.{e}.{p}.weight"
        return state[key], state[key + "_scale_inv"]

    (gq, gs), (uq, us), (dq, ds) = pair("gate_proj"), pair("up_proj"), pair("down_proj")
    if inter % 128 == 0:
        gu_q, gu_s = torch.cat([gq, uq]), torch.cat([gs, us])
    else:
        gu_q, gu_s = quantize_weight(torch.cat([dequantize_weight(gq, gs), dequantize_weight(uq, us)]))
    return {"gate_up_fp8": gu_q, "gate_up_scale": gu_s, "down_fp8": dq, "down_scale": ds}


# ------------------------------------------------------------------ the module


def test_quantization_config_parsing() -> None:
    qc = parse_quantization_config({"quantization_config": QCFG | {"modules_to_not_convert": ["lm_head"]}})
    assert qc is not None and qc.weight_block_size == [128, 128] and qc.modules_to_not_convert == ["lm_head"]
    # fmt and activation_scheme may be absent (Qwen3-FP8 / DeepSeek configs differ there).
    assert parse_quantization_config(
        {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    )
    assert parse_quantization_config({}) is None
    for bad, field in (
        ({"quant_method": "gptq"}, "quant_method"),
        ({"weight_block_size": [64, 64]}, "weight_block_size"),
        ({"activation_scheme": "static"}, "activation_scheme"),
        ({"fmt": "e5m2"}, "fmt"),
    ):
        with pytest.raises(ValueError, match=rf"^quantization_config\.{field}:"):
            parse_quantization_config({"quantization_config": QCFG | bad})
    with pytest.raises(ValueError, match=r"^quantization_config\.weight_block_size: Field required"):
        parse_quantization_config({"quantization_config": {"quant_method": "fp8"}})


def test_pairs_found_and_dequantised(dirs: dict[str, tuple[Path, Path, dict[str, torch.Tensor]]]) -> None:
    _, _, state = dirs["qwen3"]
    pairs = fp8_pairs(state)
    assert len(pairs) == 7 * DENSE.n_layers  # q/k/v/o, gate/up/down per layer; nothing else
    key = "model.layers.1.mlp.down_proj.weight"
    assert pairs[key] == key + "_scale_inv"
    deq = dequantize_state(state, torch.bfloat16)
    assert not any(k.endswith("_scale_inv") for k in deq) and len(deq) == len(state) - len(pairs)
    q, s = state[key], state[key + "_scale_inv"]
    tiles = s.repeat_interleave(128, 0)[:192].repeat_interleave(128, 1)[:, :320]  # down_proj (192, 320)
    assert torch.equal(deq[key], (q.float() * tiles).bfloat16())
    assert deq["model.norm.weight"] is state["model.norm.weight"]  # high-precision tensors pass
    # A bf16 scale (some checkpoints ship them) is widened exactly; these pow2 scales fit bf16.
    s16 = {key: q, key + "_scale_inv": s.bfloat16()}
    assert torch.equal(dequantize_state(s16, torch.float32)[key], dequantize_weight(q, s))
    with pytest.raises(ValueError, match=f"^{key}: torch.float8_e5m2 is not supported"):
        fp8_pairs({key: q.to(torch.float8_e5m2), key + "_scale_inv": s})
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    with pytest.raises(ValueError, match=f"^{fused}: fp8 tensors must be 2-D linear weights"):
        fp8_pairs({fused: q.unsqueeze(0)})


# ------------------------------------------------------------------ engine


@pytest.mark.parametrize("name", list(MODELS))
def test_fp8_engine_holds_the_checkpoint_bits(
    name: str, dirs: dict[str, tuple[Path, Path, dict[str, torch.Tensor]]]
) -> None:
    """quantization="fp8" on an fp8 checkpoint: every Fp8Linear / Fp8Experts buffer is the
    checkpoint's tensor (experts of width 96: the re-quantised dequantised expert), the model equals
    an fp8 engine loaded from the dequantised weights whose buffers were then set to those tensors,
    and so do its logits."""
    m = MODELS[name]
    fp8_dir, deq_dir, state = dirs[name]
    assert read_checkpoint(fp8_dir).fp8 and not read_checkpoint(deq_dir).fp8
    eng = engine(fp8_dir, quantization="fp8")
    ref = engine(deq_dir, quantization="fp8")  # re-quantises the dequantised weights
    linears = engine_fp8.fp8_modules(eng.model)
    experts = {n: mod for n, mod in eng.model.named_modules() if isinstance(mod, Fp8Experts)}
    assert linears and (experts or not m.is_moe)
    for n, mod in linears.items():
        assert torch.equal(raw(mod.weight_fp8), raw(state[f"{n}.weight"])), n
        assert torch.equal(mod.weight_scale, state[f"{n}.weight_scale_inv"]), n
    for n, mod in experts.items():
        for e in range(mod.n_experts):
            for buf, want in expected_expert_buffers(state, n, e, m.moe_hidden_dim).items():
                assert torch.equal(raw(getattr(mod, buf)[e]), raw(want)), (n, e, buf)
    if m.is_mla:  # kept high precision by the engine: the dequantised checkpoint weight
        kv_b = "model.layers.0.self_attn.kv_b_proj"
        assert kv_b not in linears
        got = eng.model.get_submodule(kv_b).weight
        assert torch.equal(got, dequantize_weight(state[f"{kv_b}.weight"], state[f"{kv_b}.weight_scale_inv"]))

    # A re-quantisation would not have given these bits (pow2 checkpoint scales)...
    assert state_diff(eng.model, ref.model)
    # ...and with the checkpoint's tensors copied into the re-quantised engine, the two are equal.
    with torch.no_grad():
        for n, mod in engine_fp8.fp8_modules(ref.model).items():
            mod.weight_fp8.copy_(state[f"{n}.weight"])
            mod.weight_scale.copy_(state[f"{n}.weight_scale_inv"])
        for n, mod in ref.model.named_modules():
            if isinstance(mod, Fp8Experts):
                for e in range(mod.n_experts):
                    for buf, want in expected_expert_buffers(state, n, e, m.moe_hidden_dim).items():
                        getattr(mod, buf)[e].copy_(want)
    assert state_diff(eng.model, ref.model) == []
    assert torch.equal(engine_logprobs(eng, TOKENS), engine_logprobs(ref, TOKENS))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["qwen3", "moe96", "deepseek"])
def test_high_precision_engine_loads_the_dequantised_weights(
    name: str, dtype: str, dirs: dict[str, tuple[Path, Path, dict[str, torch.Tensor]]]
) -> None:
    fp8_dir, deq_dir, _ = dirs[name]
    eng, ref = engine(fp8_dir, dtype=dtype), engine(deq_dir, dtype=dtype)
    assert state_diff(eng.model, ref.model) == []
    assert torch.equal(engine_logprobs(eng, TOKENS), engine_logprobs(ref, TOKENS))


def test_weight_updates_between_fp8_and_high_precision_checkpoints(
    dirs: dict[str, tuple[Path, Path, dict[str, torch.Tensor]]], tmp_path: Path
) -> None:
    """apply_weights: after an fp8-checkpoint load, a high-precision update re-quantises in place
    (the bits of a fresh engine on it); an fp8 update copies the checkpoint's bits in place; a
    high-precision engine takes an fp8 update dequantised."""
    m = MODELS["moe128"]
    fp8_dir, deq_dir, state = dirs["moe128"]
    other = random_model_dir(m, tmp_path / "other", seed=4, std=0.08)
    eng = engine(fp8_dir, quantization="fp8")
    q_proj = eng.model.model.layers[1].self_attn.q_proj
    ex = eng.model.model.layers[1].mlp.experts

    def buffers() -> tuple[torch.Tensor, ...]:
        return (q_proj.weight_fp8, q_proj.weight_scale, ex.gate_up_fp8, ex.gate_up_scale)

    bufs = buffers()

    eng.apply_weights(eng.read_weights(other), 1)
    assert all(a is b for a, b in zip(buffers(), bufs, strict=True))  # in place: graphs keep them
    fresh = engine(other, quantization="fp8")
    assert state_diff(eng.model, fresh.model) == []
    assert torch.equal(engine_logprobs(eng, TOKENS), engine_logprobs(fresh, TOKENS))

    eng.apply_weights(eng.read_weights(fp8_dir), 2)
    assert all(a is b for a, b in zip(buffers(), bufs, strict=True))  # in place: graphs keep them
    assert state_diff(eng.model, engine(fp8_dir, quantization="fp8").model) == []
    assert torch.equal(raw(q_proj.weight_fp8), raw(state["model.layers.1.self_attn.q_proj.weight"]))

    hp = engine(other)
    hp.apply_weights(hp.read_weights(fp8_dir), 1)
    assert state_diff(hp.model, engine(deq_dir).model) == []


def test_fp8_load_checks_everything_before_writing(
    dirs: dict[str, tuple[Path, Path, dict[str, torch.Tensor]]],
) -> None:
    fp8_dir, _, state = dirs["moe128"]
    eng = engine(fp8_dir, quantization="fp8")
    before = {k: v.clone() for k, v in eng.model.state_dict().items()}
    key = "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"
    bad = dict(state) | {key: torch.ones(1, 1)}  # a wrong scale shape, the last expert's
    # A valid, different q_proj pair before it: it must not be written either.
    bad[Q] = quantize_weight(torch.randn(state[Q].shape))[0]
    with pytest.raises(ValueError, match=f"{key}: shape"):
        engine_fp8.load_hf_state(eng.model, bad)
    assert all(torch.equal(raw(v), raw(before[k])) for k, v in eng.model.state_dict().items())


# ------------------------------------------------------------------ trainer


@pytest.mark.parametrize("name", ["qwen3", "moe128"])
def test_trainer_load_weights_dir_dequantises(
    name: str, dirs: dict[str, tuple[Path, Path, dict[str, torch.Tensor]]]
) -> None:
    fp8_dir, deq_dir, state = dirs[name]
    m, got = load_weights_dir(fp8_dir)
    m_ref, want = load_weights_dir(deq_dir)
    assert m == m_ref and sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in got)
    wq = got["layers.0.attention.wq.weight"]
    key = "model.layers.0.self_attn.q_proj.weight"
    assert wq.dtype == torch.float32
    assert torch.equal(wq, dequantize_weight(state[key], state[key + "_scale_inv"]))


# ------------------------------------------------------------------ malformed checkpoints


def _broken(
    dirs: dict[str, tuple[Path, Path, dict[str, torch.Tensor]]], tmp_path: Path, **change: Any
) -> Path:
    fp8_dir, _, state = dirs["qwen3"]
    cfg = hf_config_of(fp8_dir)
    state = dict(state)
    if "qc" in change:
        cfg = cfg | {"quantization_config": change["qc"]} if change["qc"] is not None else cfg
        if change["qc"] is None:
            del cfg["quantization_config"]
    for k in change.get("drop", ()):
        del state[k]
    state |= change.get("put", {})
    return write_dir(tmp_path / "broken", state, cfg)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"qc": QCFG | {"weight_block_size": [128, 64]}}, "quantization_config.weight_block_size"),
        ({"qc": QCFG | {"activation_scheme": "static"}}, "quantization_config.activation_scheme"),
        ({"qc": QCFG | {"quant_method": "bitsandbytes"}}, "quantization_config.quant_method"),
        ({"qc": None}, "weight: fp8 tensors but config.json has no quantization_config"),
        ({"drop": [Q + "_scale_inv"]}, f"{Q}: fp8 tensor without its scale {Q}_scale_inv"),
        ({"put": {Q + "_scale_inv": torch.ones(2, 1)}}, f"{Q}_scale_inv: shape \\(2, 1\\)"),
        ({"put": {Q: torch.zeros(192, 192)}}, f"{Q}_scale_inv: a scale without its fp8 tensor"),
    ],
    ids=["block", "static", "method", "no-config", "no-scale", "scale-shape", "orphan-scale"],
)
def test_malformed_fp8_checkpoint_is_a_weights_error(
    change: dict[str, Any],
    match: str,
    dirs: dict[str, tuple[Path, Path, dict[str, torch.Tensor]]],
    tmp_path: Path,
) -> None:
    d = _broken(dirs, tmp_path, **change)
    with pytest.raises(WeightsError, match=match) as info:
        read_checkpoint(d)
    assert str(info.value).startswith(f"{d}: ")
    with pytest.raises(WeightsError, match=match):
        LLMEngine(d, EngineConfig(device="cpu"))
    with pytest.raises(ValueError, match=match):
        load_weights_dir(d)


def test_fused_projections_take_fp8_checkpoint_bits(tmp_path: Path) -> None:
    """The GPU path fuses q/k/v and gate/up FP8 linears into one GEMM whose buffers the parts view
    (model.fuse_projections): an fp8 checkpoint's bits land in the fused buffers, at load and on a
    weight update, and the fused GEMM equals the separate linears."""
    m = DENSE.model_copy(update={"dim": 256, "head_dim": 64, "hidden_dim": 384})  # whole 128-row tiles
    dirs = []
    for seed in (5, 6):
        hp_dir = random_model_dir(m, tmp_path / f"hp{seed}", seed=seed, std=0.08)
        cfg, hp = read_model_dir(hp_dir)
        state = quantise_state(hp)
        dirs.append((write_dir(tmp_path / f"fp8_{seed}", state, cfg | {"quantization_config": QCFG}), state))
    eng = engine(dirs[0][0], quantization="fp8")
    assert len(eng.model.fuse_projections()) == 2 * m.n_layers
    attn = eng.model.model.layers[1].self_attn
    assert attn.qkv is not None and attn.qkv.fp8 is not None
    prefix = "model.layers.1.self_attn"

    def check(state: dict[str, torch.Tensor]) -> None:
        want = torch.cat([state[f"{prefix}.{p}_proj.weight"] for p in "qkv"])
        want_scale = torch.cat([state[f"{prefix}.{p}_proj.weight_scale_inv"] for p in "qkv"])
        assert torch.equal(raw(attn.qkv.fp8.weight_fp8), raw(want))
        assert torch.equal(attn.qkv.fp8.weight_scale, want_scale)
        x = torch.randn(3, m.dim)
        assert torch.equal(attn.qkv(x), torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1))

    check(dirs[0][1])
    eng.apply_weights(eng.read_weights(dirs[1][0]), 1)
    check(dirs[1][1])


@pytest.mark.parametrize("name", ["qwen3", "moe128", "deepseek"])
def test_fp8_engine_never_allocates_high_precision_linears(
    dirs: dict[str, tuple[Path, Path, dict[str, torch.Tensor]]], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """quantization = "fp8" builds the model in its FP8 layout on the meta device first
    (models/registry.build_fp8_model), so a model whose bf16 weights would not fit is still served: no
    nn.Linear or expert weight is created anywhere but on meta, and the engine equals one built
    the plain way (high-precision model, load, convert) on the same high-precision weights."""
    from torch import nn

    from services.engine.layers import moe
    from services.engine.layers.fp8 import convert_model, load_hf_state
    from services.engine.models.causal_lm import CausalLM

    created: list[str] = []
    for cls in (nn.Linear, moe.ExpertWeights):
        real = cls.__init__

        def spy(self: nn.Module, *a: Any, _real: Any = real, **kw: Any) -> None:
            _real(self, *a, **kw)
            created.append(next(self.parameters()).device.type)

        monkeypatch.setattr(cls, "__init__", spy)
    _, deq_dir, _ = dirs[name]
    eng = engine(deq_dir, quantization="fp8")
    assert created and set(created) == {"meta"}, created
    monkeypatch.undo()

    ckpt = read_checkpoint(deq_dir)
    plain = CausalLM(ckpt.config, eng.max_seq_len, ckpt.attention_bias)
    plain.load_hf_state(ckpt.state)
    convert_model(plain)
    load_hf_state(plain, ckpt.state)  # the engine's update path: what it holds after a weight update
    assert state_diff(eng.model, plain) == []
    assert torch.equal(eng.model.rope_cos, plain.rope_cos) and torch.equal(eng.model.rope_sin, plain.rope_sin)
