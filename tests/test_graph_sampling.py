"""The decode step on the device (cuda_graphs.DecodeGraphs with sample_in_graph): the graph feeds
pending tokens itself (kernels/feed.py), computes the logits and samples every row with the fused
sampler into its static result buffer. Under the Triton interpreter the graphs' body runs eagerly
(capture needs a GPU); everything around it is the engine's real path: overlap scheduling, the
choice between the graph's own sampling and the sampler on the graph's logits, the two pinned
result buffers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import triton_interp

# The kernels run under Triton's interpreter without CUDA (tests/helpers/triton_interp.py); if
# triton was imported too early for that, this file's tests skip and the child-process test runs them.
INTERPRET, IN_CHILD, needs_interpreter, triton_interpreter, test_graph_sampling_tests_in_child_process = (
    triton_interp.kernel_test_module(
        ("feed", "sampling", "paged_attention", "qk_rope", "ops.fused_norm", "gemv"), __file__
    )
)


from services.common.config import EngineConfig, load_config  # noqa: E402
from services.common.modeldir import hf_config  # noqa: E402
from services.common.schemas import GenerateRequest, SamplingParams  # noqa: E402
from services.common.weights_dir import write_model_dir  # noqa: E402
from services.engine import LLMEngine  # noqa: E402
from services.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from services.engine.kernels.feed import feed_tokens  # noqa: E402
from services.engine.layers.sampler import Sampler  # noqa: E402
from services.engine.models.causal_lm import CausalLM  # noqa: E402

DEVICE = torch.device("cpu" if INTERPRET else "cuda")


@needs_interpreter
def test_feed_tokens_takes_only_the_rows_with_a_source() -> None:
    ids = torch.arange(10, 310, dtype=torch.int64, device=DEVICE)  # 300 rows: two programs
    src = torch.full((300,), -1, dtype=torch.int64, device=DEVICE)
    src[[0, 7, 299]] = torch.tensor([2, 0, 1], device=DEVICE)
    prev = torch.tensor([1000, 1001, 1002], dtype=torch.int64, device=DEVICE)
    want = ids.clone()
    want[[0, 7, 299]] = torch.tensor([1002, 1000, 1001], device=DEVICE)
    feed_tokens(ids, src, prev)
    assert torch.equal(ids, want)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    m = load_config("debug").model
    torch.manual_seed(0)
    state = {k: v for k, v in CausalLM(m, m.max_seq_len).state_dict().items() if "rope" not in k}
    state["model.norm.weight"] = state["model.norm.weight"] * 0.02  # spread-out next-token distributions
    dest = tmp_path_factory.mktemp("gs") / "step_0"
    return write_model_dir(dest, state, hf_config(m, eos_token_id=0), None, {"version": 0})


def engine(path: Path, overlap: bool, graphs: bool) -> LLMEngine:
    cfg = EngineConfig(
        device=DEVICE.type,
        max_batch_size=8,
        max_seq_len=96,
        block_size=4,
        attention_backend="triton",
        cuda_graphs=False,  # installed by hand below: capture needs a GPU
        overlap_schedule=overlap,
    )
    eng = LLMEngine(path, cfg)
    eng.sampler = Sampler(fused=True)  # what the engine picks on CUDA
    if graphs:
        eng.graphs = DecodeGraphs(eng.model, eng.kv, 8, eng.num_sms, eng.device, sample_in_graph=True)
    return eng


def requests() -> list[GenerateRequest]:
    """Greedy and seeded rows (the graph samples them itself), then later a top-k row and one
    asking for top-n log-probs (the sampler takes the graph's logits for the whole batch)."""

    def req(prompt: list[int], **kw: object) -> GenerateRequest:
        return GenerateRequest(
            input_ids=prompt, sampling=SamplingParams(max_tokens=10, ignore_eos=True, **kw)
        )  # type: ignore[arg-type]

    return [
        req([5, 6, 7], temperature=0.0),
        req([10, 11, 12, 13, 14], seed=1),
        req([30, 31], seed=2, temperature=0.7),
    ]


def run(eng: LLMEngine, late: list[GenerateRequest]) -> tuple[list, list, list, list[float]]:
    """The three requests, then after a few decode steps two more (a prefill step between graph
    steps: the first graph step after it feeds from the sampler's tokens, not its own). Returns
    tokens, log-probs, top-n log-probs and each request's next RNG draw (one draw per sampled
    token, none for greedy, whichever route sampled it: a request's stream must not depend on it)."""
    states = [eng.add_request(r) for r in requests()]
    for _ in range(6):
        eng.step()
    states += [eng.add_request(r) for r in late]
    while eng.has_work():
        eng.step()
    eng.flush()
    outs = [s.response().choices[0] for s in states]
    rng = [s.seqs[0].rng.random() for s in states]
    return [o.output_ids for o in outs], [o.logprobs for o in outs], [o.top_logprobs for o in outs], rng


@needs_interpreter
@pytest.mark.parametrize("overlap", [True, False])
def test_decode_graph_sampling_gives_the_eager_fused_path(model_path: Path, overlap: bool) -> None:
    late = [
        GenerateRequest(
            input_ids=[40, 41, 42], sampling=SamplingParams(max_tokens=4, top_k=3, seed=5, ignore_eos=True)
        ),
        GenerateRequest(
            input_ids=[50, 51], sampling=SamplingParams(max_tokens=4, logprobs=2, seed=6, ignore_eos=True)
        ),
    ]
    ref = run(engine(model_path, overlap, graphs=False), late)
    eng = engine(model_path, overlap, graphs=True)
    graphs = eng.graphs
    assert graphs is not None
    seen = {"inside": 0, "logits": 0, "self_fed": 0, "fed_from_sampler": 0}
    run_graph, feeds_itself = graphs.run, graphs.feeds_itself

    def spy_run(hb, feed=None, sample=None):  # type: ignore[no-untyped-def]
        seen["inside" if sample is not None else "logits"] += 1
        return run_graph(hb, feed, sample)

    def spy_feeds(feed):  # type: ignore[no-untyped-def]
        inside = feeds_itself(feed)
        if feed is not None:
            seen["self_fed" if inside else "fed_from_sampler"] += 1
        return inside

    graphs.run, graphs.feeds_itself = spy_run, spy_feeds  # type: ignore[method-assign]
    got = run(eng, late)
    assert got[0] == ref[0]
    for a, b in zip(got[1], ref[1], strict=True):
        assert all(math.isclose(x, y, abs_tol=2e-5) for x, y in zip(a, b, strict=True))
    assert got[2][4] is not None and ref[2][4] is not None
    for a, b in zip(got[2][4], ref[2][4], strict=True):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert [v for _, v in a] == pytest.approx([v for _, v in b], abs=2e-5)
    # Sampled rows spread over several tokens (the check above would be weak on a peaked model).
    assert max(got[1][1]) < -0.1
    assert got[3][1:] == ref[3][1:]  # (request 0 is greedy with no seed: a random stream)
    # Both routes ran: the graph's own sampling, and the sampler on the graph's logits (top-k and
    # top-n rows); with overlap, pending tokens came both from the graph's buffer and the sampler's.
    assert seen["inside"] >= 3 and seen["logits"] >= 3
    if overlap:
        assert seen["self_fed"] >= 3 and seen["fed_from_sampler"] >= 1
    else:
        assert seen["self_fed"] == seen["fed_from_sampler"] == 0
