"""The engine's parallel layers (services/engine/parallel/) on 2 and 4 gloo ranks against the
single-rank computation in float32: tensor-parallel linears, the vocabulary-parallel embedding and
head (log-probs, top-n and seeded sampling without gathering a row), expert-parallel MoE with
data-parallel attention and tensor-parallel experts (outputs and routed expert ids), and a dead
peer turning a collective into an error instead of a hang."""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers.parallel import run_ranks

from services.common.config import ModelConfig, ParallelConfig
from services.common.schemas import SamplingParams
from services.engine.layers.moe import MoE
from services.engine.layers.sampler import Sampler
from services.engine.parallel.experts import ExpertParallelMoE, TensorParallelMoE, split_even
from services.engine.parallel.group import EngineGroups, init_engine_groups
from services.engine.parallel.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    kv_head_range,
    shard_indices,
)
from services.engine.parallel.vocab import ShardedSampler, VocabParallelEmbedding, VocabParallelHead

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="gloo process groups run on Linux")

TOL = 1e-5
VOCAB, DIM = 96, 32


def moe_config(shared: int) -> ModelConfig:
    return ModelConfig(
        arch="qwen3_moe",
        vocab_size=VOCAB,
        dim=DIM,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        n_routed_experts=8,
        n_experts_per_tok=2,
        n_shared_experts=shared,
        moe_hidden_dim=16,
    )


def reference_moe(m: ModelConfig, seed: int) -> MoE:
    g = torch.Generator().manual_seed(seed)
    moe = MoE(m, 0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return moe


def sampling_rows() -> list[SamplingParams]:
    """Greedy, plain T = 1 and T = 0.7, truncated (top-k, top-p, min-p) rows, some with top-n."""
    return [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, logprobs=5),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=7),
        SamplingParams(temperature=0.9, top_p=0.8, logprobs=2),
        SamplingParams(temperature=1.0, min_p=0.05),
        SamplingParams(temperature=1.0, logprobs=0),
        SamplingParams(temperature=1.0),  # its logits: NaN and +-inf entries
        SamplingParams(temperature=1.0),  # nothing finite at all: uniform
    ]


def worker(rank: int, world: int, init: str, out_dir: str, case: str) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    par = {
        "tp": ParallelConfig(tp=world),
        "ep_dp": ParallelConfig(dp_attention=world, ep=world),
        "ep_tp_dp": ParallelConfig(tp=2, dp_attention=world // 2, ep=world),
    }[case]
    groups = init_engine_groups(par, rank, init, "gloo", timeout_s=30)
    res: dict[str, object] = {}
    if case == "tp":
        res |= check_linears(groups) | check_vocab(groups) | check_tp_moe(groups)
    else:
        res |= check_ep_moe(groups)
    res |= check_dead_peer(groups) if case == "tp" and world == 2 else {}
    Path(out_dir, f"{case}-{rank}.json").write_text(json.dumps(res))


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def check_linears(groups: EngineGroups) -> dict[str, object]:
    """An MLP as column-parallel gate/up then row-parallel down: the full MLP's output."""
    tp = groups.tp
    g = torch.Generator().manual_seed(1)
    width = 64
    # Weights scaled as an init would (outputs of order 1: TOL is an absolute float32 bound).
    wg, wu = (
        torch.randn(width, DIM, generator=g) * DIM**-0.5,
        torch.randn(width, DIM, generator=g) * DIM**-0.5,
    )
    wd, bias = torch.randn(DIM, width, generator=g) * width**-0.5, torch.randn(DIM, generator=g)
    x = torch.randn(5, DIM, generator=g)
    full = F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd, bias)
    cols = shard_indices(width, tp.size, tp.rank)
    gate, up = ColumnParallelLinear(DIM, len(cols)), ColumnParallelLinear(DIM, len(cols))
    down = RowParallelLinear(len(cols), DIM, tp, bias=True)
    gate.load_full(wg, cols)
    up.load_full(wu, cols)
    down.load_full(wd, cols, bias)
    with torch.no_grad():
        got = down(F.silu(gate(x)) * up(x))
    return {"mlp": maxdiff(got, full)}


