"""Staged weight applies (EngineConfig.stage_weights, services/engine/weight_staging.py): a new
version is written into a staging copy while the engine steps on the old weights, then swapped
in between two steps. The tokens, log-probs, version tags and weight bits equal the direct apply's
(float32 and FP8 engines, high-precision and FP8 checkpoints), and reach the fused q/k/v and
gate/up buffers of the CUDA layout (built on the CPU); under AsyncEngine the loop keeps
stepping while a staging is held and the version changes only at the swap; a staging that fails
leaves the old weights live and raises to the caller. CPU, a small MoE published by
trainer.publish."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers.hf_random import engine
from helpers.moe import small_moe
from torch import nn

from ops.fp8.recipe import FP8_DTYPE
from services.common.schemas import GenerateChoice, GenerateRequest, SamplingParams
from services.common.weights_dir import read_model_dir, write_model_dir
from services.engine import AsyncEngine, LLMEngine
from services.engine.loader import Checkpoint
from services.engine.weight_staging import WeightStager, staging_copy
from trainer.model import build_model
from trainer.publish import Publisher

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Versions 1 and 2 of one small MoE, published high precision and FP8."""
    m = small_moe(dim=160, hidden_dim=192, n_layers=2, n_routed_experts=6, moe_hidden_dim=128, vocab_size=300)
    model = build_model(m, seed=3)
    root = tmp_path_factory.mktemp("staging")
    out: dict[str, list[Path]] = {"none": [], "fp8": []}
    for v in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        for quant, dirs in out.items():
            pub = Publisher(m, dtype=torch.bfloat16, quantization=quant)  # type: ignore[arg-type]
            pub.publish(model, v, root / quant / f"step_{v}", background=False)
            dirs.append(root / quant / f"step_{v}")
    return {k: (d[0], d[1]) for k, d in out.items()}


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def _state_diff(a: nn.Module, b: nn.Module) -> list[str]:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    return [k for k in sa if not torch.equal(_raw(sa[k]), _raw(sb[k]))]


def _req(max_tokens: int = 12) -> GenerateRequest:
    return GenerateRequest(
        input_ids=PROMPT, sampling=SamplingParams(max_tokens=max_tokens, seed=5, ignore_eos=True)
    )


def _generate_across_update(eng: LLMEngine, ckpt: Checkpoint, staged: bool) -> GenerateChoice:
    """One sampled request; version 2 goes live after its 5th step. Staged: the staging runs on
    another thread while two of those steps run on the old weights."""
    state = eng.add_request(_req())
    for _ in range(3):
        eng.step()
    if staged:
        took: list[float] = []
        stager = threading.Thread(target=lambda: took.append(eng.stage_weights(ckpt)))
        stager.start()
        for _ in range(2):
            eng.step()
        stager.join()
        assert eng.version == 1 and took  # staged, not live yet
        eng.swap_weights(ckpt, 2, took[0])
    else:
        for _ in range(2):
            eng.step()
        eng.apply_weights(ckpt, 2)
    while not state.finished:
        eng.step()
    return state.response().choices[0]


@pytest.mark.parametrize(
    ("ckpt_quant", "quantization", "dtype"),
    [
        ("none", "none", "float32"),
        ("none", "fp8", "bfloat16"),  # re-quantised into the FP8 buffers
        ("fp8", "fp8", "bfloat16"),  # the file's FP8 pairs copied, experts stacked
        ("fp8", "none", "bfloat16"),  # dequantised for a high-precision engine
    ],
)
def test_staged_update_equals_direct_apply(
    published: dict[str, tuple[Path, Path]], ckpt_quant: str, quantization: str, dtype: str
) -> None:
    v1, v2 = published[ckpt_quant]
    direct = engine(v1, quantization=quantization, dtype=dtype)
    staged = engine(v1, quantization=quantization, dtype=dtype, stage_weights=True)
    assert direct.stager is None and staged.stager is not None
    live = {k: t.data_ptr() for k, t in staged.model.state_dict().items()}
    want = _generate_across_update(direct, direct.read_weights(v2), staged=False)
    got = _generate_across_update(staged, staged.read_weights(v2), staged=True)
    assert got.versions == want.versions == [1] * 5 + [2] * 7
    assert got.output_ids == want.output_ids
    assert got.logprobs == want.logprobs  # exactly: the same bits computed them
    assert _state_diff(staged.model, direct.model) == []
    assert {k: t.data_ptr() for k, t in staged.model.state_dict().items()} == live  # in place
    assert staged.version == 2 and staged.stats.weight_updates_total == 1
    assert staged.stats.weight_stage_seconds_last > 0


