"""The batch-1 persistent kernel needs all of its programs resident at once: when they cannot be,
the engine leaves it off (MPS with an SM limit), and a launch that deadlocks anyway traps after
its watchdog's polls instead of hanging the engine (services/engine/kernels/megakernel.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from services.engine.kernels.megakernel import residency_risk


def test_mps_sm_limit_turns_the_kernel_off() -> None:
    assert residency_risk({}) is None
    assert residency_risk({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}) is None
    why = residency_risk({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"})
    assert why is not None and "50%" in why
    bad = residency_risk({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "half"})
    assert bad is not None and "not a number" in bad


# One Qwen3-0.6B-shaped layer (bench/engine/megakernel_probe.py's build), launched with
# `programs_for(sms)` programs. With twice the SMs' worth of programs the second half can never
# start (each program holds a whole SM's registers), so the first barrier waits forever: the
# watchdog must end the launch.
SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from bench.engine.megakernel_probe import build, run_once

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count * int(sys.argv[1])
    mk, inputs, _ = build(dev, 64, 1, sms=sms)
    mk.tuning = {"MAX_POLLS": 1 << 14}
    h = run_once(mk, inputs, torch.empty_like(inputs["h0"]))
    torch.cuda.synchronize()
    print("programs", mk.programs, "finite", bool(torch.isfinite(h).all()))
    """
)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
def test_a_deadlocked_launch_traps_instead_of_hanging() -> None:
    def launch(factor: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", SCRIPT, str(factor)], capture_output=True, text=True,
                              timeout=300)  # fmt: skip

    ok = launch(1)  # every program resident: the watchdog never fires
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "finite True" in ok.stdout
    stuck = launch(2)  # twice the SMs' programs: a deadlock, ended by the trap
    assert stuck.returncode != 0
    assert "programs" not in stuck.stdout
    assert "error" in stuck.stderr.lower(), stuck.stderr[-2000:]