def check_vocab(groups: EngineGroups) -> dict[str, object]:
    tp = groups.tp
    g = torch.Generator().manual_seed(2)
    emb_w = torch.randn(VOCAB, DIM, generator=g)
    ids = torch.tensor([0, 5, VOCAB - 1, 47, 48, 3])
    emb = VocabParallelEmbedding(VOCAB, DIM, tp)
    emb.load_full(emb_w)
    with torch.no_grad():
        emb_exact = bool(torch.equal(emb(ids), F.embedding(ids, emb_w)))
    # The tied head: logits of the split rows; rows 8 and 9 with NaN / inf / nothing finite.
    params = sampling_rows()
    hidden = torch.randn(len(params), DIM, generator=g) * 0.3  # logits of order 1: real draws
    head = VocabParallelHead(VOCAB, DIM, tp, tied=emb)
    with torch.no_grad():
        logits = head(hidden)
    full = F.linear(hidden, emb_w)
    res: dict[str, object] = {
        "embedding_exact": emb_exact,
        "logits": maxdiff(logits.shard, full[:, logits.start : logits.end]),
    }
    bad = logits.shard.clone()
    bad_full = full.clone()
    for x, start in ((bad, logits.start), (bad_full, 0)):
        cols = torch.arange(start, start + x.shape[1])
        x[8, cols % 5 == 0] = float("nan")
        x[8, cols % 7 == 1] = float("inf")
        x[8, cols % 11 == 2] = float("-inf")
        x[9] = float("-inf")
    logits = logits.with_shard(bad)
    # Plain log-softmax and top-n against the full row (rows 0..7: all finite).
    lsm = logits.with_shard(logits.shard[:8]).log_softmax()
    ref = torch.log_softmax(full[:8], dim=-1)
    tokens = torch.tensor([0, 95, 17, 48, 47, 3, 60, 61])
    res["token_logprob"] = maxdiff(lsm.token_values(tokens), ref.gather(1, tokens[:, None])[:, 0])
    v, i = lsm.topk(6)
    rv, ri = ref.topk(6)
    res["topk_ids_equal"] = bool(torch.equal(i, ri))
    res["topk_values"] = maxdiff(v, rv)
    # Seeded sampling, three rounds with the same per-row seeds on both sides.
    sampler, ref_sampler = ShardedSampler(), Sampler()
    rng_a = [random.Random(100 + j) for j in range(len(params))]
    rng_b = [random.Random(100 + j) for j in range(len(params))]
    toks, ref_toks, lp_diff, top_ok, top_diff = [], [], 0.0, True, 0.0
    for _ in range(3):
        u = ShardedSampler.draws(params, rng_a) if tp.rank == 0 else None
        u = tp.broadcast_object(u)  # the scheduler's rank draws, every rank samples with them
        got = sampler.sample(logits, params, u)
        want = ref_sampler.sample(bad_full, params, rng_b)
        toks.append(got.tokens)
        ref_toks.append(want.tokens)
        lp_diff = max(lp_diff, max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)))
        for a, b in zip(got.top, want.top, strict=True):
            if (a is None) != (b is None):
                top_ok = False
            elif a is not None and b is not None:
                top_ok &= [t for t, _ in a] == [t for t, _ in b]
                top_diff = max([top_diff] + [abs(x[1] - y[1]) for x, y in zip(a, b, strict=True)])
    return res | {
        "tokens": toks,
        "ref_tokens": ref_toks,
        "sampled_logprob": lp_diff,
        "top_ids_equal": top_ok,
        "top_values": top_diff,
        "tokens_vary": len({t for round_ in toks for t in round_[1:4]}) > 1,
    }


def check_tp_moe(groups: EngineGroups) -> dict[str, object]:
    m = moe_config(shared=1)
    ref = reference_moe(m, seed=3)
    moe = TensorParallelMoE(m, 0, groups.tp)
    with torch.no_grad():
        moe.gate.weight.copy_(ref.gate.weight)
        moe.load_full(ref.experts.gate_up_proj, ref.experts.down_proj)
        assert ref.shared_experts is not None and moe.shared_experts is not None
        moe.shared_experts.load_full({k: v for k, v in ref.shared_experts.state_dict().items()})
        x = torch.randn(9, DIM, generator=torch.Generator().manual_seed(4))
        out, ids = moe(x)
        want, want_ids = ref(x)
    return {"tp_moe": maxdiff(out, want), "tp_moe_ids_equal": bool(torch.equal(ids, want_ids))}