@dataclass(frozen=True)
class _Fused:
    weight: torch.Tensor


def test_staging_copy_keeps_views_and_ties_and_shares_the_rest() -> None:
    """Views of one buffer stay views of one staged buffer (fused rows held by a plain
    attribute too), a tied parameter stays tied, a non-persistent buffer is shared, and a swap
    writes the live storages in place."""
    live = nn.Module()
    live.a, live.b = nn.Linear(4, 3, bias=False), nn.Linear(4, 2, bias=False)
    fused = torch.cat([live.a.weight, live.b.weight]).detach()
    live.a.weight = nn.Parameter(fused[:3], requires_grad=False)
    live.b.weight = nn.Parameter(fused[3:], requires_grad=False)
    live.fused = _Fused(fused)
    live.head = nn.Linear(4, 3, bias=False)
    live.head.weight = live.a.weight  # tied
    live.register_buffer("rope", torch.arange(6.0), persistent=False)
    staged, pairs = staging_copy(live)
    assert len(pairs) == 1  # one weight storage
    assert staged.head.weight is staged.a.weight
    assert staged.rope is live.rope
    assert staged.fused.weight.untyped_storage().data_ptr() == staged.a.weight.untyped_storage().data_ptr()
    assert staged.a.weight.data_ptr() != live.a.weight.data_ptr()

    def load(model: nn.Module, _ckpt: Checkpoint) -> None:
        with torch.no_grad():
            model.b.weight.fill_(7.0)

    stager = WeightStager(live, torch.device("cpu"), load)
    before = live.fused.weight.clone()
    stager.stage(None)  # type: ignore[arg-type]
    assert torch.equal(live.fused.weight, before)  # staged only
    stager.swap()
    assert torch.equal(live.fused.weight[3:], torch.full((2, 4), 7.0))
    assert torch.equal(live.fused.weight[:3], before[:3])
    with pytest.raises(RuntimeError, match="no staged"):
        stager.swap()


def _bad_copy(good: Path, dest: Path) -> Path:
    """`good` with lm_head transposed: it reads as the same model, its load fails part way."""
    config, state = read_model_dir(good)
    state = dict(state) | {"lm_head.weight": state["lm_head.weight"].t().contiguous()}
    return write_model_dir(dest, state, config, good, {"version": 3})


