"""The engine's GPU path on CPU: Triton paged-attention kernels under the Triton interpreter against
a plain torch reference, the paged batch builder against the torch path's, the CUDA-graph ladder and
input padding, and the whole engine with attention_backend="triton" against the torch backend."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import triton_interp

# The kernels run under Triton's interpreter without CUDA (tests/helpers/triton_interp.py); if
# triton was imported too early for that, this file's tests skip and test_kernel_tests_in_child_process
# runs them in a child process.
INTERPRET, IN_CHILD, needs_interpreter, triton_interpreter, test_kernel_tests_in_child_process = (
    triton_interp.kernel_test_module(("paged_attention", "qk_rope"), __file__)
)


from pydantic import ValidationError  # noqa: E402

from services.common.config import EngineConfig, load_config  # noqa: E402
from services.common.schemas import GenerateRequest, SamplingParams  # noqa: E402
from services.engine import LLMEngine  # noqa: E402
from services.engine.batch import (  # noqa: E402
    BlockTables,
    DecodePlan,
    ForwardBatch,
    HostBatch,
    Span,
    item_capacity,
    plan_decode,
)
from services.engine.cuda_graphs import (  # noqa: E402
    InputBuffers,
    MixedBuffers,
    ladder,
    padded_size,
    token_ladder,
)
from services.engine.kernels.paged_attention import (  # noqa: E402
    paged_attention,
    reference_attention,
    store_kv,
)
from trainer.model import build_model, save_weights_dir  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_spans(
    shapes: list[tuple[int, int]], page: int, n_pages: int, seed: int = 0
) -> tuple[list[Span], list[int]]:
    """Spans (start, n new tokens) whose pages are drawn at random from the pool, so a kernel that
    assumed contiguous pages would read the wrong keys. Returns the spans and the unused pages."""
    rng = random.Random(seed)
    free = list(range(n_pages))
    rng.shuffle(free)
    spans = []
    for start, n in shapes:
        table = [free.pop() for _ in range(-(-(start + n) // page))]
        spans.append(Span(table, start, [rng.randrange(50) for _ in range(n)]))
    return spans, free


def run_kernels(
    shapes: list[tuple[int, int]],
    h: int,
    h_kv: int,
    d: int,
    page: int,
    dtype: torch.dtype,
    sms: int = 4,
) -> tuple[torch.Tensor, torch.Tensor, HostBatch, ForwardBatch]:
    torch.manual_seed(0)
    n_pages = sum(-(-(s + n) // page) for s, n in shapes) + 3
    spans, _ = make_spans(shapes, page, n_pages)
    kc = torch.randn(n_pages * page, h_kv, d, device=DEV).to(dtype)
    vc = torch.randn(n_pages * page, h_kv, d, device=DEV).to(dtype)
    hb = HostBatch.build(spans, page)
    fb = hb.to_forward_batch(DEV, h_kv, sms)
    t = len(hb.ids)
    q = torch.randn(t, h, d, device=DEV).to(dtype)
    k = torch.randn(t, h_kv, d, device=DEV).to(dtype)
    v = torch.randn(t, h_kv, d, device=DEV).to(dtype)
    out = paged_attention(q, k, v, kc, vc, fb.slot_mapping, fb.paged, d**-0.5, page)  # type: ignore[arg-type]
    # The kernels stored this step's k/v first: the reference reads the same cache.
    assert torch.equal(kc[fb.slot_mapping], k) and torch.equal(vc[fb.slot_mapping], v)
    tables = [s.block_table for s in spans]
    ref = reference_attention(
        q.cpu(), kc.cpu(), vc.cpu(), hb.q_start.tolist(), hb.q_lens.tolist(), hb.ctx_lens.tolist(),
        tables, d**-0.5, page,
    )  # fmt: skip
    return out.float().cpu(), ref, hb, fb


@needs_interpreter
def test_decode_kernel_splits_and_gqa_float32() -> None:
    # Contexts from 1 key to several partitions; G = 4 query heads per KV head.
    shapes = [(0, 1), (5, 1), (63, 1), (64, 1), (200, 1), (130, 1)]
    # 64 SMs for 6 x 2 (sequence, KV head) pairs: 64-key partitions, 1+1+1+2+4+3 items; the
    # one-item rows are written by the decode kernel, the others by the merge kernel.
    out, ref, _, fb = run_kernels(shapes, h=8, h_kv=2, d=16, page=4, dtype=torch.float32, sms=64)
    assert fb.paged is not None and fb.paged.decode is not None and fb.paged.prefill is None
    work = fb.paged.decode.work
    assert work is not None
    assert work.item_row.tolist() == [0, 1, 2, 3, 3, 4, 4, 4, 4, 5, 5, 5]
    assert work.item_start.tolist() == [0, 0, 0, 0, 64, 0, 64, 128, 192, 0, 64, 128]
    assert work.item_end.tolist() == [1, 6, 64, 64, 65, 64, 128, 192, 201, 64, 128, 131]
    assert work.item_merge.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    assert torch.equal(work.item_qloc, fb.paged.decode.q_loc[work.item_row])
    assert work.row_first.tolist() == [0, 1, 2, 3, 5, 9] and work.row_items.tolist() == [1, 1, 1, 2, 4, 3]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@needs_interpreter
def test_partials_are_read_only_where_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """One long row cut into items beside short rows of one item each (written directly, no
    partials): with the partials' buffer full of NaN (what a reused allocation may hold), every
    output is still the reference's, so the merge reads only the long row's items."""
    from services.engine.kernels import paged_attention as pa

    real_empty = torch.empty

    def nan_empty(*args: object, **kw: object) -> torch.Tensor:
        t = real_empty(*args, **kw)  # type: ignore[call-overload]
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(pa.torch, "empty", nan_empty)
    shapes = [(3, 1), (250, 1), (9, 1), (0, 1)]  # one long row, short ones
    out, ref, _, fb = run_kernels(shapes, h=4, h_kv=2, d=16, page=4, dtype=torch.float32, sms=64)
    assert fb.paged is not None and fb.paged.decode is not None
    work = fb.paged.decode.work
    assert work is not None and work.item_row.tolist() == [0, 1, 1, 1, 1, 2, 3]
    rows = [0, 1, 2]  # the padding row (context 0) has no output to compare
    assert torch.isfinite(out[rows]).all()
    torch.testing.assert_close(out[rows], ref[rows], atol=1e-5, rtol=1e-5)


@needs_interpreter
def test_merge_of_a_row_with_more_partials_than_one_chunk() -> None:
    """A row cut into more items than the merge kernel takes in one shot (MERGE_CHUNK): the rest
    are combined in its loop, with a running max."""
    from services.engine.kernels.paged_attention import MERGE_CHUNK

    shapes = [(64 * (MERGE_CHUNK + 9) - 1, 1), (5, 1)]
    out, ref, _, fb = run_kernels(shapes, h=4, h_kv=2, d=16, page=16, dtype=torch.float32, sms=64)
    assert fb.paged is not None and fb.paged.decode is not None and fb.paged.decode.work is not None
    assert fb.paged.decode.work.row_items.tolist() == [MERGE_CHUNK + 9, 1]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("block_n", [32, 128])
def test_decode_kernel_other_tiles(block_n: int) -> None:
    """A tile that does not match the 64-key partitions (the benchmark tries such settings)."""
    from services.engine.kernels.paged_attention import decode_attention

    shapes = [(0, 1), (70, 1), (150, 1)]
    _, _, hb, fb = run_kernels(shapes, h=4, h_kv=2, d=16, page=4, dtype=torch.float32, sms=64)
    assert fb.paged is not None and fb.paged.decode is not None and fb.paged.decode.work is not None
    # Fresh inputs on the same batch layout (block tables, work list).
    torch.manual_seed(1)
    n_pages = sum(-(-(s + n) // 4) for s, n in shapes) + 3
    kc = torch.randn(n_pages * 4, 2, 16, device=DEV)
    vc = torch.randn(n_pages * 4, 2, 16, device=DEV)
    q = torch.randn(len(shapes), 4, 16, device=DEV)
    out = torch.empty_like(q)
    decode_attention(q, kc, vc, out, fb.paged.decode, 16**-0.5, 4, {"block_n": block_n})
    tables = [hb.tables[i, : -(-int(c) // 4)].tolist() for i, c in enumerate(hb.ctx_lens)]
    want = reference_attention(
        q.cpu(), kc.cpu(), vc.cpu(), hb.q_start.tolist(), hb.q_lens.tolist(), hb.ctx_lens.tolist(), tables,
        16**-0.5, 4,
    )  # fmt: skip
    torch.testing.assert_close(out.cpu(), want, atol=1e-5, rtol=1e-5)


@needs_interpreter
def test_decode_kernel_single_split_bfloat16() -> None:
    # 16 sequences x 2 KV heads fill the (interpreter's) 4 SMs: one split, no merge.
    shapes = [(i * 13 % 150, 1) for i in range(16)]
    out, ref, _, fb = run_kernels(shapes, h=4, h_kv=2, d=32, page=16, dtype=torch.bfloat16)
    assert fb.paged is not None and fb.paged.decode is not None
    assert fb.paged.decode.work is None
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@needs_interpreter
def test_prefill_kernel_chunks_and_causality() -> None:
    # A fresh prompt longer than one query block, a chunk after a cached prefix, a short prompt.
    shapes = [(0, 70), (40, 9), (0, 2)]
    out, ref, _, fb = run_kernels(shapes, h=4, h_kv=1, d=16, page=4, dtype=torch.float32)
    assert fb.paged is not None and fb.paged.prefill is not None and fb.paged.decode is None
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@needs_interpreter
def test_mixed_step_decode_and_prefill() -> None:
    shapes = [(10, 1), (0, 5), (33, 1), (7, 12)]
    out, ref, _, fb = run_kernels(shapes, h=4, h_kv=2, d=16, page=8, dtype=torch.float32)
    assert fb.paged is not None and fb.paged.decode is not None and fb.paged.prefill is not None
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("qk_norm", [True, False])
def test_fused_qk_norm_rope_store_matches_torch(qk_norm: bool) -> None:
    """One kernel = the torch path's q/k RMSNorm (Qwen3; absent for Llama), RoPE and cache writes."""
    from services.engine.kernels.qk_rope import qk_rope_store
    from services.engine.layers.norm import RMSNorm
    from services.engine.layers.rope import apply_rope, rope_cache

    torch.manual_seed(0)
    t, h, h_kv, d = 5, 4, 2, 16
    cos_t, sin_t = rope_cache(d, 64, 10000.0)
    pos = torch.tensor([0, 7, 8, 30, 63])
    cos, sin = cos_t[pos].to(DEV), sin_t[pos].to(DEV)
    qkv = torch.randn(t, (h + 2 * h_kv) * d, device=DEV)  # one projection output, sliced: strided views
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + h_kv) * d].view(t, h_kv, d)
    v = qkv[:, (h + h_kv) * d :].view(t, h_kv, d)
    qn, kn = RMSNorm(d, 1e-6).to(DEV), RMSNorm(d, 1e-6).to(DEV)
    with torch.no_grad():
        qn.weight.uniform_(0.5, 1.5)
        kn.weight.uniform_(0.5, 1.5)
    kc, vc = torch.zeros(40, h_kv, d, device=DEV), torch.zeros(40, h_kv, d, device=DEV)
    slots = torch.tensor([3, 17, -1, 0, 39], device=DEV)
    with torch.no_grad():
        got = qk_rope_store(
            q,
            k,
            v,
            cos,
            sin,
            qn.weight if qk_norm else None,
            kn.weight if qk_norm else None,
            1e-6,
            kc,
            vc,
            slots,
        )
        qr, kr = (qn(q), kn(k)) if qk_norm else (q, k)
        want_q, want_k = apply_rope(qr, cos, sin), apply_rope(kr, cos, sin)
    torch.testing.assert_close(got, want_q, atol=1e-5, rtol=1e-5)
    keep = slots >= 0
    torch.testing.assert_close(kc[slots[keep]], want_k[keep], atol=1e-5, rtol=1e-5)
    assert torch.equal(vc[slots[keep]], v[keep])
    written = torch.zeros(40, dtype=torch.bool, device=DEV)
    written[slots[keep]] = True
    assert kc[~written].abs().sum() == 0 and vc[~written].abs().sum() == 0  # slot -1 wrote nothing


