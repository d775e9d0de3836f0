"""The paged MLA decode kernels (services/engine/kernels/mla_decode.py) under the Triton interpreter
against plain torch: absorbed MLA over the latent pool, dense and DSA-sparse (top-k below the
context), rows of different lengths on shuffled pages with partial last pages, split into work
items and merged, and the DSA indexer's paged scoring and top-k."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import triton_interp

INTERPRET, IN_CHILD, needs_interpreter, triton_interpreter, test_kernel_tests_in_child_process = (
    triton_interp.kernel_test_module(("paged_attention", "mla_decode"), __file__)
)

from ops.topk import topk_first  # noqa: E402
from services.common.config import EngineConfig, load_config  # noqa: E402
from services.common.schemas import GenerateRequest, SamplingParams  # noqa: E402
from services.engine import LLMEngine  # noqa: E402
from services.engine.batch import (  # noqa: E402
    ForwardBatch,
    HostBatch,
    Span,
    capped,
    decode_layout,
    plan_decode,
)
from services.engine.cuda_graphs import padded_size  # noqa: E402
from services.engine.kernels.mla_decode import (  # noqa: E402
    index_scores,
    mla_decode,
    reference_mla_decode,
    select_topk,
    store_rows,
)
from trainer.model import build_model, save_weights_dir  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PAGE = 4
RANK, ROPE = 32, 8  # the debug configs' latent (rope padded to 16 inside the kernel)


def decode_batch(
    ctx: list[int], sms: int, heads: int, key_cap: int = 0, seed: int = 0
) -> tuple[HostBatch, ForwardBatch, int]:
    """One-token spans with contexts `ctx` on shuffled pages; returns the pool's row count too."""
    rng = np.random.default_rng(seed)
    n_pages = sum(-(-c // PAGE) for c in ctx) + 2
    free = list(rng.permutation(n_pages))
    spans = [Span([int(free.pop()) for _ in range(-(-c // PAGE))], c - 1, [1]) for c in ctx]
    hb = HostBatch.build(spans, PAGE)
    programs = -(-heads // 16)
    return hb, hb.to_forward_batch(DEV, programs, sms, key_cap), n_pages * PAGE


def tables(hb: HostBatch) -> list[list[int]]:
    return [hb.tables[i].tolist() for i in range(len(hb.ctx_lens))]


@needs_interpreter
@pytest.mark.parametrize("sms", [4, 64])  # 4: one program per row; 64: split rows and the merge
def test_dense_decode_matches_reference_float32(sms: int) -> None:
    ctx = [1, 7, 70, 133, 5]  # partial last pages; 133 keys split into several items at 64 SMs
    heads = 20  # two head blocks, the second partly masked
    hb, fb, rows = decode_batch(ctx, sms, heads)
    dec = fb.paged.decode  # type: ignore[union-attr]
    assert dec is not None and (dec.work is not None) == (sms == 64)
    torch.manual_seed(0)
    pool = torch.randn(rows, RANK + ROPE, device=DEV)
    q = torch.randn(len(ctx), heads, RANK + ROPE, device=DEV)
    scale = 24**-0.5
    out = mla_decode(q, pool, dec, scale, PAGE, RANK)
    ref = reference_mla_decode(q, pool, list(range(len(ctx))), ctx, tables(hb), scale, PAGE, RANK)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)


@needs_interpreter
def test_dense_decode_bfloat16_and_padding_rows_zero() -> None:
    ctx = [9, 40, 0]  # the last row is padding (context 0): zeros when padded
    hb, fb, rows = decode_batch(ctx[:2], 4, 4)
    dec = fb.paged.decode  # type: ignore[union-attr]
    assert dec is not None
    # A graph-style batch: one more query row than decode rows; padded output is zero there.
    torch.manual_seed(1)
    pool = torch.randn(rows, RANK + ROPE, device=DEV).bfloat16()
    q = torch.randn(3, 4, RANK + ROPE, device=DEV).bfloat16()
    out = mla_decode(q, pool, dec, 0.2, PAGE, RANK, padded=True)
    ref = reference_mla_decode(q, pool, [0, 1], ctx[:2], tables(hb), 0.2, PAGE, RANK)
    torch.testing.assert_close(out[:2].float().cpu(), ref, atol=2e-2, rtol=2e-2)
    assert torch.equal(out[2].float().cpu(), torch.zeros(4, RANK))


@needs_interpreter
@pytest.mark.parametrize("sms", [2, 64])  # 2: one program per row
def test_sparse_decode_attends_only_the_selected_keys(sms: int) -> None:
    topk = 80  # above one 64-key partition, so rows split at 64 SMs
    ctx = [5, 79, 300, 130]  # below, at and above top-k
    heads = 4
    hb, fb, rows = decode_batch(ctx, sms, heads, key_cap=topk, seed=2)
    dec = fb.paged.decode  # type: ignore[union-attr]
    assert dec is not None and (dec.work is not None) == (sms == 64)
    torch.manual_seed(2)
    pool = torch.randn(rows, RANK + ROPE, device=DEV)
    q = torch.randn(len(ctx), heads, RANK + ROPE, device=DEV)
    width = dec.block_tables.shape[1] * PAGE
    scores = torch.randn(len(ctx), width, device=DEV)
    scores[torch.arange(width, device=DEV)[None, :] >= torch.tensor(ctx, device=DEV)[:, None]] = float("-inf")
    idx = select_topk(scores, topk)
    keep = [sorted(topk_first(scores[i, :c][None], topk)[0].tolist()) for i, c in enumerate(ctx)]
    assert [sorted(idx[i, : min(c, topk)].tolist()) for i, c in enumerate(ctx)] == keep
    out = mla_decode(q, pool, dec, 0.3, PAGE, RANK, indices=idx)
    ref = reference_mla_decode(q, pool, list(range(len(ctx))), ctx, tables(hb), 0.3, PAGE, RANK, keep)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
    dense = reference_mla_decode(q, pool, list(range(len(ctx))), ctx, tables(hb), 0.3, PAGE, RANK)
    assert not torch.allclose(ref[2], dense[2])  # the long row really is sparse


@needs_interpreter
def test_index_scores_over_pages_match_the_indexer_formula() -> None:
    ctx = [3, 70, 17]
    hb, fb, rows = decode_batch(ctx, 4, 4, seed=3)
    dec = fb.paged.decode  # type: ignore[union-attr]
    assert dec is not None
    torch.manual_seed(3)
    hi, di = 5, 12  # padded to 16 x 16 in the kernel
    keys = torch.randn(rows, di, device=DEV)
    q = torch.randn(len(ctx), hi, di, device=DEV)
    w = torch.randn(len(ctx), hi, device=DEV)
    got = index_scores(q, w, keys, dec, di**-0.5, PAGE).cpu()
    width = dec.block_tables.shape[1] * PAGE
    assert got.shape == (len(ctx), width)
    for i, (c, table) in enumerate(zip(ctx, tables(hb), strict=True)):
        kk = keys[[table[p // PAGE] * PAGE + p % PAGE for p in range(c)]].cpu()
        want = (w[i, :, None].cpu() * torch.relu(q[i].cpu() @ kk.T * di**-0.5)).sum(0)
        torch.testing.assert_close(got[i, :c], want, atol=1e-5, rtol=1e-5)
        assert torch.isinf(got[i, c:]).all() and (got[i, c:] < 0).all()


@needs_interpreter
def test_store_rows_skips_negative_slots() -> None:
    pool = torch.zeros(8, 5, device=DEV)
    x = torch.arange(15, dtype=torch.float32, device=DEV).view(3, 5) + 1
    store_rows(x, pool, torch.tensor([6, -1, 2], device=DEV))
    want = torch.zeros(8, 5)
    want[6], want[2] = x[0].cpu(), x[2].cpu()
    assert torch.equal(pool.cpu(), want)


# ----------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module", params=["debug-kimi", "debug-glm5"])
def mla_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny DeepSeek-V3-architecture (Kimi) and GLM-5 (DSA, top-16) weights."""
    m = load_config(request.param).model
    state = build_model(m, seed=0, init_std=0.02).state_dict()  # spread-out next-token distributions
    return save_weights_dir(m, state, tmp_path_factory.mktemp(request.param) / "step_0", {"version": 0})


def engine_config(**over: Any) -> EngineConfig:
    base: dict[str, Any] = dict(
        device=DEV.type,
        max_batch_size=8,
        max_seq_len=160,
        block_size=4,
        max_num_batched_tokens=32,
        cuda_graphs=False,
        overlap_schedule=False,
    )
    return EngineConfig(**(base | over))


@needs_interpreter
def test_engine_triton_mla_matches_torch(mla_dir: Path) -> None:
    """Whole engine (chunked prefill through the expanded route, decode through the kernels,
    mixed steps, paging, seeded sampling): the Triton MLA backend gives the torch backend's tokens
    and float32 log-probs. GLM-5's contexts pass index_topk (16), so decode really is sparse."""
    prompts = [[3 + j % 50 for j in range(n)] for n in (5, 40, 1, 23)]
    reqs = [
        GenerateRequest(
            input_ids=p,
            sampling=SamplingParams(temperature=0.0 if i % 2 else 1.0, max_tokens=6, seed=i, ignore_eos=True),
        )
        for i, p in enumerate(prompts)
    ]
    # Short prompts alone: tables of at most 16 keys, where GLM-5's decode skips the indexer.
    short = [
        GenerateRequest(input_ids=[7, 9], sampling=SamplingParams(max_tokens=5, seed=5, ignore_eos=True)),
        GenerateRequest(input_ids=[4], sampling=SamplingParams(max_tokens=5, seed=6, ignore_eos=True)),
    ]
    out = {}
    for name in ("torch", "triton"):
        engine = LLMEngine(mla_dir, engine_config(attention_backend=name))
        assert engine.attention_backend == name
        out[name] = engine.generate(reqs) + engine.generate(short)
    for a, b in zip(out["torch"], out["triton"], strict=True):
        assert a.choices[0].output_ids == b.choices[0].output_ids
        assert a.choices[0].logprobs == pytest.approx(b.choices[0].logprobs, abs=1e-5)
    # Distributions spread enough that the log-probs say something (log 64 = 4.16 is uniform).
    assert min(lp for r in out["torch"] for lp in r.choices[0].logprobs) < -1.0


@needs_interpreter
def test_mla_graph_static_batch_matches_eager(mla_dir: Path) -> None:
    """The inputs a captured MLA decode graph runs on (static buffers, a padding row, the
    per-step work list over capped keys, the indexer over the captured table width) give the
    eager paged batch's hidden states; padding rows stay finite."""
    from services.engine.cuda_graphs import DecodeGraphs

    engine = LLMEngine(mla_dir, engine_config(attention_backend="triton"))
    for i, n in enumerate((5, 130, 17)):  # 131 keys: more than one 64-key item
        engine.add_request(
            GenerateRequest(input_ids=[3 + j % 50 for j in range(n)], sampling=SamplingParams(seed=i))
        )
    while engine.num_waiting or any(s.num_cached < len(s.prompt) for s in engine.scheduler.running):
        engine.step()
    plan = engine.scheduler.schedule()
    spans = [Span(s.block_table, s.num_cached, s.uncached_tokens()[:n]) for s, n in plan.compute]
    hb = HostBatch.build(spans, 4, engine.block_tables)
    assert hb.decode_only and len(spans) == 3
    programs, cap = decode_layout(engine.model_config)
    eager = engine.model(hb.to_forward_batch(engine.device, programs, 64, cap), engine.kv)
    graphs = DecodeGraphs(engine.model, engine.kv, 8, num_sms=64, device=engine.device)
    size = padded_size(len(spans), graphs.sizes)
    assert size == 4  # a padding row
    plan_ = plan_decode(capped(hb.ctx_lens, cap), np.arange(len(spans)), programs, 64)
    # GLM-5's rows attend at most 16 selected keys: one program per row, no work list.
    assert (plan_ is None) == bool(cap)
    assert plan_ is None or len(plan_.item_row) < graphs.capacity[size]
    for p in (plan_, None) if plan_ is not None else (None,):
        graphs.buf.fill(hb, size, p, graphs.capacity[size])
        static = engine.model(graphs.static_batch(size, p is not None), engine.kv)
        assert torch.isfinite(static).all()
        torch.testing.assert_close(static[: len(spans)], eager, atol=1e-5, rtol=1e-5)


def test_mla_backend_resolution(mla_dir: Path) -> None:
    # CPU: auto keeps the torch path.
    engine = LLMEngine(mla_dir, engine_config())
    assert engine.attention_backend == "torch"
    m = load_config("debug-kimi").model
    assert decode_layout(m) == (1, 0) and decode_layout(load_config("debug-glm5").model) == (1, 16)
    assert decode_layout(load_config("glm5").model) == (4, 2048)


def test_triton_refuses_a_latent_width_it_cannot_tile(tmp_path: Path) -> None:
    m = load_config("debug-kimi").model.model_copy(update={"kv_lora_rank": 24})
    d = save_weights_dir(m, build_model(m, seed=0).state_dict(), tmp_path / "step_0", {"version": 0})
    with pytest.raises(ValueError, match="power-of-two kv_lora_rank"):
        LLMEngine(d, engine_config(attention_backend="triton"))
