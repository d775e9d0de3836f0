"""The dependency order of pyproject.toml's [tool.importlinter] contracts holds, and each contract
breaks when an import crosses it. `make lint` runs the same contracts (lint-imports); this module
puts them into `make test`, so CI fails when one breaks."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import grimp
import pytest
from importlinter import configuration
from importlinter.contracts.acyclic_siblings import AcyclicSiblingsContract
from importlinter.contracts.forbidden import ForbiddenContract
from importlinter.contracts.layers import LayersContract

REPO = Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
configuration.configure()  # what the lint-imports command sets up before checking (its timer)
KINDS = {
    "layers": LayersContract,
    "forbidden": ForbiddenContract,
    "acyclic_siblings": AcyclicSiblingsContract,
}


def graph() -> grimp.ImportGraph:
    """Every import of this tree's packages (the tree under test: REPO comes first on sys.path)."""
    if sys.path[0] != str(REPO):
        sys.path.insert(0, str(REPO))
    return grimp.build_graph(*CONFIG["root_packages"], cache_dir=None)


def broken(g: grimp.ImportGraph) -> set[str]:
    """The ids of the contracts `g` breaks."""
    out = set()
    for options in CONFIG["contracts"]:
        contract = KINDS[options["type"]](
            name=options["name"], session_options=CONFIG, contract_options=dict(options)
        )
        if not contract.check(g, verbose=False).kept:
            out.add(options["id"])
    return out


def test_lint_imports_passes() -> None:
    """The command `make lint` runs, on this tree."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    exe = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run(
        [str(exe), "--no-cache"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(CONFIG['contracts'])} kept, 0 broken" in proc.stdout


def test_every_package_is_in_a_contract() -> None:
    """A new top-level package would be outside every contract: it must be added to them."""
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests"}
    assert packages == set(CONFIG["root_packages"])


@pytest.mark.parametrize(
    ("importer", "imported", "contracts"),
    [
        # the trainer reaching into the inference engine: a layer it may not use
        ("trainer.model", "services.engine.models.causal_lm", {"trainer"}),
        ("trainer.train", "services.kvstore.client", {"trainer"}),
        # a lower layer importing a higher one
        ("services.common.config", "ops.fp8.recipe", {"layers"}),
        # (the trainer, which uses ops, would reach the engine through it)
        ("ops.fp8.dispatch", "services.engine.models.causal_lm", {"layers", "trainer"}),
        # (these two also close a cycle: the KV store's engine side imports the engine, decode the KV store)
        ("services.engine.models.causal_lm", "services.kvstore.client", {"layers", "acyclic"}),
        ("services.kvstore.client", "services.decode.server", {"layers", "acyclic"}),
        ("services.decode.server", "services.prefill.server", {"layers"}),
        ("services.orchestrator.loop", "trainer.train", {"layers"}),
        # a cycle inside a package
        ("services.engine.kv_cache", "services.engine.scheduler", {"acyclic"}),
        ("trainer.batch", "trainer.train", {"acyclic"}),
        ("services.common.schemas", "services.common.bus", {"acyclic"}),
        # product code reaching for a benchmark's kernel build
        ("ops.fp8.dispatch", "bench.kernels.fp8_wgmma_variants", {"product"}),
    ],
)
def test_a_crossing_import_breaks_its_contract(importer: str, imported: str, contracts: set[Any]) -> None:
    g = graph()
    assert importer in g.modules and imported in g.modules
    assert broken(g) == set()
    g.add_import(importer=importer, imported=imported, line_number=1, line_contents=f"import {imported}")
    assert broken(g) == contracts