@needs_interpreter
def test_store_kv_skips_negative_slots() -> None:
    kc = torch.zeros(8, 2, 16, device=DEV)
    vc = torch.zeros(8, 2, 16, device=DEV)
    k = torch.randn(3, 2, 16, device=DEV)
    v = torch.randn(3, 2, 16, device=DEV)
    store_kv(k, v, kc, vc, torch.tensor([5, -1, 0], device=DEV))
    assert torch.equal(kc[5], k[0]) and torch.equal(vc[0], v[2])
    # Row -1 wrote nothing (torch indexing would have wrapped it to row 7).
    assert kc[[1, 2, 3, 4, 6, 7]].abs().sum() == 0 and vc[7].abs().sum() == 0


def test_host_batch_matches_torch_builder() -> None:
    """Positions, slots and last rows of the paged builder equal the torch path's."""
    spans, _ = make_spans([(0, 9), (17, 1), (3, 4), (40, 1)], page=4, n_pages=40)
    hb = HostBatch.build(spans, 4)
    fb = hb.to_forward_batch(torch.device("cpu"), 2, 4)
    ref = ForwardBatch.build(spans, torch.device("cpu"), 64, 4)
    for a, b in [
        (fb.input_ids, ref.input_ids),
        (fb.positions, ref.positions),
        (fb.slot_mapping, ref.slot_mapping),
        (fb.last_index, ref.last_index),
    ]:
        assert a.tolist() == b.tolist()
    assert not hb.decode_only
    assert HostBatch.build([spans[1], spans[3]], 4).decode_only


