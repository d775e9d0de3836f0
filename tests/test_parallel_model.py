"""A rank's shard of the engine's decoder (services/engine/parallel/model.py) on 2 gloo ranks against
the single-rank CausalLM with the same checkpoint, float32: a prefill of two prompts and decode
steps through the paged KV cache give the same hidden states, log-probs, top-n, seeded tokens
and routed expert ids (Router Replay's), to 1e-5. Dense Qwen3 with TP 2 (one KV head per rank,
and one KV head replicated on both), Qwen3-MoE with EP 2 and with tensor-parallel experts."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch
from helpers.debug_weights import random_model_dir
from helpers.parallel import TINY, run_ranks, tiny_moe

from services.common.config import ModelConfig, ParallelConfig
from services.common.schemas import SamplingParams
from services.engine.batch import ForwardBatch, Span
from services.engine.kv_cache import KVCache
from services.engine.layers.sampler import Sampler
from services.engine.loader import read_checkpoint
from services.engine.models.causal_lm import CausalLM
from services.engine.parallel.group import init_engine_groups
from services.engine.parallel.model import (
    build_parallel_model,
    local_config,
    local_state,
    sharded_logits,
    slice_spec,
)
from services.engine.parallel.vocab import ShardedSampler

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="gloo process groups run on Linux")

TOL = 1e-5
BLOCK, BLOCKS_PER_SEQ = 4, 8

BASE = dict(TINY, max_seq_len=32)
MODELS = {
    "qwen3-tp2": (ModelConfig(**BASE, n_kv_heads=2), ParallelConfig(tp=2)),
    "qwen3-tp2-kv1": (
        ModelConfig(**BASE, n_kv_heads=1, qk_norm=False, arch="llama3", tie_embeddings=False),
        ParallelConfig(tp=2),
    ),
    "moe-ep2": (tiny_moe(32), ParallelConfig(tp=2, ep=2)),
}
MODELS["moe-tp2"] = (MODELS["moe-ep2"][0], ParallelConfig(tp=2))


def worker(rank: int, init: str, name: str, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    m, par = MODELS[name]
    groups = init_engine_groups(par, rank, init, "gloo", timeout_s=60)
    ckpt = read_checkpoint(model_dir)
    cpu, f32 = torch.device("cpu"), torch.float32
    ref = CausalLM(m, m.max_seq_len).to(cpu, f32).eval()
    ref.load_hf_state(ckpt.state)
    model = build_parallel_model(m, par, groups, m.max_seq_len, False, cpu, f32).eval()
    mine = read_checkpoint(model_dir, slice_spec(m, par, groups))  # only this rank's slices
    model.load_hf_state(local_state(mine.state, m, groups))
    blocks = 2 * BLOCKS_PER_SEQ
    kv_ref = KVCache.for_model(m, blocks, BLOCK, m.max_seq_len, f32, cpu)
    kv = KVCache.for_model(local_config(m, par), blocks, BLOCK, m.max_seq_len, f32, cpu)
    tables = [list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)) for i in range(2)]
    prompts = [[3, 17, 5, 9, 30, 2, 11], [40, 1, 8]]
    params = [SamplingParams(temperature=1.0, logprobs=3), SamplingParams(temperature=0.0, logprobs=2)]
    rng_ref = [random.Random(7), random.Random(8)]
    rng = [random.Random(7), random.Random(8)]
    spans = [Span(tables[i], 0, prompts[i]) for i in range(2)]
    res: dict[str, list] = {"hidden": [], "logprob": [], "top": [], "tokens": [], "ref_tokens": []}
    with torch.inference_mode():
        for _ in range(4):  # the prefill, then three decode steps
            batch = ForwardBatch.build(spans, cpu, m.max_seq_len, BLOCK)
            h_ref = ref(batch, kv_ref)
            h = model(batch, kv)
            res["hidden"].append(float((h - h_ref).abs().max()))
            want = Sampler().sample(ref.logits(h_ref[batch.last_index]), params, rng_ref)
            u = groups.tp.broadcast_object(ShardedSampler.draws(params, rng) if rank == 0 else None)
            got = ShardedSampler().sample(
                sharded_logits(model, h[batch.last_index], groups, m.vocab_size), params, u
            )
            res["tokens"].append(got.tokens)
            res["ref_tokens"].append(want.tokens)
            res["logprob"].append(max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)))
            res["top"].append(
                all(
                    [t for t, _ in a or []] == [t for t, _ in b or []]
                    and all(abs(x[1] - y[1]) <= TOL for x, y in zip(a or [], b or [], strict=True))
                    for a, b in zip(got.top, want.top, strict=True)
                )
            )
            # Both continue with the reference's tokens (the comparison is per step).
            spans = [Span(tables[i], s.start + len(s.tokens), [want.tokens[i]]) for i, s in enumerate(spans)]
    out = {k: v for k, v in res.items()}
    if kv_ref.routing is not None:
        assert kv.routing is not None
        out["routing_equal"] = bool(torch.equal(kv.routing, kv_ref.routing))  # type: ignore[assignment]
    Path(out_dir, f"{name}-{rank}.json").write_text(json.dumps(out))


@pytest.mark.parametrize(
    "name",
    [
        # TP 2 and EP 2 also run inside the engine test (tests/test_parallel_engine.py): these
        # compare hidden states directly, and add KV-head replication and tensor-parallel experts.
        pytest.param("qwen3-tp2", marks=pytest.mark.full),
        pytest.param("moe-ep2", marks=pytest.mark.full),
        "qwen3-tp2-kv1",
        pytest.param("moe-tp2", marks=pytest.mark.full),
    ],
)
def test_rank_shards_compute_the_single_rank_model(name: str, tmp_path: Path) -> None:
    m, par = MODELS[name]
    d = random_model_dir(m, tmp_path / "w", seed=3, std=0.2)
    run_ranks(worker, par.ranks, tmp_path, name, str(d), str(tmp_path))
    for rank in range(par.ranks):
        r = json.loads((tmp_path / f"{name}-{rank}.json").read_text())
        assert max(r["hidden"]) <= TOL and max(r["logprob"]) <= TOL, r
        assert all(r["top"]) and r["tokens"] == r["ref_tokens"], r
        if m.is_moe:
            assert r["routing_equal"]
