"""The kernel test files that this pytest process cannot run under Triton's interpreter (triton was
imported before TRITON_INTERPRET=1, as in any whole-suite run), run together in one child process
with TRITON_INTERPRET=1 (tests/helpers/triton_interp.py): one start-up of torch, triton and the
engine for all of them instead of one a file. The files are those whose own child test this
session selected (`triton_interp.group_child_tests` deselects those in its favour); every test of
each file runs there as it would in a child of its own."""

from __future__ import annotations

import pytest
from helpers import triton_interp


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the sum of the files' children (each bounded at 600 s), ~3-5 min on 2 busy cores
def test_interpreted_kernel_files_in_one_child_process() -> None:
    files = triton_interp.GROUPED_FILES
    if not files:
        pytest.skip("every kernel test file runs in this process (or on CUDA, uninterpreted)")
    triton_interp.run_file_in_child(*files, timeout_s=1800)


setattr(test_interpreted_kernel_files_in_one_child_process, triton_interp.GROUP_ATTR, True)
