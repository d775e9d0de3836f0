"""The same-host handoff through real service processes (Redis, gateway, prefill, decode: the
cluster of tests/test_prefill_service.py, kvstore.near.shared_lease_s at its default): a
disaggregated generation copies the prompt's pages from the prefill's shared near tier, acks the
handoff, and gives the same tokens as a colocated engine; the prefill leaves no /dev/shm segment.
The decode maps a same-host prefill's segments in the background as soon as it appears."""

from __future__ import annotations

import signal
import time

import httpx
import pytest
from test_prefill_service import Cluster, cluster, colocated, generate, req, same  # noqa: F401

from services.common.auth import auth_headers
from services.kvstore.shared_segment import SHM_DIR

pytestmark = pytest.mark.slow  # four service processes: ~30-60 s on two cores


def prefill_segments(c: Cluster) -> list[str]:
    """The prefill's GET /v1/handoff/segments (waits while it loads)."""
    deadline = time.monotonic() + 30
    while True:
        r = httpx.get(
            f"{c.url('prefill', 'prefill')}/v1/handoff/segments", timeout=10, headers=auth_headers()
        )
        if r.status_code == 200:
            return [s["name"] for s in r.json()["segments"]]
        assert r.status_code == 503 and time.monotonic() < deadline, r.text
        time.sleep(0.2)


def wait_premapped(c: Cluster, at_least: int) -> int:
    deadline = time.monotonic() + 30
    while (n := c.health("decode", "decode")["kv"]["handoff_segments_premapped"]) < at_least:
        assert time.monotonic() < deadline, f"decode mapped {n} prefill segments, not {at_least}"
        time.sleep(0.2)
    return n


def test_decode_maps_the_prefill_segments_before_any_handoff(cluster: Cluster) -> None:  # noqa: F811
    """First in this module: no handoff has happened yet, and the decode's background task has
    already mapped every segment the same-host prefill lists (GET /v1/handoff/segments, which
    grants nothing and counts nothing)."""
    c = cluster
    pf = c.health("prefill", "prefill")
    names = prefill_segments(c)
    assert names and all(n.startswith("relay-kv-") for n in names)
    assert wait_premapped(c, len(names)) == len(names)
    kv = c.health("decode", "decode")["kv"]
    assert kv["handoff_pages_copied"] == 0 and kv["remote"] == 0  # before any handoff
    after = c.health("prefill", "prefill")
    for k in ("handoffs_granted", "handoffs_acked", "handoffs_expired", "handoff_held_pages"):
        assert after[k] == pf[k] == 0
    # Bad input is a 4xx naming the field elsewhere; here a wrong method is refused.
    assert (
        httpx.post(
            f"{c.url('prefill', 'prefill')}/v1/handoff/segments", timeout=10, headers=auth_headers()
        ).status_code
        == 405
    )


def test_disaggregated_generation_uses_the_handoff(cluster: Cluster) -> None:  # noqa: F811
    c = cluster
    prompt = [(3 * i + 11) % 60 for i in range(45)]  # 11 full pages of 4 tokens + a 1-token tail
    r = req(prompt, temperature=1.0, seed=5, n=2, max_tokens=6, ignore_eos=True)
    before, pf_before = c.health("decode", "decode")["kv"], c.health("prefill", "prefill")
    out = generate(c, r)
    same(out, colocated(c, [r])[0])
    kv, pf = c.health("decode", "decode")["kv"], c.health("prefill", "prefill")
    assert kv["remote"] - before["remote"] == 1, (kv, pf)
    assert kv["pulled_pages"] - before["pulled_pages"] == 11
    # ... every one of them copied from the prefill's shared segments, none from the gateway.
    assert kv["handoff_pages_copied"] - before["handoff_pages_copied"] == 11
    # ... and the partial last page too: decode computes no prompt token.
    assert kv["handoff_tail_pages_copied"] - before["handoff_tail_pages_copied"] == 1
    assert kv["handoff_pages_stale"] == before["handoff_pages_stale"]
    assert pf["handoffs_granted"] - pf_before["handoffs_granted"] == 1
    # The decode acked: the slots are not held until the lease ends.
    deadline = time.monotonic() + 10
    while c.health("prefill", "prefill")["handoffs_acked"] - pf_before["handoffs_acked"] < 1:
        assert time.monotonic() < deadline, "the handoff was never acked"
        time.sleep(0.1)
    assert c.health("prefill", "prefill")["handoff_held_pages"] == 0
    # Per sample: its prefilled token (a decode step), then 4 more decodes; no prompt token.
    assert kv["computed_tokens"] - before["computed_tokens"] == 2 * 5


