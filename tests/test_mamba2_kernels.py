"""ops/mamba2_triton.py under Triton's interpreter: the decode step kernel updates a state pool in
place at the batch's slots, equal to ops/mamba2.py ssd_step (tests/helpers/triton_interp.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import triton_interp

INTERPRET, IN_CHILD, needs_interpreter, triton_interpreter, test_mamba2_kernel_tests_in_child_process = (
    triton_interp.kernel_test_module(("ops.mamba2_triton",), __file__)
)


from ops.mamba2 import ssd_step  # noqa: E402
from ops.mamba2_triton import ssd_step_pool  # noqa: E402


@needs_interpreter
@pytest.mark.parametrize("p,n,groups", [(12, 10, 2), (64, 16, 1), (80, 128, 4)])
def test_step_kernel_equals_the_torch_step(p: int, n: int, groups: int) -> None:
    """Head channels over several blocks (80 > 64), state sizes not powers of two, 1-4 groups;
    rows of the pool outside the batch's slots untouched."""
    g = torch.Generator().manual_seed(p + n)
    b, h, slots_total = 3, 4, 6
    state = torch.randn(slots_total, h, p, n, generator=g)
    slots = torch.tensor([4, 0, 2])
    x = torch.randn(b, h, p, generator=g)
    dt = torch.rand(b, h, generator=g)
    a = -torch.rand(h, generator=g)
    bm, cm = torch.randn(b, groups, n, generator=g), torch.randn(b, groups, n, generator=g)
    d = torch.randn(h, generator=g)
    want_y, want_s = ssd_step(state[slots], x, dt, a, bm, cm, d)
    pool = state.clone()
    y = ssd_step_pool(pool, slots, x, dt, a, bm, cm, d)
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[slots], want_s, rtol=1e-5, atol=1e-5)
    others = [i for i in range(slots_total) if i not in slots.tolist()]
    assert torch.equal(pool[others], state[others])
    # One layer's view of a [slots, layers, H, P, N] pool: the slots a layer-stride apart.
    layered = torch.stack([state, -state, state * 2], dim=1)
    view = layered[:, 1]
    y2 = ssd_step_pool(view, slots, x, dt, a, bm, cm, d)
    want_y2, want_s2 = ssd_step(-state[slots], x, dt, a, bm, cm, d)
    torch.testing.assert_close(y2, want_y2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layered[slots, 1], want_s2, rtol=1e-5, atol=1e-5)
    assert torch.equal(layered[:, 0], state) and torch.equal(layered[:, 2], state * 2)
