"""Property-based API testing of every service over real HTTP: schemathesis generates requests from
each service's own OpenAPI document, valid ones (positive) and ones that break it (negative), and
checks every response: no 5xx, responses as documented (status, content type, body schema), and
data that breaks the schema refused with a 4xx.

The budget is fixed and small (`EXAMPLES` per operation and mode, at most `BUDGET_S` seconds a
service) and the generation deterministic (hypothesis' derandomize), so a failure reproduces.
The services run as processes the way the launcher starts them: decode and prefill on the debug
model, the KV store gateway, the sandbox (bubblewrap: commands really run, isolated), and the
orchestrator (on its own Redis prefix, so it starts no rollouts against the others)."""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import schemathesis
from helpers.sandbox import session_root
from helpers.service_process import start_with_config, wait_registered
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from services.common.auth import auth_headers
from services.common.bus import Bus
from services.common.config import EngineConfig, RunConfig, load_config
from services.common.schemas import WeightsInfo

EXAMPLES = 6  # per operation and generation mode, at most
BUDGET_S = 16.0  # per service, shared evenly by its operations and modes (each makes at least one call)
pytestmark = pytest.mark.slow

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@dataclass
class Services:
    urls: dict[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)


@pytest.fixture(scope="module")
def services(
    redis_url: str, model_dir: Path, bwrap: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Services]:
    tmp = tmp_path_factory.mktemp("schemathesis")
    prefix = f"test-st-{uuid.uuid4().hex[:8]}"
    bus = Bus(redis_url, prefix)
    bus.publish_weights(WeightsInfo(version=0, path=str(model_dir)))
    base = RunConfig(model=load_config("debug").model)
    base.redis.url, base.redis.prefix = redis_url, prefix
    base.decode.engine = EngineConfig(device="cpu", max_batch_size=8, max_seq_len=32)
    with session_root("relay-st-") as root:
        base.sandbox.workdir_root = str(root)
        base.sandbox.exec_timeout_s = 5.0
        base.sandbox.exec_max_timeout_s = 5.0
        gateway = base.model_copy(deep=True)
        gateway.kvstore.enabled = True
        orch = base.model_copy(deep=True)
        orch.redis.prefix = f"{prefix}-orch"  # no services or weights there: it stays idle
        plan = {
            "decode": ("services.decode", base, bus),
            "sandbox": ("services.sandbox", base, bus),
            "kvstore": ("services.kvstore", gateway, bus),
            "prefill": ("services.prefill", gateway, bus),
            "orchestrator": ("services.orchestrator", orch, Bus(redis_url, orch.redis.prefix)),
        }
        s = Services()
        for kind, (module, cfg, _bus) in plan.items():
            s.procs[kind] = start_with_config(module, cfg, redis_url, tmp, kind)
            s.logs[kind] = tmp / f"{kind}.log"
        try:
            for kind, (_module, _cfg, kbus) in plan.items():
                (s.urls[kind],) = wait_registered(kbus, kind, s.procs[kind], s.logs[kind], timeout_s=120)
            for kind in ("decode", "prefill"):  # engines up (weights loaded): no 503 while fuzzing
                deadline = time.monotonic() + 120
                while httpx.get(f"{s.urls[kind]}/health").json()["status"] != "ok":
                    assert s.procs[kind].poll() is None, s.logs[kind].read_text()[-3000:]
                    assert time.monotonic() < deadline, f"{kind} did not load its weights"
                    time.sleep(0.2)
            yield s
        finally:
            for p in s.procs.values():
                p.terminate()
            for p in s.procs.values():
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def runner(
    url: str, op: schemathesis.APIOperation, mode: GenerationMode, deadline: float, calls: list[str]
) -> Callable[[], None]:
    """A hypothesis test that calls `op` with generated cases and checks each response; each call
    is appended to `calls`."""
    auth = auth_headers()
    checks = [*CHECKS, negative_data_rejection] if mode is GenerationMode.NEGATIVE else CHECKS

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        if time.monotonic() > deadline and any(c.startswith(f"{op.label} [{mode.value}]") for c in calls):
            return
        response = case.call(base_url=url, headers=auth, timeout=30)
        calls.append(f"{op.label} [{mode.value}] {response.status_code}")
        if case.path.endswith("/pause") and response.status_code == 200:
            httpx.post(f"{url}{case.path.removesuffix('/pause')}/resume", headers=auth, timeout=30)
        case.validate_response(response, checks=checks)

    return run


def fuzz(url: str) -> tuple[list[str], list[str], int]:
    """Run every operation of the service at `url` in both modes: (the failures, one line each;
    the calls made; the number of operations)."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    failures: list[str] = []
    calls: list[str] = []
    operations = [r.ok() for r in schema.get_all_operations()]
    ops = len(operations)
    share = BUDGET_S / (2 * ops)
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                runner(url, op, mode, time.monotonic() + share, calls)()
            except Unsatisfiable:
                pass  # nothing to break: the operation takes no input (negative mode)
            except (Exception, BaseExceptionGroup) as e:  # noqa: BLE001 - collect them all, then report
                failures.append(f"{op.label} [{mode.value}]: {type(e).__name__}: {str(e)[:1500]}")
    return failures, calls, ops


@pytest.mark.parametrize("kind", ["decode", "prefill", "kvstore", "sandbox", "orchestrator"])
def test_no_server_errors_and_responses_as_documented(services: Services, kind: str) -> None:
    failures, calls, ops = fuzz(services.urls[kind])
    assert services.procs[kind].poll() is None, services.logs[kind].read_text()[-3000:]
    assert not failures, "\n\n".join(failures)
    # Every operation was called (the budget was not spent before the last one).
    called = {c.split(" [")[0] for c in calls}
    assert len(called) == ops, (sorted(called), ops)