def check_ep_moe(groups: EngineGroups) -> dict[str, object]:
    """Each attention group has its own tokens (a different number each, one group's split leaves
    a rank with none); every rank's output and ids equal the single-rank MoE on its group's tokens."""
    m = moe_config(shared=1)
    ref = reference_moe(m, seed=5)
    moe = ExpertParallelMoE(m, 0, groups)
    counts = [7, 1, 4, 0][: groups.world.size // groups.tp.size]
    with torch.no_grad():
        moe.gate.weight.copy_(ref.gate.weight)
        moe.load_full(ref.experts.gate_up_proj, ref.experts.down_proj)
        assert ref.shared_experts is not None and moe.shared_experts is not None
        moe.shared_experts.load_full({k: v for k, v in ref.shared_experts.state_dict().items()})
        g = torch.Generator().manual_seed(6 + groups.dp_rank)
        x = torch.randn(counts[groups.dp_rank], DIM, generator=g)
        out, ids = moe(x)
        want, want_ids = ref(x)
    return {
        "ep_moe": maxdiff(out, want),
        "ep_moe_ids_equal": bool(torch.equal(ids, want_ids)),
        "tokens": int(x.shape[0]),
        "local_experts": moe.n_local,
    }


def check_dead_peer(groups: EngineGroups) -> dict[str, object]:
    """Rank 1 leaves; rank 0's next collective raises instead of waiting for it."""
    if groups.world.rank == 1:
        return {}
    groups.world.barrier()  # rank 1 is in this barrier too; then it exits (below, in worker's caller)
    t0 = time.monotonic()
    try:
        groups.world.all_reduce(torch.ones(3))
        raised = ""
    except RuntimeError as e:
        raised = type(e).__name__
    return {"dead_peer_raised": raised, "dead_peer_s": time.monotonic() - t0}


def run(world: int, case: str, tmp_path: Path) -> list[dict[str, object]]:
    run_ranks(_entry, world, tmp_path, world, str(tmp_path), case)
    return [json.loads((tmp_path / f"{case}-{r}.json").read_text()) for r in range(world)]


def _entry(rank: int, init: str, world: int, out_dir: str, case: str) -> None:
    if case == "tp" and world == 2 and rank == 1:
        # The dead-peer check: join the barrier rank 0 waits in, then leave without a word.
        torch.set_num_threads(1)
        par = ParallelConfig(tp=world)
        groups = init_engine_groups(par, rank, init, "gloo", timeout_s=30)
        res = check_linears(groups) | check_vocab(groups) | check_tp_moe(groups)
        Path(out_dir, f"{case}-{rank}.json").write_text(json.dumps(res))
        groups.world.barrier()
        return
    worker(rank, world, init, out_dir, case)


def assert_tp(results: list[dict[str, object]]) -> None:
    for r in results:
        assert r["embedding_exact"] is True
        for key in (
            "mlp",
            "logits",
            "token_logprob",
            "topk_values",
            "sampled_logprob",
            "top_values",
            "tp_moe",
        ):
            assert r[key] <= TOL, (key, r[key])  # type: ignore[operator]
        assert r["topk_ids_equal"] and r["top_ids_equal"] and r["tp_moe_ids_equal"]
        assert r["tokens"] == r["ref_tokens"]
        assert r["tokens_vary"]  # the draws really sample (not every row greedy)
    assert all(r["tokens"] == results[0]["tokens"] for r in results)


def test_tensor_parallel_2_ranks_and_a_dead_peer(tmp_path: Path) -> None:
    results = run(2, "tp", tmp_path)
    assert_tp(results)
    # gloo notices the closed socket at once; the group's timeout (30 s) bounds it otherwise.
    assert results[0]["dead_peer_raised"] == "RuntimeError"
    assert results[0]["dead_peer_s"] < 30  # type: ignore[operator]


@pytest.mark.full
def test_tensor_parallel_4_ranks(tmp_path: Path) -> None:
    assert_tp(run(4, "tp", tmp_path))


def test_kv_heads_split_or_replicated() -> None:
    # 2 KV heads over tp 4: ranks 0-1 keep head 0, ranks 2-3 head 1; 8 over 4: two each.
    assert [kv_head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_head_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError):
        kv_head_range(3, 4, 0)


def test_expert_parallel_2_ranks_data_parallel_attention(tmp_path: Path) -> None:
    results = run(2, "ep_dp", tmp_path)
    for r in results:
        assert r["ep_moe"] <= TOL and r["ep_moe_ids_equal"], r  # type: ignore[operator]
        assert r["local_experts"] == 4
    assert [r["tokens"] for r in results] == [7, 1]


def test_expert_parallel_4_ranks_tp2_x_dp2(tmp_path: Path) -> None:
    results = run(4, "ep_tp_dp", tmp_path)
    for r in results:
        assert r["ep_moe"] <= TOL and r["ep_moe_ids_equal"], r  # type: ignore[operator]
        assert r["local_experts"] == 2
    # Group 1's single token is dispatched by its rank 2; rank 3 sends nothing.
    assert [r["tokens"] for r in results] == [7, 7, 1, 1]
    assert split_even(1, 2, 1) == (1, 1) and split_even(7, 2, 0) == (0, 4)
