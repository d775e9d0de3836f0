"""The batch-1 persistent decode kernel (services/engine/kernels/megakernel.py) under the Triton
interpreter: every layer of one decode token against the engine's torch path (float32: to float
rounding; bf16: as close to a float32 reference as the torch bf16 path), the new token's K/V in
the page pool, contexts that leave partitions empty or span several key tiles, a padding row,
the shapes it refuses and its tiling, and a whole engine whose batch-1 steps run it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import triton_interp

# As the other kernel test files: TRITON_INTERPRET=1 before triton's first import, else a child.
INTERPRET, IN_CHILD, needs_interpreter, triton_interpreter, test_megakernel_tests_in_child_process = (
    triton_interp.kernel_test_module(
        ("megakernel", "ops.fused_norm", "paged_attention", "qk_rope", "gemv"), __file__
    )
)


from services.common.config import EngineConfig, ModelConfig, load_config  # noqa: E402
from services.common.modeldir import hf_config  # noqa: E402
from services.common.schemas import GenerateRequest, SamplingParams  # noqa: E402
from services.common.weights_dir import write_model_dir  # noqa: E402
from services.engine import LLMEngine  # noqa: E402
from services.engine.batch import ForwardBatch, Span  # noqa: E402
from services.engine.kernels import megakernel  # noqa: E402
from services.engine.kv_cache import KVCache  # noqa: E402
from services.engine.models.causal_lm import CausalLM  # noqa: E402

CPU = torch.device("cpu")
PAGE = 4
# 4 query heads over 2 KV heads (GQA), head_dim 32 (the smallest the kernel takes), a down_proj
# K of 96 (not a power of two: its slice is cut along K), 2 layers.
SHAPE = dict(dim=64, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=96, n_layers=2, vocab_size=100)


def make_model(dtype: torch.dtype, seed: int = 0, **update: Any) -> CausalLM:
    m = ModelConfig(**{**SHAPE, **update})
    torch.manual_seed(seed)
    model = CausalLM(m, 512).to(CPU, dtype)
    with torch.no_grad():
        for p in model.parameters():  # norms near 1, weights large enough to make errors show
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if p.dim() == 1 else 0.2 * torch.randn_like(p))
    model.fuse_projections()
    return model


def decode_case(model: CausalLM, ctx: int, seed: int = 0) -> dict[str, Any]:
    """Prefill ctx - 1 tokens (torch path), then the torch path's decode of token ctx - 1: its
    final hidden state, the pool after it, and what the megakernel needs to redo that step."""
    g = torch.Generator().manual_seed(seed)
    m = model.config
    dtype = model.model.embed_tokens.weight.dtype
    kv = KVCache.for_model(m, 128, PAGE, 512, dtype, CPU)
    table = torch.randperm(128, generator=g)[: -(-ctx // PAGE)].tolist()
    prompt = torch.randint(0, m.vocab_size, (ctx,), generator=g).tolist()
    with torch.no_grad():
        if ctx > 1:
            model(ForwardBatch.build([Span(table, 0, prompt[:-1])], CPU, 512, PAGE), kv)
        before = (kv.k.clone(), kv.v.clone())
        step = ForwardBatch.build([Span(table, ctx - 1, prompt[-1:])], CPU, 512, PAGE)
        hidden = model(step, kv)
    return {"kv": kv, "before": before, "after": (kv.k.clone(), kv.v.clone()), "hidden": hidden, "step": step,
            "table": torch.tensor(table), "ctx": ctx}  # fmt: skip


def run_megakernel(
    model: CausalLM, case: dict[str, Any], programs: int = 8, tuning: dict[str, bool] | None = None
) -> tuple[torch.Tensor, megakernel.DecodeMegakernel]:
    """The same step through the megakernel, on the pool as it was before the step: (the final
    hidden state, the kernel)."""
    kv, step = case["kv"], case["step"]
    kv.k.copy_(case["before"][0])
    kv.v.copy_(case["before"][1])
    mk = megakernel.DecodeMegakernel(model, kv.k, kv.v, PAGE, num_sms=programs)
    mk.tuning = tuning or {}
    with torch.no_grad():
        h = model.model.embed_tokens(step.input_ids).float()
        h = mk.run(h, step.positions, step.slot_mapping, torch.tensor([case["ctx"]]), case["table"])
        return model.model.norm(h), mk


def assert_matches_torch_path(got: torch.Tensor, case: dict[str, Any]) -> None:
    """Float32: the hidden state to float rounding, and the new token's k/v (normalised and
    rotated k) in the pool with nothing else moved. (Layer 1's input differs from the torch
    path's by float32 rounding, so its k/v do too.)"""
    ref = case["hidden"]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, atol=2e-5 * float(ref.abs().max()), rtol=0)
    for got_pool, ref_pool in zip((case["kv"].k, case["kv"].v), case["after"], strict=True):
        torch.testing.assert_close(got_pool, ref_pool, atol=2e-5 * float(ref_pool.abs().max()), rtol=0)