def test_async_engine_steps_while_staging_and_swaps_at_a_step_boundary(
    published: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    v1, v2 = published["none"]
    bad = _bad_copy(v1, tmp_path / "bad")  # version 2 will be live: a partial write shows

    async def scenario() -> None:
        eng = AsyncEngine(engine(v1, stage_weights=True)).start()
        stats, stager = eng.engine.stats, eng.engine.stager
        assert stager is not None
        entered, release = threading.Event(), threading.Event()
        load = stager._load

        def held(model: nn.Module, ckpt: Checkpoint) -> None:
            entered.set()
            assert release.wait(10)
            load(model, ckpt)

        stager._load = held
        try:
            long = asyncio.ensure_future(eng.submit(_req(max_tokens=200)))
            while stats.generated_tokens_total < 3:
                await asyncio.sleep(0.001)
            update = asyncio.ensure_future(eng.load_weights(v2, 2))
            assert await asyncio.to_thread(entered.wait, 10)
            # The staging is held: the loop keeps stepping on version 1.
            base = stats.generated_tokens_total
            for _ in range(5000):
                if stats.generated_tokens_total >= base + 5:
                    break
                await asyncio.sleep(0.001)
            assert stats.generated_tokens_total >= base + 5
            assert eng.version == 1 and not update.done() and stats.weight_updates_total == 0
            release.set()
            assert await asyncio.wait_for(update, 10) == 2
            assert eng.version == 2
            assert stats.weight_stage_seconds_last > stats.weight_apply_seconds_last
            versions = (await asyncio.wait_for(long, 10)).choices[0].versions
            assert versions == sorted(versions) and versions[-1] == 2
            assert versions.count(1) >= base + 5

            # A staging that fails part way: raised here, version 2 stays live, the staging
            # copy is the live weights again.
            stager._load = load
            before = {k: v.clone() for k, v in eng.engine.model.state_dict().items()}
            with pytest.raises(ValueError, match="lm_head.weight"):
                await eng.load_weights(bad, 3)
            assert eng.version == 2 and stats.weight_updates_total == 1
            assert [
                k for k, v in eng.engine.model.state_dict().items() if not torch.equal(v, before[k])
            ] == []
            assert _state_diff(stager.model, eng.engine.model) == []
            # ... and the next update goes through.
            assert await eng.load_weights(v1, 4) == 4
            assert _state_diff(eng.engine.model, engine(v1).model) == []
        finally:
            release.set()
            eng.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize(("ckpt_quant", "quantization"), [("none", "none"), ("fp8", "fp8"), ("none", "fp8")])
def test_staged_update_reaches_the_fused_projections(
    tmp_path: Path, ckpt_quant: str, quantization: str
) -> None:
    """The CUDA layout, built on the CPU: after fuse_projections (q/k/v and gate/up one buffer
    each, the HF-named tensors views of it, the fused GEMM's tensors held outside the module
    tree) a staged update lands in the buffers the fused GEMMs read, as a direct load does."""
    m = small_moe(
        dim=160, hidden_dim=256, n_heads=4, n_kv_heads=4, head_dim=32, n_layers=2, n_routed_experts=4,
        moe_hidden_dim=128, vocab_size=300,
    )  # fmt: skip
    model = build_model(m, seed=5)
    pub = Publisher(m, dtype=torch.bfloat16, quantization=ckpt_quant)  # type: ignore[arg-type]
    for v in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        pub.publish(model, v, tmp_path / f"step_{v}", background=False)
    eng, ref = (engine(tmp_path / "step_1", quantization=quantization, dtype="bfloat16") for _ in range(2))
    fused = eng.model.fuse_projections()
    ref.model.fuse_projections()
    assert fused  # the dense layer's attention and MLP, and the MoE layer's attention
    stager = WeightStager(eng.model, eng.device, eng.runner._load_into)
    ckpt = eng.read_weights(tmp_path / "step_2")
    stager.stage(ckpt)
    stager.swap()
    ref.runner.load_state(ref.read_weights(tmp_path / "step_2"))
    assert _state_diff(eng.model, ref.model) == []
    n_fp8 = 0
    for name in fused:
        rows, want, staged = (_rows(mdl.get_submodule(name)) for mdl in (eng.model, ref.model, stager.model))
        assert torch.equal(_raw(rows[0]), _raw(want[0])) and torch.equal(rows[1], want[1]), name
        # The staging copy's fused tensors are views of its own buffers, not a copy beside them.
        assert staged[0].untyped_storage().data_ptr() != rows[0].untyped_storage().data_ptr()
        part = stager.model.get_submodule(name)
        first = part.q_proj if hasattr(part, "q_proj") else part.gate_proj
        first_weight = first.weight_fp8 if rows[2] else first.weight
        assert staged[0].untyped_storage().data_ptr() == first_weight.untyped_storage().data_ptr()
        n_fp8 += rows[2]
    assert n_fp8 == (len(fused) if quantization == "fp8" else 0)


def _rows(mod: nn.Module) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(weight, scales or an empty tensor, fp8) of a fused projection: what its GEMM reads."""
    rows = mod.qkv if hasattr(mod, "qkv") else mod.gate_up
    if rows.fp8 is not None:
        return rows.fp8.weight_fp8, rows.fp8.weight_scale, True
    return rows.weight, torch.empty(0), False
