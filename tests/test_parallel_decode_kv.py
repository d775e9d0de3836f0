"""A decode service whose engine spans 2 ranks (decode.parallel.tp = 2, the debug model's 2 KV
heads: one per rank) with the KV store on, behind a 1-rank prefill, every piece a real process.
It continues from the prefill's same-host handoff (every full page and the partial last one
written through both ranks, each taking its KV head) and pulls a prefix the prefill published to
the store: tokens equal and log-probs to 1e-5 of a colocated 1-rank engine. The same again with
the debug model made an MoE and a decode of two attention groups (tp 1 x dp_attention 2 = ep 2):
each request's pages land in the pool of the group it is placed in."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from test_prefill_service import (
    Cluster,
    check_disaggregated_equals_colocated,
    colocated,
    generate,
    req,
    running_cluster,
    same,
)

from services.common.auth import auth_headers
from services.common.config import ParallelConfig, load_config

# Five processes (gateway, prefill, 2 decode ranks) per cluster on two cores: ~80 s each, over the
# budget of `make test`.
pytestmark = [pytest.mark.slow, pytest.mark.full]


@pytest.fixture(scope="module")
def cluster(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("par-decode-kv")
    with running_cluster(redis_url, tmp, decode_parallel=ParallelConfig(tp=2)) as c:
        yield c


def test_two_rank_decode_continues_from_the_handoff(cluster: Cluster) -> None:
    """The 1-rank decode's disaggregation check, word for word: both ranks take every prompt page
    (the partial last one too: the decode computes no prompt token) and generate what a colocated
    1-rank engine generates."""
    check_disaggregated_equals_colocated(cluster)


def test_two_rank_decode_pulls_a_published_prefix(cluster: Cluster) -> None:
    """The prefill publishes a prompt's 10 full pages to the store; the decode, prefilling locally
    (top-n log-probs keep a request off the prefill service), pulls them into both ranks and
    computes only the last prompt token."""
    check_pulled_prefix(cluster)


@pytest.fixture(scope="module")
def dp_cluster(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The debug model made an MoE (data-parallel attention needs one), its decode two attention
    groups of one rank (tp 1 x dp_attention 2 = ep 2), the prefill one rank."""
    tmp = tmp_path_factory.mktemp("dp-decode-kv")
    moe = load_config("debug").model.model_copy(
        update=dict(
            arch="qwen3_moe", n_routed_experts=4, n_experts_per_tok=2, moe_hidden_dim=64, first_k_dense=1
        )
    )
    dp = ParallelConfig(dp_attention=2, ep=2)
    with running_cluster(redis_url, tmp, ParallelConfig(), dp, model=moe) as c:
        yield c


def test_data_parallel_attention_decode_continues_from_the_handoff(dp_cluster: Cluster) -> None:
    """The handed-off pages (and the partial last one) land in the pool of the attention group the
    request is placed in: nothing of the prompt computed, the colocated 1-rank engine's output."""
    check_disaggregated_equals_colocated(dp_cluster)


def test_data_parallel_attention_decode_pulls_a_published_prefix(dp_cluster: Cluster) -> None:
    check_pulled_prefix(dp_cluster)


def check_pulled_prefix(c: Cluster) -> None:
    prompt = [(11 * i + 3) % 60 for i in range(41)]
    r = req(prompt, temperature=1.0, seed=5, max_tokens=5, ignore_eos=True, logprobs=2)
    body = {"input_ids": prompt, "sampling": {"max_tokens": 1}, "request_id": "publish"}
    p = httpx.post(f"{c.url('prefill', 'prefill')}/v1/prefill", json=body, timeout=60, headers=auth_headers())
    assert p.status_code == 200, p.text
    assert p.json()["pages_stored"] == 10
    before = c.health("decode", "decode")["kv"]
    out = generate(c, r)
    kv = c.health("decode", "decode")["kv"]
    assert kv["local"] - before["local"] == 1
    assert kv["pulled_pages"] - before["pulled_pages"] == 10
    assert kv["computed_tokens"] - before["computed_tokens"] == 1 + 4
    same(out, colocated(c, [r])[0])
    assert [len(t) for t in out.choices[0].top_logprobs] == [2] * 5
