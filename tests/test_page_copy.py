"""kernels/page_copy.py under Triton's interpreter: moving pages between a cache's pools and a
page-major byte batch gives exactly the bytes the torch path (kv_transfer, CPU) gives, both ways,
for scattered, consecutive and repeated-layout pages and a pool pair with different widths."""

from __future__ import annotations

import pytest
import torch
from helpers import triton_interp

INTERPRET, IN_CHILD, needs_interpreter, triton_interpreter, test_kernel_tests_in_child_process = (
    triton_interp.kernel_test_module(("page_copy",), __file__)
)


from services.engine.kernels import page_copy  # noqa: E402

# On a GPU machine the kernel runs compiled, on CUDA tensors; on CPU under the interpreter.
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _pools(L: int, blocks: int, bs: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, blocks * bs, 2, 8, generator=g).to(torch.bfloat16)
    v = torch.randn(L, blocks * bs, 3, 4, generator=g)  # another width and dtype
    return [k.to(DEV), v.to(DEV)]


def _reference_export(pools: list[torch.Tensor], pages: list[int], bs: int) -> torch.Tensor:
    """kv_transfer.export_blob's torch path: per pool [n, L, bs, ...] bytes, pools side by side."""
    parts = []
    for t in pools:
        rows = (torch.tensor(pages, device=DEV)[:, None] * bs + torch.arange(bs, device=DEV)).reshape(-1)
        g = t[:, rows].reshape(t.shape[0], len(pages), bs, *t.shape[2:]).transpose(0, 1).contiguous()
        parts.append(g.view(torch.uint8).reshape(len(pages), -1))
    return torch.cat(parts, dim=1)


@needs_interpreter
@pytest.mark.parametrize("pages", [[5, 1, 9, 2], [3, 4, 5, 6, 7], [0]])
def test_export_and_import_match_the_torch_path(pages: list[int]) -> None:
    L, blocks, bs = 3, 12, 4
    pools = _pools(L, blocks, bs, seed=1)
    want = _reference_export(pools, pages, bs)
    idx = torch.tensor(pages, dtype=torch.int64, device=DEV)
    blob = torch.zeros_like(want)
    off = 0
    for t in pools:
        assert page_copy.fits(t, bs, blob, off)
        page_copy.copy_pages(t, bs, idx, blob, off, to_pool=False)
        off += t.shape[0] * bs * t[0, 0].numel() * t.element_size()
    assert torch.equal(blob, want)

    # Import the batch into empty pools: those pages hold exactly the source's rows, no other
    # row is touched.
    dst = [torch.zeros_like(t) for t in pools]
    off = 0
    for t in dst:
        page_copy.copy_pages(t, bs, idx, want, off, to_pool=True)
        off += t.shape[0] * bs * t[0, 0].numel() * t.element_size()
    rows = (idx[:, None] * bs + torch.arange(bs, device=DEV)).reshape(-1)
    other = torch.ones(blocks * bs, dtype=torch.bool, device=DEV)
    other[rows] = False
    for src, got in zip(pools, dst, strict=True):
        assert torch.equal(got[:, rows], src[:, rows])
        assert not got[:, other].any()


def test_fits_refuses_what_it_cannot_copy() -> None:
    t = torch.zeros(2, 8, 1, 3, dtype=torch.bfloat16)  # a page chunk of 4 rows x 6 bytes = 24: whole words
    blob = torch.zeros(2, 48 + 8, dtype=torch.uint8)
    assert page_copy.fits(t, 4, blob, 8)
    assert not page_copy.fits(t, 4, blob, 4)  # the pool's offset in the batch: not a whole word
    assert not page_copy.fits(t, 2, blob, 0)  # 2 rows x 6 bytes = 12: not a whole word
    assert not page_copy.fits(t[:, ::2], 4, blob, 0)  # not contiguous
    assert not page_copy.fits(t, 4, blob.view(torch.int8), 0)  # not bytes
