"""Running Triton kernels on CPU under Triton's interpreter, for the kernel test files.

The interpreter works only in a process where TRITON_INTERPRET=1 was set before triton was first
imported (its standard library, e.g. the combine functions of tl.sum, is decorated then). In a
longer session something may have imported it earlier (the engine imports the fp8 kernels): then a
kernel test file runs itself in a child process instead (`run_file_in_child`). When the session
also holds tests/test_interpreted_kernels.py, those files' child tests give way to its one test,
which runs all of them in a single child process (`group_child_tests`): one start-up of torch,
triton and the engine instead of one a file. Each file still runs under TRITON_INTERPRET=1 in a
process of its own kind; the modules that must not see that variable (the fp8 dispatch, ...) are
never in the group: they run their interpreted scripts through `run_script_interpreted`."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

CHILD_REASON = "triton was imported before TRITON_INTERPRET=1: run in a child process instead"

# The kernel test files that this process cannot interpret (in collection order), and those of
# them whose child tests `group_child_tests` handed to the one group test.
IN_CHILD_FILES: list[str] = []
GROUPED_FILES: list[str] = []
FILE_ATTR = "interpreted_kernel_file"  # on a file's child test: the file it runs
GROUP_ATTR = "interpreted_kernel_group"  # on the group test


def set_interpret(value: str | None) -> str | None:
    """Set (None: unset) TRITON_INTERPRET; returns the previous value."""
    old = os.environ.get("TRITON_INTERPRET")
    if value is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = value
    return old


def prepare(kernel_modules: tuple[str, ...]) -> tuple[bool, bool]:
    """Call at a kernel test module's import: (interpret, in_child). interpret: no CUDA, so the
    kernels run under the interpreter; in_child: this process cannot, the file's tests skip and
    its child-process test runs them. Otherwise `services.engine.kernels.<m>` for each m is
    (re)imported under TRITON_INTERPRET=1 (Triton reads it when @triton.jit decorates); the rest
    of the session keeps the environment it had. A dotted name is a full module name
    (e.g. ops.fused_norm)."""
    interpret = not torch.cuda.is_available()
    in_child = interpret and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
    if interpret and not in_child:
        saved = set_interpret("1")
        for mod in kernel_modules:
            name = mod if "." in mod else f"services.engine.kernels.{mod}"
            importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)
        set_interpret(saved)
    return interpret, in_child


def interpreter_fixture(active: bool) -> Callable[[], Iterator[None]]:
    """An autouse module fixture that sets TRITON_INTERPRET=1 while the module's tests run
    (Triton reads it again when an interpreted kernel runs)."""

    @pytest.fixture(autouse=True, scope="module")
    def triton_interpreter() -> Iterator[None]:
        saved = set_interpret("1") if active else None
        yield
        if active:
            set_interpret(saved)

    return triton_interpreter


class KernelTestModule(NamedTuple):
    """What a kernel test module sets up at import (`kernel_test_module`)."""

    interpret: bool  # no CUDA: the kernels run under the interpreter
    in_child: bool  # this process cannot interpret: the module's tests skip, the child test runs them
    needs_interpreter: pytest.MarkDecorator  # for each test that runs a kernel here
    triton_interpreter: Callable[[], Iterator[None]]  # the module's autouse fixture
    child_test: Callable[[], None]  # `test_kernel_tests_in_child_process`


def kernel_test_module(kernel_modules: tuple[str, ...], file: str) -> KernelTestModule:
    """Call at a kernel test module's import, assigning the fields to module names (pytest
    collects the fixture and the child test from there):

        INTERPRET, IN_CHILD, needs_interpreter, triton_interpreter, test_kernel_tests_in_child_process = (
            triton_interp.kernel_test_module(("page_copy",), __file__)
        )
    """
    interpret, in_child = prepare(kernel_modules)
    if in_child:
        IN_CHILD_FILES.append(str(Path(file).resolve()))

    @pytest.mark.slow
    @pytest.mark.skipif(not in_child, reason="the kernel tests run in this process")
    def test_kernel_tests_in_child_process() -> None:
        run_file_in_child(file)

    setattr(test_kernel_tests_in_child_process, FILE_ATTR, str(Path(file).resolve()))

    return KernelTestModule(
        interpret,
        in_child,
        pytest.mark.skipif(in_child, reason=CHILD_REASON),
        interpreter_fixture(interpret and not in_child),
        test_kernel_tests_in_child_process,
    )


def group_child_tests(config: pytest.Config, items: list[pytest.Item]) -> None:
    """From tests/conftest.py's pytest_collection_modifyitems, after -k / -m have selected: if the
    group test is selected, the selected child tests of files this process cannot interpret are
    deselected and their files recorded in GROUPED_FILES, which the group test runs in one child.
    Without the group test (a few files picked by hand) each file keeps its own child test."""
    if not any(getattr(getattr(i, "function", None), GROUP_ATTR, False) for i in items):
        return
    grouped = [i for i in items if getattr(getattr(i, "function", None), FILE_ATTR, None) in IN_CHILD_FILES]
    if not grouped:
        return
    GROUPED_FILES[:] = [getattr(i.function, FILE_ATTR) for i in grouped]  # type: ignore[attr-defined]
    config.hook.pytest_deselected(items=grouped)
    gone = set(map(id, grouped))
    items[:] = [i for i in items if id(i) not in gone]


def run_file_in_child(*files: str, timeout_s: float = 900) -> None:
    """Run the test files in one fresh interpreter process with TRITON_INTERPRET=1. One file stops
    at its first failure; several all run, so that one file's failure hides none of the others'
    (the short summary at the end of the output names each)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    stop = ["-x"] if len(files) == 1 else []
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfE", *stop, "-p", "no:cacheprovider", "-W", "ignore", *files],
        env=env, cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def run_script_interpreted(script: str, timeout_s: float = 300) -> Any:
    """Run `script` (Python source) in a fresh interpreter process with TRITON_INTERPRET=1 and the
    repository on the path; return the JSON its last line of output holds."""
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(repo)}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=repo, capture_output=True, text=True, timeout=timeout_s
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
