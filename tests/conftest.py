"""Shared pytest fixtures. Keep additions generic and additive: several areas use this file.
Fixtures and helpers that only a few modules share live in tests/helpers/ (a decode process,
random-weight HF models), imported as `from helpers.<module> import ...`."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.auth import REDIS_PASSWORD_ENV, TOKEN_ENV, new_token
from services.common.redis_server import RedisServer

# Every relay service requires the run token and every Redis the tests start a password
# (services/common/auth.py): the tests' own, in the environment of every process they start.
# Clients in tests send it with `auth_headers()`.
os.environ.setdefault(TOKEN_ENV, new_token())
os.environ.setdefault(REDIS_PASSWORD_ENV, new_token())


# `make test` hands whole modules to its two xdist workers (--dist loadfile) in collection order:
# the longest go first, so that neither worker is left running one of them alone at the end.
LONGEST_FIRST = [
    "test_interpreted_kernels.py",  # every interpreted kernel test file, in one child process
    "test_e2e.py",
    "test_faults_pipeline.py",
    "test_slurm_e2e.py",
    "test_trainer_run.py",
    "test_schemathesis.py",
    "test_verifiers_pipeline.py",
    "test_trainer_compile.py",
    "test_launch_budget.py",
    "test_dashboard.py",
    "test_parallel_decode.py",
]


@pytest.hookimpl(trylast=True)  # after -k / -m have selected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The interpreted kernel files this process cannot run go to one child process together.
    from helpers import triton_interp

    triton_interp.group_child_tests(config, items)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Redis-protocol server (bundled valkey) for the whole test session; yields its URL.
    Tests share it, so each one should use its own key prefix (e.g. a unique redis.prefix)."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: str) -> str:
    """The session Redis server's URL (alias of redis_server)."""
    return redis_server


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF weights directory (version 0) of the debug model, initialised by the trainer with
    seed 0. Session-scoped and shared: treat it as read-only."""
    from services.common.config import load_config
    from trainer.model import build_model, save_weights_dir  # imports torchtitan: only when used

    m = load_config("debug").model
    dest = tmp_path_factory.mktemp("model") / "step_0"
    return save_weights_dir(m, build_model(m, seed=0).state_dict(), dest, {"version": 0})


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[str]:
    """A real single-host Slurm cluster (sbatch/cluster.sh: installs slurm-wlm + munge with apt when
    missing, starts munged, slurmctld and virtual nodes; reuses a running one). Yields SLURM_CONF,
    which is also exported for the session. Skips only when Slurm is absent and apt-get is too.
    The cluster is left running: it is shared (other sessions may use it); `sbatch/cluster.sh stop`."""
    import os
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "sbatch" / "cluster.sh"
    proc = subprocess.run(["bash", str(script), "start"], capture_output=True, text=True, timeout=600)
    if proc.returncode == 3:
        pytest.skip(f"no Slurm here and no apt-get to install it: {proc.stderr.strip()}")
    assert proc.returncode == 0, f"sbatch/cluster.sh start failed:\n{proc.stdout}\n{proc.stderr}"
    conf = subprocess.run(["bash", str(script), "env"], capture_output=True, text=True, check=True)
    path = conf.stdout.strip().split("=", 1)[1]
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = path
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


@pytest.fixture(scope="session")
def bwrap() -> str:
    """bubblewrap's path, installing it with apt when missing (services/sandbox/install_bwrap.sh,
    idempotent). Skips only when bwrap is absent and apt-get is too."""
    import subprocess

    script = Path(__file__).resolve().parents[1] / "services" / "sandbox" / "install_bwrap.sh"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=600)
    if proc.returncode == 3:
        pytest.skip(f"no bubblewrap here and no apt-get to install it: {proc.stderr.strip()}")
    assert proc.returncode == 0, f"install_bwrap.sh failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(autouse=True)
def _one_slurm_test_at_a_time(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests of the one shared Slurm cluster run one at a time across processes (`make test` runs
    two pytest-xdist workers; another checkout's tests may use the same cluster): each waits for its
    job within a time limit, which a job queued behind another test's would eat. A file lock beside
    the cluster's slurm.conf, held for the test."""
    if "slurm_cluster" not in request.fixturenames:
        yield
        return
    import fcntl

    lock = Path(request.getfixturevalue("slurm_cluster")).with_name("tests.lock")
    with lock.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield
