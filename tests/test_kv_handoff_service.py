"""The same-host handoff through real service processes (Redis, gateway, prefill, decode: the
cluster of tests/test_prefill_service.py, kvstore.near.shared_lease_s at its default): a
disaggregated generation copies the prompt's pages from the prefill's shared near tier, acks the
handoff, and gives the same tokens as a colocated engine; the prefill leaves no /dev/shm segment."""

from __future__ import annotations

import signal
import time

import pytest
from test_prefill_service import Cluster, cluster, colocated, generate, req, same  # noqa: F401

from services.kvstore.shared_segment import SHM_DIR

pytestmark = pytest.mark.slow  # four service processes: ~30-60 s on two cores


def test_disaggregated_generation_uses_the_handoff(cluster: Cluster) -> None:  # noqa: F811
    c = cluster
    prompt = [(3 * i + 11) % 60 for i in range(45)]  # 11 reusable pages of 4 tokens
    r = req(prompt, temperature=1.0, seed=5, n=2, max_tokens=6, ignore_eos=True)
    before, pf_before = c.health("decode", "decode")["kv"], c.health("prefill", "prefill")
    out = generate(c, r)
    same(out, colocated(c, [r])[0])
    kv, pf = c.health("decode", "decode")["kv"], c.health("prefill", "prefill")
    assert kv["remote"] - before["remote"] == 1
    assert kv["pulled_pages"] - before["pulled_pages"] == 11
    # ... every one of them copied from the prefill's shared segments, none from the gateway.
    assert kv["handoff_pages_copied"] - before["handoff_pages_copied"] == 11
    assert kv["handoff_pages_stale"] == before["handoff_pages_stale"]
    assert pf["handoffs_granted"] - pf_before["handoffs_granted"] == 1
    # The decode acked: the slots are not held until the lease ends.
    deadline = time.monotonic() + 10
    while c.health("prefill", "prefill")["handoffs_acked"] - pf_before["handoffs_acked"] < 1:
        assert time.monotonic() < deadline, "the handoff was never acked"
        time.sleep(0.1)
    assert c.health("prefill", "prefill")["handoff_held_pages"] == 0
    assert kv["computed_tokens"] - before["computed_tokens"] == 2 * 6


def test_prefill_unlinks_its_segments_on_sigterm(cluster: Cluster) -> None:  # noqa: F811
    c = cluster
    pid = c.procs["prefill"].pid
    mine = [p for p in SHM_DIR.glob("relay-kv-*") if f"-{pid}-" in p.name]
    assert mine, "the prefill's near tier is not in shared segments"
    assert c.stop("prefill") == 0
    assert not any(p.exists() for p in mine)
    c.start("prefill", "services.prefill")  # the module's cluster keeps one for later tests
    c.url("prefill", "prefill")


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
    # ... and decode computed no prompt page: per sample the prefilled token, then decodes.
    assert kv["computed_tokens"] - before["computed_tokens"] == 2 * 5