def test_block_tables_cache_follows_growth_replacement_and_eviction() -> None:
    """The persistent host copy always equals a fresh conversion of the tables it is given."""
    cache = BlockTables(width=6, rows=2)

    def check(tables: list[list[int]]) -> None:
        got = cache.gather(tables)
        want = np.zeros((len(tables), max(1, *(len(t) for t in tables))), np.int64)
        for i, t in enumerate(tables):
            want[i, : len(t)] = t
        assert got.tolist() == want.tolist()

    a, b, c = [3, 4], [7], [9, 1, 2]
    check([a, b])
    a.append(5)  # a decode step crossed a page boundary
    check([a, b])
    check([a, b, c])  # more tables than rows: the copy grows
    b = [8, 2]  # preempted and readmitted: a new list
    check([b, a])
    a[-1] = 6  # an in-place edit of the last page (the scheduler does not do this): caught
    a.append(0)
    check([a])  # b and c dropped: their rows are reused
    d, e = [11, 12, 13], [14]
    check([d, e, a])
    assert len(cache.entries) == 3
    with pytest.raises(ValueError, match="width"):
        cache.gather([list(range(7))])


def test_host_batch_with_cache_matches_without() -> None:
    spans, _ = make_spans([(0, 9), (17, 1), (3, 4), (40, 1)], page=4, n_pages=40)
    cache = BlockTables(width=16)
    for _ in range(2):
        a, b = HostBatch.build(spans, 4, cache), HostBatch.build(spans, 4)
        for name in ("ids", "positions", "slots", "q_start", "q_lens", "ctx_lens", "tables"):
            assert getattr(a, name).tolist() == getattr(b, name).tolist(), name