@needs_interpreter
@pytest.mark.parametrize(
    ("ctx", "update"),
    [
        (1, {}),
        (6, {}),
        (37, {}),
        (300, {}),
        (37, {"arch": "llama3", "qk_norm": False}),
        (37, {"n_kv_heads": 4}),
    ],
)
def test_float32_step_matches_the_torch_path(ctx: int, update: dict[str, Any]) -> None:
    """1: only the new token; 6: most partitions empty; 300: items of two key tiles each; a
    Llama-3 (no q/k norm); plain multi-head attention (a group of one)."""
    model = make_model(torch.float32, **update)
    case = decode_case(model, ctx)
    assert_matches_torch_path(run_megakernel(model, case)[0], case)


@needs_interpreter
@pytest.mark.parametrize("tuning", [{}, {"EARLY_GU": False}])
def test_persistent_launch_matches_the_torch_path(tuning: dict[str, bool]) -> None:
    """The GPU's launch (one persistent kernel: weight slices and KV tiles loaded a phase ahead,
    carried across layers, the barrier bookkeeping) with one program, whose barriers pass at once
    under the interpreter: a one-head model, whose q/k/v slice is 3 tiles and down's 3 K chunks."""
    model = make_model(torch.float32, n_heads=1, n_kv_heads=1)
    case = decode_case(model, 150)
    got, mk = run_megakernel(model, case, programs=1, tuning=tuning)
    assert mk.programs == 1
    assert_matches_torch_path(got, case)


@needs_interpreter
def test_bf16_step_is_as_close_to_float32_as_the_torch_path() -> None:
    """bf16 rounds where the layered path does: its error against a float32 run of the same
    (bf16-valued) weights is of the torch bf16 path's size. (The interpreter truncates where the
    GPU rounds, hence the margin.) A wrong head, page or partition would be off by O(1)."""
    model = make_model(torch.bfloat16)
    case = decode_case(model, 45)
    got = run_megakernel(model, case)[0].float()
    ref32_model = make_model(torch.float32)
    with torch.no_grad():
        for p32, p16 in zip(ref32_model.parameters(), model.parameters(), strict=True):
            p32.copy_(p16.float())
    ref32 = decode_case(ref32_model, 45)["hidden"]
    torch_err = float((case["hidden"].float() - ref32).abs().max())
    mk_err = float((got - ref32).abs().max())
    assert torch_err > 0
    assert mk_err <= 2.0 * torch_err, (mk_err, torch_err)


@needs_interpreter
def test_padding_row_reads_and_writes_nothing() -> None:
    """A CUDA graph's capture runs on padding (context 0, slot -1): no KV is written and the
    output stays finite."""
    model = make_model(torch.float32)
    kv = KVCache.for_model(model.config, 16, PAGE, 256, torch.float32, CPU)
    kv.k.normal_()
    k0 = kv.k.clone()
    mk = megakernel.DecodeMegakernel(model, kv.k, kv.v, PAGE, num_sms=8)
    with torch.no_grad():
        h = torch.randn(1, SHAPE["dim"])
        out = mk.run(
            h, torch.tensor([0]), torch.tensor([-1]), torch.tensor([0]), torch.zeros(4, dtype=torch.long)
        )
    assert torch.isfinite(out).all()
    assert torch.equal(kv.k, k0)


