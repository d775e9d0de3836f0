"""bench/trainer/step.py's `head_recompute` variant reaches the trainer's chunked LM head
(`trainer.head_cache_gib`), and both head paths give the same loss and gradient norm (CPU)."""

from __future__ import annotations

import math
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bench_worker(rank: int, port: int, out: dict[str, Any]) -> None:
    """Rank 0 of a 1-rank gloo group: bench/trainer/step.py's build_ours + our_step with the
    `head_recompute` variant's head knob and without it (bf16, no FSDP: autocast, eager)."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    sys.path.insert(0, str(REPO / "bench" / "trainer"))
    import step

    ctx = step.Ctx("cpu")
    try:
        m = step.model_config("tiny", 1024)
        mine, total = step.rank_data(
            [[100, 37, 260, 120, 3]], m.vocab_size, step.Degrees(1, 1, 1, 1, 1), 0, 7
        )
        mb = step.pack(mine)
        recompute = step.VARIANTS["bf16+compile+fused_adam+fsdp+head_recompute"]
        cached = step.VARIANTS["bf16+compile+fused_adam+fsdp"]
        out["variant_head_cache_gib"] = recompute["head_cache_gib"]
        out["variant_diff"] = sorted(set(recompute.items()) ^ set(cached.items()))
        for name, knobs in (
            ("cached", {"fsdp": "auto"}),
            ("recompute", {"fsdp": "auto", "head_cache_gib": recompute["head_cache_gib"]}),
            ("bf16_logits", {"fsdp": "auto", "logits_fp32": False}),
        ):
            model, opt, deg, meshes = step.build_ours(m, knobs, ctx)
            loss, gn = step.our_step(model, opt, [mb], total, deg, meshes, ctx.device)
            head = model.output
            out[name] = (loss, gn, head.head_cache_gib, head.logits_fp32)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.skipif(sys.platform != "linux", reason="gloo process groups run on Linux")
def test_bench_head_recompute_variant_reaches_the_head() -> None:
    """step.py's build_ours passes the trainer section's head knobs to the head as train.py does
    (logits_fp32 included), and the two head paths give
    the same loss and gradient norm. Spawned: step.Ctx joins a process group."""
    out = mp.Manager().dict()
    mp.start_processes(_bench_worker, args=(_free_port(), out), nprocs=1, start_method="spawn")
    assert out["variant_head_cache_gib"] == 0.0
    assert out["variant_diff"] == [("head_cache_gib", 0.0)]  # the only difference between the two
    loss_c, gn_c, cache_c, fp32_c = out["cached"]
    loss_r, gn_r, cache_r, fp32_r = out["recompute"]
    assert cache_c == 12.0 and cache_r == 0.0 and fp32_c and fp32_r
    assert loss_c == loss_r and gn_c == gn_r and math.isfinite(gn_c) and gn_c > 0
    assert out["bf16_logits"][3] is False  # the bf16_logits variant's knob reaches the head now
