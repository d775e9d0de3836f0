"""Nemotron-H's decode on the CUDA-graph path, on CPU: the paged attention kernels under Triton's
interpreter and the decode graphs' static inputs (cuda_graphs.DecodeGraphs: padded batch, each
row's Mamba-2 state slot in a static buffer, states advanced in place) run eagerly, which is the
work a captured graph replays (bench/engine/nemotron_gpu.py checks capture and replay on a GPU).
The static batch gives the eager batch's hidden states and leaves the same states, its padding
rows touch no sequence's slot, and a whole engine decoding through the graphs' path gives the
torch backend's tokens and log-probs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import triton_interp

INTERPRET, IN_CHILD, needs_interpreter, triton_interpreter, test_kernel_tests_in_child_process = (
    triton_interp.kernel_test_module(("paged_attention", "qk_rope"), __file__)
)

from helpers.moe import nemotron_model, small_nemotron  # noqa: E402

from services.common.config import EngineConfig, ModelConfig  # noqa: E402
from services.common.schemas import GenerateRequest, SamplingParams  # noqa: E402
from services.engine import LLMEngine  # noqa: E402
from services.engine.batch import HostBatch, Span, StateMeta, plan_decode  # noqa: E402
from services.engine.cuda_graphs import DecodeGraphs, padded_size  # noqa: E402
from trainer.model import save_weights_dir  # noqa: E402

BASE = dict(device="cpu", max_batch_size=8, block_size=4, cuda_graphs=False, overlap_schedule=False)


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelConfig, Path]:
    m = small_nemotron(head_dim=16)  # the paged kernels need a power-of-two head_dim >= 16
    d = save_weights_dir(
        m, nemotron_model(m, seed=3).state_dict(), tmp_path_factory.mktemp("g") / "step_0", {}
    )
    return m, d


@needs_interpreter
@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_graph_static_batch_matches_eager_nemotron(
    published: tuple[ModelConfig, Path], quantization: str
) -> None:
    """bf16 and FP8 weights (tests/test_nemotron_fp8.py) alike."""
    m, d = published
    cfg = EngineConfig(
        **BASE, max_seq_len=m.max_seq_len, attention_backend="triton", quantization=quantization
    )
    engine = LLMEngine(d, cfg)
    states = engine.kv.states
    assert engine.attention_backend == "triton" and states is not None
    for i, n in enumerate((5, 40, 17)):
        engine.add_request(
            GenerateRequest(input_ids=[3 + j % 50 for j in range(n)], sampling=SamplingParams(seed=i))
        )
    while engine.num_waiting or any(s.num_cached < len(s.prompt) for s in engine.scheduler.running):
        engine.step()
    plan = engine.scheduler.schedule()
    spans = [
        Span(s.block_table, s.num_cached, s.uncached_tokens()[:n], s.state_slot) for s, n in plan.compute
    ]
    hb = HostBatch.build(spans, 4, engine.block_tables)
    assert hb.decode_only and len(spans) == 3 and hb.state_slots is not None
    used = sorted(hb.state_slots.tolist())
    free = [s for s in range(states.slots) if s not in used]
    # Slots no sequence of the step holds get distinct states: a padding row writing one shows.
    g = torch.Generator().manual_seed(0)
    states.conv[:, free] = torch.randn(states.conv[:, free].shape, generator=g)
    states.ssm[:, free] = torch.randn(states.ssm[:, free].shape, generator=g)
    before = states.conv.clone(), states.ssm.clone()

    batch = hb.to_forward_batch(engine.device, m.n_kv_heads, engine.num_sms)
    batch.state = StateMeta.build(spans, engine.device)
    eager = engine.model(batch, engine.kv)
    after = states.conv.clone(), states.ssm.clone()

    graphs = DecodeGraphs(engine.model, engine.kv, 8, num_sms=64, device=engine.device)
    size = padded_size(len(spans), graphs.sizes)
    assert size == 4  # one padding row
    work = plan_decode(hb.ctx_lens, np.arange(len(spans)), m.n_kv_heads, 64)
    for p in (work, None):  # both graphs of the size: the ragged work list and a program per row
        states.conv.copy_(before[0])
        states.ssm.copy_(before[1])
        graphs.buf.fill(hb, size, p, graphs.capacity[size])
        assert graphs.buf.state[size - 1].item() == states.pad_slot
        static = engine.model(graphs.static_batch(size, p is not None), engine.kv)
        assert torch.isfinite(static).all()
        torch.testing.assert_close(static[: len(spans)], eager, atol=1e-5, rtol=1e-5)
        # The step's slots advanced as eagerly; every other real slot is as it was.
        for now, want in zip((states.conv, states.ssm), after, strict=True):
            torch.testing.assert_close(now[:, used], want[:, used], atol=1e-5, rtol=1e-5)
        for now, was in zip((states.conv, states.ssm), before, strict=True):
            assert torch.equal(now[:, free], was[:, free])


@needs_interpreter
def test_engine_decodes_through_graph_path_nemotron(published: tuple[ModelConfig, Path]) -> None:
    """Decode-only steps run DecodeGraphs (uncaptured on CPU: its body on the static buffers), one
    sequence joining with a one-token prompt so a graph step starts a state from zero, and
    samples forked from one state: the torch backend's tokens and log-probs."""
    m, d = published
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    twice = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=7, n=2)
    prompts = [([5, 9, 14, 20, 3, 7, 11], twice), ([30, 31, 2, 8, 11, 12, 40, 41, 13], greedy)]
    out = {}
    for backend in ("torch", "triton"):
        eng = LLMEngine(d, EngineConfig(**BASE, max_seq_len=m.max_seq_len, attention_backend=backend))
        if backend == "triton":
            eng.graphs = DecodeGraphs(eng.model, eng.kv, 8, num_sms=eng.num_sms, device=eng.device)
        runs = [eng.add_request(GenerateRequest(input_ids=p, sampling=s)) for p, s in prompts]
        for _ in range(3):
            eng.step()
        # Stale states in every slot no sequence holds: the joining one must start from zero.
        states = eng.kv.states
        assert states is not None
        held = {s.state_slot for s in eng.scheduler.running}
        stale = [i for i in range(states.slots) if i not in held]
        states.conv[:, stale], states.ssm[:, stale] = 1.0, 1.0
        runs.append(eng.add_request(GenerateRequest(input_ids=[3], sampling=greedy)))
        while not all(r.finished for r in runs):
            eng.step()
        if backend == "triton":
            assert eng.graphs is not None and eng.graphs.last_key is not None  # the graph path ran
        assert states.num_free == states.slots
        out[backend] = [c for r in runs for c in r.response().choices]
    assert len(out["torch"]) == 4
    for a, b in zip(out["torch"], out["triton"], strict=True):
        assert a.output_ids == b.output_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