def test_models_it_refuses_say_why() -> None:
    assert megakernel.unsupported(make_model(torch.float32)) is None
    assert "float32 residual" in megakernel.unsupported(make_model(torch.float32, fp32_residual=False))
    assert "head_dim >= 32" in megakernel.unsupported(make_model(torch.float32, head_dim=16))
    unfused = CausalLM(ModelConfig(**SHAPE), 256)
    assert "fused" in megakernel.unsupported(unfused)
    moe = CausalLM(load_config("debug").model.model_copy(update={"n_routed_experts": 4, "n_experts_per_tok": 2,
                                                                   "moe_hidden_dim": 32}), 64)  # fmt: skip
    assert "MoE" in megakernel.unsupported(moe)
    with pytest.raises(ValueError, match="megakernel: needs the float32 residual"):
        megakernel.DecodeMegakernel(
            make_model(torch.float32, fp32_residual=False), *(torch.zeros(1),) * 2, PAGE, 8
        )


def test_program_count_and_tiling() -> None:
    qwen3_06b = megakernel.Shape(dim=1024, n_heads=16, n_kv_heads=8, head_dim=128, inter=3072, n_layers=28)
    assert megakernel.programs_for(qwen3_06b, 132) == 128  # whole rows for every GEMV on the H200
    assert megakernel.programs_for(qwen3_06b, 64) == 64
    # Row chunks over a power-of-two K; K chunks for a power-of-two row count; at most 4 tiles.
    assert megakernel._tiling(32, 1024) == (32, 1024)  # q/k/v
    assert megakernel._tiling(48, 1024) == (16, 1024)  # gate/up: 3 tiles of 16 rows
    assert megakernel._tiling(8, 3072) == (8, 1024)  # down: 3 tiles along K
    assert megakernel._tiling(48, 3072) is None
    assert megakernel._tiling(160, 1024) is None  # 5 row chunks


@needs_interpreter
def test_engine_batch1_steps_run_it_and_match_the_torch_backend(tmp_path: Path) -> None:
    """A bf16 engine on the paged backend with the megakernel attached (as the CUDA engine does
    with EngineConfig.megakernel) decodes one request with the same greedy tokens and log-probs as
    the torch backend, and every decode step after the prompt went through the kernel."""
    m = load_config("debug").model.model_copy(update={"head_dim": 32, "n_kv_heads": 2})
    torch.manual_seed(3)
    state = {k: v for k, v in CausalLM(m, m.max_seq_len).state_dict().items() if "rope" not in k}
    path = write_model_dir(tmp_path / "step_0", state, hf_config(m, eos_token_id=0), None, {"version": 0})
    base: dict[str, Any] = dict(
        device="cpu", dtype="bfloat16", max_batch_size=2, max_seq_len=64, block_size=4
    )
    req = GenerateRequest(input_ids=list(range(3, 12)),
                          sampling=SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))  # fmt: skip
    ref = LLMEngine(path, EngineConfig(**base, attention_backend="torch")).generate([req])
    engine = LLMEngine(path, EngineConfig(**base, attention_backend="triton"))
    assert engine.model.megakernel is None  # CPU: the engine itself never attaches it
    engine.model.fused_elementwise = True
    engine.model.fuse_projections()
    mk = megakernel.DecodeMegakernel(engine.model, engine.kv.k, engine.kv.v, 4, num_sms=8)
    calls = []
    run = mk.run
    mk.run = lambda *a: calls.append(1) or run(*a)  # type: ignore[method-assign]
    engine.model.megakernel = mk
    out = engine.generate([req])
    assert len(calls) == 5  # the 5 decode steps after the prompt's
    assert ref[0].choices[0].output_ids == out[0].choices[0].output_ids
    assert ref[0].choices[0].logprobs == pytest.approx(out[0].choices[0].logprobs, abs=3e-2)
