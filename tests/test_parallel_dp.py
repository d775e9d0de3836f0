"""Rank 0's scheduling for data-parallel attention (services/engine/parallel/dp.py), in-process: which
attention group a request goes to (the longest cached prompt prefix, then the least outstanding
work), the groups' plans side by side, pages and routing of a group rank 0 does not hold. The
engine over gloo ranks with these groups is tests/test_parallel_engine.py (the `-dp2` cases)."""

from __future__ import annotations

import torch
from helpers.parallel import tiny_moe

from services.common.schemas import GenerateRequest, SamplingParams
from services.engine.kv_cache import KVCache
from services.engine.parallel.dp import GroupedScheduler, group_pages
from services.engine.sequence import RequestState, Status
from services.engine.stats import EngineStats

M = tiny_moe(64)
BS = 4


def grouped(groups: int = 2, pages: int = 16, batch: int = 8) -> GroupedScheduler:
    own = KVCache.for_model(M, pages, BS, 64, torch.float32, torch.device("cpu"))
    pools = [own] + [group_pages(M, pages, BS, 64) for _ in range(1, groups)]
    return GroupedScheduler(pools, batch, 64, True, EngineStats())


def request(rid: str, prompt: list[int], n: int = 1, max_tokens: int = 6) -> RequestState:
    sampling = SamplingParams(temperature=0.0, n=n, max_tokens=max_tokens, ignore_eos=True)
    return RequestState(rid, GenerateRequest(request_id=rid, input_ids=prompt, sampling=sampling))


def run_step(s: GroupedScheduler) -> list[int]:
    """Schedule one step and account for it as LLMEngine.advance and commit do (every sequence
    that fed its last token samples token 1); returns the groups' computed sequence counts."""
    plan = s.schedule()
    for seq, n in plan.compute:
        seq.num_cached += n
        s.register_full_pages(seq)
    s.finish_forks(plan)
    for seq in [q for q, _ in plan.compute] + [child for child, _ in plan.forks]:
        if seq.num_cached == seq.num_tokens:
            seq.append(1, 0.0, 0)
    return [len(p.compute) for p in s.plans]


def test_requests_go_to_the_cached_prefix_then_the_least_work() -> None:
    s = grouped()
    assert [g.max_batch_size for g in s.groups] == [4, 4]  # the engine's 8 shared out
    a = request("a", list(range(1, 10)), n=2, max_tokens=10)  # 2 x 19 tokens to go
    b = request("b", [40, 1, 8, 22, 5], max_tokens=9)
    c = request("c", [30, 31, 32, 33, 34, 35, 36, 37, 38])
    for r in (a, b, c):
        s.add(r)
    # a to group 0 (a tie at no work), b to the idle group 1, c to group 1 (14 tokens < 38).
    assert [s.group_of[r] for r in (a, b, c)] == [0, 1, 1]
    assert run_step(s) == [1, 2]  # a's prefill (its second sample forks from it), b and c
    assert s.bounds() == [0, 1, 3]
    assert len(s.running) == 4 and not s.waiting
    # a's two full prompt pages are cached in group 0 only: a request sharing them goes there,
    # though group 0 has more work left.
    d = request("d", list(range(1, 9)) + [44])
    assert s._work(s.groups[0]) > s._work(s.groups[1])
    s.add(d)
    assert s.group_of[d] == 0
    assert run_step(s)[0] == 3  # a's two samples decode, d is admitted
    assert s.stats.prefix_cache_hit_tokens == 8


def test_an_idle_group_and_release() -> None:
    s = grouped()
    lone = request("lone", [5, 6, 7])
    s.add(lone)
    assert run_step(s) == [1, 0]  # group 1 has nothing: the engine sends it an empty part
    for seq in lone.seqs:
        seq.status = Status.FINISHED
    s.release_finished()
    assert not s.group_of and not s.has_work()
    assert s.groups[0].kv.num_free == 16  # its page went back (cached, reusable)


def test_another_groups_pool_is_bookkeeping_and_host_routing() -> None:
    kv = group_pages(M, 16, BS, 64)
    assert kv.k.device.type == "meta" and kv.routing is not None and kv.routing.device.type == "cpu"
    rows = torch.tensor([4, 5])
    kv.routing[:, rows] = torch.tensor([[[1, 2], [3, 4]]], dtype=kv.routing.dtype)
    kv.copy_block(1, 3)  # a forked sample's copy: the routing store's rows too, recorded for the ranks
    assert kv.take_copies() == [(1, 3)]
    got = kv.read_routing([3], 2, 2)
    assert got.tolist() == [[[1, 2]], [[3, 4]]]


def test_abort_frees_the_groups_pages() -> None:
    s = grouped()
    r = [request(f"r{i}", [7 + i, 8, 9, 10, 11]) for i in range(3)]
    for x in r:
        s.add(x)
    assert sorted(s.group_of.values()) == [0, 0, 1]
    run_step(s)
    assert s.abort_all() == [r[0], r[2], r[1]]  # group 0's, then group 1's
    assert not s.has_work() and not s.group_of
    assert all(g.kv.num_free == 16 for g in s.groups)


def test_a_group_preempts_in_its_own_pool() -> None:
    s = grouped(pages=6)
    a = request("a", list(range(1, 10)), max_tokens=10)
    s.add(a)
    run_step(s)  # a's two full prompt pages are cached in group 0
    b = request("b", list(range(1, 9)) + [44], max_tokens=10)
    s.add(b)
    assert s.group_of[b] == 0  # its prefix is there, though group 1 is idle
    while s.has_work() and s.stats.preemptions_total == 0:
        run_step(s)
        for q in s.running:
            if q.num_tokens >= q.max_len:
                q.status = Status.FINISHED
        s.release_finished()
    # Group 0's 6 pages cannot hold both to the end: the newer one gave its pages back; group 1's
    # pool was never touched.
    assert s.stats.preemptions_total == 1 and list(s.groups[0].waiting) == b.seqs
    assert s.groups[1].kv.num_free == 6 and not s.groups[1].has_work()