def test_plan_decode() -> None:
    # A large batch of short rows fills the GPU alone: one program per row, no merge.
    assert plan_decode(np.full(256, 1536), np.arange(256), 8, 132) is None
    # Batch 1: the context cut into 64-key items, enough programs to fill the GPU.
    one = plan_decode(np.array([1536]), np.array([7]), 8, 132)
    assert one is not None and one.partition == 64 and len(one.item_row) == 24
    assert one.item_start.tolist() == list(range(0, 1536, 64)) and one.row_first.tolist() == [0]
    assert one.item_qloc.tolist() == [7] * 24  # every item reads and writes its row's query
    assert one.item_end.tolist() == list(range(64, 1537, 64)) and one.item_merge.tolist() == [1] * 24
    # A 16k row beside 63 short ones: only the long row is split.
    mixed = plan_decode(np.array([16384] + [600] * 63), np.arange(64), 8, 132)
    assert mixed is not None and mixed.partition == 896
    assert (mixed.item_row == 0).sum() == 19 and len(mixed.item_row) == 19 + 63
    assert len(mixed.item_row) <= item_capacity(64, 8, 132) == 128
    # Any contexts: the items cover each row's context exactly, consecutively, within capacity.
    rng = np.random.default_rng(0)
    for _ in range(200):
        b = int(rng.integers(1, 300))
        ctx = rng.integers(0, 40000, b) * (rng.random(b) < 0.9)  # some padding rows (0)
        ctx[0] = max(ctx[0], 1)
        q_loc = rng.permutation(b)
        plan = plan_decode(ctx, q_loc, int(rng.choice([1, 2, 8])), int(rng.choice([4, 132])))
        if plan is None:
            continue
        p = plan.partition
        assert p % 64 == 0
        n = np.bincount(plan.item_row, minlength=b)
        assert (n * p >= ctx).all() and ((n - 1) * p < np.maximum(ctx, 1)).all()
        assert (n[ctx == 0] == 0).all() and (plan.row_items == n).all()
        assert (plan.row_first == np.cumsum(n) - n).all()
        # each row's items tile [0, ctx) in order, in partitions of p keys
        split = np.arange(len(plan.item_row)) - plan.row_first[plan.item_row]
        assert (plan.item_start == split * p).all()
        assert (plan.item_end == np.minimum(plan.item_start + p, ctx[plan.item_row])).all()
        assert (plan.item_merge == (n[plan.item_row] > 1)).all()
        assert (plan.item_qloc == q_loc[plan.item_row]).all()