def test_page_aligned_prompt_starts_as_a_pure_decode(cluster: Cluster) -> None:  # noqa: F811
    """44 tokens = 11 full pages: the decode takes all 11 (the last one too: the prefill sampled
    the first token, so no prompt token needs its logits here) and feeds only the first token."""
    c = cluster
    r = req(
        [(7 * i + 3) % 60 for i in range(44)], temperature=1.0, seed=6, n=2, max_tokens=6, ignore_eos=True
    )
    before, pf_before = c.health("decode", "decode")["kv"], c.health("prefill", "prefill")
    same(generate(c, r), colocated(c, [r])[0])
    kv, pf = c.health("decode", "decode")["kv"], c.health("prefill", "prefill")
    assert kv["remote"] - before["remote"] == 1
    assert kv["pulled_pages"] - before["pulled_pages"] == 11
    assert kv["handoff_pages_copied"] - before["handoff_pages_copied"] == 11
    assert kv["handoff_tail_pages_copied"] == before["handoff_tail_pages_copied"]  # none to hand off
    assert kv["computed_tokens"] - before["computed_tokens"] == 2 * 5
    assert pf["handoffs_granted"] - pf_before["handoffs_granted"] == 1


def test_prefill_unlinks_its_segments_on_sigterm(cluster: Cluster) -> None:  # noqa: F811
    c = cluster
    pid = c.procs["prefill"].pid
    mine = [p for p in SHM_DIR.glob("relay-kv-*") if f"-{pid}-" in p.name]
    assert mine, "the prefill's near tier is not in shared segments"
    assert c.stop("prefill") == 0
    assert not any(p.exists() for p in mine)
    premapped = c.health("decode", "decode")["kv"]["handoff_segments_premapped"]
    c.start("prefill", "services.prefill")  # the module's cluster keeps one for later tests
    c.url("prefill", "prefill")
    # The restarted prefill has new segments: the decode maps them as it appears, before traffic.
    wait_premapped(c, premapped + len(prefill_segments(c)))


def test_handoff_serves_the_pages_with_the_gateway_killed(cluster: Cluster) -> None:  # noqa: F811
    """Last in this module (the gateway stays down). The prefill's pages never reach the store,
    yet a same-host decode gets every one of them through the handoff: nothing recomputed."""
    c = cluster
    assert c.stop("kvstore", signal.SIGKILL) == -signal.SIGKILL
    r = req(
        [(13 * i + 2) % 60 for i in range(45)], temperature=1.0, seed=9, n=2, max_tokens=5, ignore_eos=True
    )
    before = c.health("decode", "decode")["kv"]
    same(generate(c, r), colocated(c, [r])[0])
    kv = c.health("decode", "decode")["kv"]
    assert kv["remote"] - before["remote"] == 1
    # Every page pulled was a handoff page (none came from the store, which is down) ...
    assert kv["pulled_pages"] - before["pulled_pages"] == 11
    assert kv["handoff_pages_copied"] - before["handoff_pages_copied"] == 11
    # ... and decode computed no prompt token: per sample the prefilled token, then decodes.
    assert kv["computed_tokens"] - before["computed_tokens"] == 2 * 4
