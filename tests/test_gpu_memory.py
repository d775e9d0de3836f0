"""The memory cap on a device named without an index ("cuda", as configs say it): torch's own
setter must receive a device index. The CUDA calls below the setter's checks stand in for a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.common.gpu_memory import GIB, cap_process_memory


@pytest.mark.parametrize(("name", "index"), [("cuda", 1), ("cuda:0", 0)])
def test_cap_resolves_the_device_index(monkeypatch: pytest.MonkeyPatch, name: str, index: int) -> None:
    seen: list[tuple[float, int]] = []
    monkeypatch.setattr(torch.cuda.memory, "_lazy_init", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=80 * GIB))
    monkeypatch.setattr(torch._C, "_cuda_setMemoryFraction", lambda f, d: seen.append((f, d)), raising=False)
    got = cap_process_memory(torch.device(name), 16.0)
    assert seen == [(0.2, index)] and got["fraction"] == 0.2


def test_no_cap_on_cpu_or_without_a_budget() -> None:
    assert cap_process_memory(torch.device("cpu"), 16.0) == {}
    assert cap_process_memory(torch.device("cuda"), None) == {}