def test_plan_decode_stays_within_capacity() -> None:
    rng = np.random.default_rng(1)
    for _ in range(300):
        b, n_kv, sms = int(rng.integers(1, 300)), int(rng.choice([1, 2, 4, 8])), int(rng.choice([4, 132]))
        ctx = rng.integers(0, 1 << int(rng.integers(1, 17)), b)
        plan = plan_decode(ctx, np.arange(b), n_kv, sms)
        if plan is not None:
            assert len(plan.item_row) <= item_capacity(b, n_kv, sms)
            assert plan.partition < int(ctx.max())  # else one program per row would do


def test_ladder_and_padding() -> None:
    assert ladder(256) == [1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256]
    assert ladder(1) == [1]
    assert ladder(40) == [1, 2, 4, 8, 16, 32, 40]
    assert ladder(16) == [1, 2, 4, 8, 16]
    sizes = ladder(100)
    assert sizes[-1] == 100
    assert [padded_size(n, sizes) for n in (1, 3, 16, 17, 33, 65, 97, 100, 101)] == [
        1, 4, 16, 32, 64, 96, 100, 100, None,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="max_batch"):
        ladder(0)


def test_graph_input_buffers_pad_rows() -> None:
    buf = InputBuffers(max_batch=8, width=5, capacity=12, device=torch.device("cpu"))
    spans, _ = make_spans([(3, 1), (9, 1), (0, 1)], page=4, n_pages=20)
    hb = HostBatch.build(spans, 4)
    assert (
        plan_decode(np.array([4, 10, 1]), np.arange(3), 1, 2) is None
    )  # every row fits one 64-key partition
    # A hand-made plan with 4-key partitions (the buffers take any plan).
    plan = DecodePlan(
        4, np.array([0, 1, 1, 1, 2]), np.array([0, 1, 1, 1, 2]), np.array([0, 0, 4, 8, 0]), np.array([4, 4, 8, 10, 1]),
        np.array([0, 1, 1, 1, 0]), np.array([0, 1, 4]), np.array([1, 3, 1]),
    )  # fmt: skip
    buf.fill(hb, 4, plan, capacity=7)
    assert buf.ids[:3].tolist() == hb.ids.tolist()
    assert buf.slots[:4].tolist() == [*hb.slots.tolist(), -1]  # padding row stores nothing
    assert buf.ctx[:4].tolist() == [4, 10, 1, 0]  # and reads nothing
    assert buf.tables[1, :3].tolist() == spans[1].block_table
    work = buf.work.work(4, 7)
    assert work.item_row.tolist() == [0, 1, 1, 1, 2, -1, -1]  # spare items: unused programs
    assert work.item_end[:5].tolist() == [4, 4, 8, 10, 1] and work.row_first[:3].tolist() == [0, 1, 4]
    assert work.row_items.tolist() == [1, 3, 1, 0]  # the padding row has no items
    # A smaller batch next step turns the previous rows into padding again.
    buf.fill(HostBatch.build(spans[:1], 4), 2, None, capacity=5)
    assert buf.slots[:2].tolist() == [hb.slots[0], -1] and buf.ctx[:2].tolist() == [4, 0]
    with pytest.raises(ValueError, match="width"):
        buf.fill(HostBatch.build(make_spans([(30, 1)], 4, 20)[0], 4), 1, None, 5)


def test_mixed_buffers_block_list_and_padding() -> None:
    """A mixed step's fixed-shape inputs: decodes keep their rows, prefill spans' query blocks are
    listed (span, block within span), and every unused decode row, token row and grid program is
    padding (query row -1, slot -1, span -1)."""
    assert token_ladder(8192) == [64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
    assert (
        token_ladder(100) == [64, 100]
        and token_ladder(64) == [64]
        and token_ladder(300) == [64, 128, 192, 256, 300]
    )
    buf = MixedBuffers(
        [16, 32],
        max_decode=4,
        max_prefill=2,
        width=8,
        block_m=4,
        n_kv_heads=2,
        num_sms=4,
        device=torch.device("cpu"),
    )
    spans, _ = make_spans([(3, 1), (0, 9), (9, 1), (4, 5)], page=4, n_pages=30)
    hb = HostBatch.build(spans, 4)
    size = buf.fits(hb)
    assert size == 16  # 1 + 9 + 1 + 5 tokens
    plan = DecodePlan(
        4, np.array([0, 1, 1, 1]), np.array([0, 10, 10, 10]), np.array([0, 0, 4, 8]), np.array([4, 4, 8, 10]),
        np.array([0, 1, 1, 1]), np.array([0, 1]), np.array([1, 3]),
    )  # fmt: skip
    last = buf.fill(hb, 16, plan)
    h = buf.h
    assert buf.capacity(16) == item_capacity(4, 2, 4) == 8
    assert h["item_row"][:8].tolist() == [0, 1, 1, 1, -1, -1, -1, -1]
    assert h["row_items"].tolist() == [1, 3, 0, 0]  # rows past the plan's: no items
    assert h["ids"][:16].tolist() == hb.ids.tolist() and (h["slots"][16:32] == -1).all()
    assert h["dec_qloc"][:4].tolist() == [0, 10, -1, -1] and h["dec_ctx"][:4].tolist() == [4, 10, 0, 0]
    assert h["pre_qstart"].tolist() == [1, 11] and h["pre_qlens"].tolist() == [9, 5]
    # 9 queries in blocks of 4: 3 blocks of span 0; 5 queries: 2 blocks of span 1; the rest unused.
    nb = buf.num_blocks(16)
    assert h["blocks"][0, :nb].tolist() == [0, 0, 0, 1, 1, -1]
    assert h["blocks"][1, :5].tolist() == [0, 1, 2, 0, 1]
    assert last.tolist() == (hb.q_start + hb.q_lens - 1).tolist()
    # Too many prompt chunks, too many tokens, or a table wider than captured: no graph.
    assert buf.fits(HostBatch.build(make_spans([(0, 2)] * 3, 4, 30)[0], 4)) is None
    assert buf.fits(HostBatch.build(make_spans([(0, 33)], 4, 30)[0], 4)) is None
    assert buf.fits(HostBatch.build(make_spans([(0, 40)], 4, 30)[0], 4)) is None


def test_attention_backend_config() -> None:
    assert EngineConfig().attention_backend == "auto"
    with pytest.raises(ValidationError, match="attention_backend"):
        EngineConfig(attention_backend="flash")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="attention_backend"):
        EngineConfig(attention_backend="flex")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="cuda_graph_max_batch_size"):
        EngineConfig(cuda_graph_max_batch_size=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    m = load_config("debug").model
    state = build_model(m, seed=0).state_dict()
    state["norm.weight"] = state["norm.weight"] * 0.3  # spread-out next-token distributions
    return save_weights_dir(m, state, tmp_path_factory.mktemp("kern") / "step_0", {"version": 0})


@needs_interpreter
def test_engine_backend_matches_torch(model_dir: Path) -> None:
    """Whole engine (chunked prefill, mixed and decode-only steps, paging, seeded sampling): the
    paged backend gives the torch backend's tokens and log-probs."""
    # On a GPU machine: the compiled kernels, eagerly (no graphs), against the torch backend.
    base = dict(
        device=DEV.type,
        max_batch_size=8,
        max_seq_len=96,
        block_size=4,
        max_num_batched_tokens=24,
        cuda_graphs=False,
    )
    prompts = [list(range(3, 3 + n)) for n in (5, 30, 1, 17)]
    reqs = [
        GenerateRequest(
            input_ids=p,
            sampling=SamplingParams(temperature=0.0 if i % 2 else 1.0, max_tokens=8, seed=i, ignore_eos=True),
        )
        for i, p in enumerate(prompts)
    ]
    out = {}
    for name in ("torch", "triton"):
        engine = LLMEngine(model_dir, EngineConfig(**base, attention_backend=name))  # type: ignore[arg-type]
        assert engine.attention_backend == name and engine.graphs is None
        out[name] = engine.generate(reqs)
    for a, b in zip(out["torch"], out["triton"], strict=True):
        assert a.choices[0].output_ids == b.choices[0].output_ids
        assert a.choices[0].logprobs == pytest.approx(b.choices[0].logprobs, abs=1e-4)


@needs_interpreter
def test_graph_static_batch_matches_eager_paged_batch(model_dir: Path) -> None:
    """The inputs a captured decode graph runs on (static buffers, padding rows, the per-step
    partition) give the eager paged batch's hidden states. Only capture/replay itself needs a GPU."""
    from services.engine.cuda_graphs import DecodeGraphs

    cfg = EngineConfig(
        device=DEV.type,
        max_batch_size=8,
        max_seq_len=96,
        block_size=4,
        attention_backend="triton",
        cuda_graphs=False,
        overlap_schedule=False,  # (auto: on with CUDA) every scheduled token on the host
    )
    engine = LLMEngine(model_dir, cfg)
    for i, n in enumerate((5, 90, 17)):  # 91 keys: more than one 64-key item
        engine.add_request(
            GenerateRequest(input_ids=[3 + j % 60 for j in range(n)], sampling=SamplingParams(seed=i))
        )
    while engine.num_waiting or any(s.num_cached < len(s.prompt) for s in engine.scheduler.running):
        engine.step()
    plan = engine.scheduler.schedule()
    spans = [Span(s.block_table, s.num_cached, s.uncached_tokens()[:n]) for s, n in plan.compute]
    hb = HostBatch.build(spans, 4, engine.block_tables)
    assert hb.decode_only and len(spans) == 3
    eager = engine.model(hb.to_forward_batch(engine.device, 2, engine.num_sms), engine.kv)
    graphs = DecodeGraphs(engine.model, engine.kv, 8, num_sms=64, device=engine.device)
    size = padded_size(len(spans), graphs.sizes)
    assert size == 4  # a padding row
    # Both graphs of the size: the ragged work list (spare items unused) and one program per row.
    plan = plan_decode(hb.ctx_lens, np.arange(len(spans)), engine.model.config.n_kv_heads, 64)
    assert plan is not None and len(plan.item_row) < graphs.capacity[size]
    for p in (plan, None):
        graphs.buf.fill(hb, size, p, graphs.capacity[size])
        static = engine.model(graphs.static_batch(size, p is not None), engine.kv)
        torch.testing.assert_close(static[: len(spans)], eager, atol=1e-5, rtol=1e-5)


@needs_interpreter
def test_mixed_graph_static_batch_matches_eager_paged_batch(model_dir: Path) -> None:
    """What a captured mixed-step graph runs on (cuda_graphs.MixedBuffers: padded token rows,
    padded decode rows, the prefill kernel's fixed grid over a block list) gives the eager paged
    batch's hidden states for decodes next to prompt chunks of several query blocks."""
    from services.engine.cuda_graphs import MixedGraphs

    cfg = EngineConfig(
        device=DEV.type,
        max_batch_size=8,
        max_seq_len=192,
        block_size=4,
        attention_backend="triton",
        cuda_graphs=False,
        overlap_schedule=False,  # (auto: on with CUDA) every scheduled token on the host
    )
    engine = LLMEngine(model_dir, cfg)
    for i, n in enumerate((5, 80)):  # 81 keys: more than one 64-key decode item
        engine.add_request(
            GenerateRequest(input_ids=[3 + j % 60 for j in range(n)], sampling=SamplingParams(seed=i))
        )
    while engine.num_waiting or any(s.num_cached < len(s.prompt) for s in engine.scheduler.running):
        engine.step()
    for i, n in enumerate((70, 9)):  # 70 queries: two blocks of 64
        engine.add_request(
            GenerateRequest(
                input_ids=[(5 + j) % 60 + 2 for j in range(n)], sampling=SamplingParams(seed=9 + i)
            )
        )
    plan = engine.scheduler.schedule()
    spans = [Span(s.block_table, s.num_cached, s.uncached_tokens()[:n]) for s, n in plan.compute]
    hb = HostBatch.build(spans, 4, engine.block_tables)
    assert sorted(hb.q_lens.tolist()) == [1, 1, 9, 70]
    eager = engine.model(hb.to_forward_batch(engine.device, 2, engine.num_sms), engine.kv)
    graphs = MixedGraphs(engine.model, engine.kv, 256, 8, 4, num_sms=64, device=engine.device)
    size = graphs.buf.fits(hb)
    assert size == 128
    dec = hb.q_lens == 1
    plan = plan_decode(hb.ctx_lens[dec], hb.q_start[dec], engine.model.config.n_kv_heads, 64)
    assert plan is not None
    for p in (plan, None):
        last = graphs.buf.fill(hb, size, p)
        static = engine.model(graphs.buf.static_batch(size, p is not None), engine.kv)
        assert static.shape[0] == 128 and torch.isfinite(static).all()  # padding rows stay finite
        torch.testing.assert_close(static[: len(hb.ids)], eager, atol=1e-5, rtol=1e-5)
        assert last.tolist() == (hb.q_start + hb.q_lens - 1).tolist()


def test_backend_auto_resolution(model_dir: Path) -> None:
    # CPU: the torch path, bit for bit what it was (no paged kernels, no graphs).
    engine = LLMEngine(model_dir, EngineConfig(device="cpu", max_seq_len=64))
    assert engine.attention_backend == "torch" and engine.graphs is None
