"""The sandbox service over real HTTP: a real Redis, the sandbox as a subprocess with a resolved
config, its URL discovered through the registry exactly as the orchestrator does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from services.common.auth import auth_headers
from services.common.bus import Bus
from services.common.config import RedisSection, RunConfig, SandboxSection

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


class Sandbox:
    """One `python -m services.sandbox` process."""

    def __init__(self, tmp: Path, redis_url: str, **sandbox: object):
        self.prefix = f"test-sandbox-{uuid.uuid4().hex[:8]}"
        cfg = RunConfig(
            redis=RedisSection(url=redis_url, prefix=self.prefix), sandbox=SandboxSection(**sandbox)
        )
        tmp.mkdir(parents=True, exist_ok=True)
        self.config = tmp / "config.json"
        self.config.write_text(cfg.dump())
        self.log = tmp / "sandbox.log"
        self.bus = Bus(redis_url, self.prefix)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)])}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "services.sandbox",
                    "--config",
                    str(self.config),
                    "--redis-url",
                    redis_url,
                ],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.url = ""

    def wait_ready(self, timeout_s: float = 30.0) -> Sandbox:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sandbox exited {self.proc.returncode}:\n{self.log.read_text()}")
            found = self.bus.services("sandbox")
            if found:
                self.url = found[0].url
                try:
                    if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                        return self
                except httpx.TransportError:
                    pass  # registered during lifespan startup, a moment before it accepts connections
            time.sleep(0.05)
        raise TimeoutError(f"sandbox not ready after {timeout_s} s:\n{self.log.read_text()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def sandbox(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandbox]:
    sb = Sandbox(
        tmp_path_factory.mktemp("sandbox"), redis_server, plugins=["test_sandbox_plugin"]
    ).wait_ready()
    yield sb
    sb.stop()


@pytest.fixture(scope="module")
def small(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandbox]:
    sb = Sandbox(
        tmp_path_factory.mktemp("small"), redis_server, max_sessions=2, session_ttl_s=1.0
    ).wait_ready()
    yield sb
    sb.stop()


@pytest.fixture
def client(sandbox: Sandbox) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sandbox.url, timeout=10, headers=auth_headers()) as c:
        yield c


def create(c: httpx.Client, env: str, seed: int = 0) -> dict:
    r = c.post("/v1/sessions", json={"env": env, "seed": seed})
    assert r.status_code == 200, r.text
    return r.json()


def solve(context: str, env: str) -> str:
    if env == "reverse":
        return context[4:7][::-1]
    return context[-2]  # echo, echo-turns: the symbol before the trailing ':'


# ------------------------------------------------------------------ episodes


def test_lists_envs_with_plugin(client: httpx.Client) -> None:
    envs = {e["name"]: e for e in client.get("/v1/envs").json()["envs"]}
    assert {"reverse", "echo", "echo-turns", "guess", "test-add1"} <= set(envs)
    assert envs["echo-turns"]["max_turns"] == 3 and envs["guess"]["max_turns"] == 6
    assert all(e["description"] for e in envs.values())


@pytest.mark.parametrize("env", ["reverse", "echo", "echo-turns"])
def test_full_episode_correct(client: httpx.Client, env: str) -> None:
    s = create(client, env, seed=42)
    assert s["env"] == env
    context, turns = s["prompt"], 0
    while True:
        action = solve(context, env)
        r = client.post(f"/v1/sessions/{s['session_id']}/step", json={"action": action, "eos": True})
        assert r.status_code == 200, r.text
        step = r.json()
        turns += 1
        context += action + step["observation"]
        if step["done"]:
            break
    assert turns == s["max_turns"]
    # Stepping a finished episode is a conflict, not a new turn.
    r = client.post(f"/v1/sessions/{s['session_id']}/step", json={"action": "a"})
    assert r.status_code == 409 and "done" in r.json()["detail"]
    score = client.post(f"/v1/sessions/{s['session_id']}/score").json()
    assert score["reward"] == 1.0 and score["info"]["turns"] == turns
    # Scoring closed it.
    r = client.post(f"/v1/sessions/{s['session_id']}/step", json={"action": "a"})
    assert r.status_code == 404 and "closed" in r.json()["detail"]


def test_guess_episode_and_keep(client: httpx.Client) -> None:
    s = create(client, "guess", seed=9)
    sid, lo, hi = s["session_id"], 0, 15
    for _ in range(6):
        mid = (lo + hi) // 2
        step = client.post(f"/v1/sessions/{sid}/step", json={"action": str(mid)}).json()
        if step["observation"] == " <\n":
            hi = mid - 1
        elif step["observation"] == " >\n":
            lo = mid + 1
        if step["done"]:
            break
    assert step["observation"] == " =\n"
    first = client.post(f"/v1/sessions/{sid}/score", params={"keep": "true"}).json()
    assert 0.6 <= first["reward"] <= 1.0 and first["info"]["solved"] is True
    again = client.post(f"/v1/sessions/{sid}/score").json()  # kept, so scorable again; now closed
    assert again == first
    assert client.post(f"/v1/sessions/{sid}/score").status_code == 404


def test_wrong_answers_and_eos_flag(client: httpx.Client) -> None:
    s = create(client, "reverse", seed=1)
    right = solve(s["prompt"], "reverse")
    client.post(f"/v1/sessions/{s['session_id']}/step", json={"action": right, "eos": False})
    assert client.post(f"/v1/sessions/{s['session_id']}/score").json()["reward"] == 0.75
    s = create(client, "echo", seed=1)
    client.post(f"/v1/sessions/{s['session_id']}/step", json={"action": "!!!!!!"})
    assert client.post(f"/v1/sessions/{s['session_id']}/score").json()["reward"] == 0.0


def test_plugin_env_served(client: httpx.Client) -> None:
    s = create(client, "test-add1", seed=5)
    n = int(s["prompt"][4:-1])
    client.post(f"/v1/sessions/{s['session_id']}/step", json={"action": str((n + 1) % 10)})
    score = client.post(f"/v1/sessions/{s['session_id']}/score").json()
    # the plugin env gives no per-character credit (Environment.credit's default)
    assert score == {"reward": 1.0, "info": {"turns": 1, "done": True, "right": True}, "credit": None}


def test_seed_determinism_over_http(client: httpx.Client) -> None:
    a = [create(client, "reverse", seed=s) for s in range(8)]
    b = [create(client, "reverse", seed=s) for s in range(8)]
    assert [x["prompt"] for x in a] == [x["prompt"] for x in b]
    assert len({x["session_id"] for x in a + b}) == 16
    for x in a + b:
        assert client.delete(f"/v1/sessions/{x['session_id']}").status_code == 200


def test_concurrent_episodes(client: httpx.Client, sandbox: Sandbox) -> None:
    def episode(seed: int) -> float:
        with httpx.Client(base_url=sandbox.url, timeout=10, headers=auth_headers()) as c:
            s = create(c, "echo-turns", seed)
            context = s["prompt"]
            for _ in range(3):
                action = solve(context, "echo-turns")
                context += (
                    action
                    + c.post(f"/v1/sessions/{s['session_id']}/step", json={"action": action}).json()[
                        "observation"
                    ]
                )
            return c.post(f"/v1/sessions/{s['session_id']}/score").json()["reward"]

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(episode, range(32))) == [1.0] * 32
    assert client.get("/health").json()["sessions_open"] == 0


# ------------------------------------------------------------------ 4xx


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "env"),
        ({"env": ""}, "env"),
        ({"env": 3}, "env"),
        ({"env": "echo", "seed": "abc"}, "seed"),
        ({"env": "echo", "sed": 1}, "sed"),
        ({"env": "no-such-env"}, "env"),
    ],
)
def test_create_errors_name_the_field(client: httpx.Client, body: dict, field: str) -> None:
    r = client.post("/v1/sessions", json=body)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert detail.startswith(f"{field}:"), detail
    if body.get("env") == "no-such-env":
        assert "known: echo, echo-turns, guess, reverse" in detail
        assert r.json()["errors"][0]["loc"] == ["body", "env"]


def test_step_errors(client: httpx.Client) -> None:
    r = client.post("/v1/sessions/nope/step", json={"action": "a"})
    assert r.status_code == 404 and "unknown session 'nope'" in r.json()["detail"]
    assert client.post("/v1/sessions/nope/score").status_code == 404
    assert client.delete("/v1/sessions/nope").status_code == 404
    sid = create(client, "echo")["session_id"]
    for body, field in [({}, "action"), ({"action": 5}, "action"), ({"action": "a", "eos": "maybe"}, "eos")]:
        r = client.post(f"/v1/sessions/{sid}/step", json=body)
        assert r.status_code == 422 and r.json()["detail"].startswith(f"{field}:"), r.text
    r = client.post(
        f"/v1/sessions/{sid}/step", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 422
    assert client.delete(f"/v1/sessions/{sid}").status_code == 200
    r = client.delete(f"/v1/sessions/{sid}")
    assert r.status_code == 404 and "deleted" in r.json()["detail"]


def test_steps_of_many_sessions_in_one_call(client: httpx.Client) -> None:
    """POST /v1/sessions/steps: each item as its own /step call would answer (scored and closed
    with score=true, credit with credit=true), errors per item, the rest unharmed."""
    group = client.post("/v1/sessions/batch", json={"env": "reverse", "seed": 4, "n": 3}).json()["sessions"]
    right = solve(group[0]["prompt"], "reverse")
    done = create(client, "reverse", seed=1)["session_id"]
    assert client.post(f"/v1/sessions/{done}/step", json={"action": "abc"}).status_code == 200
    steps = [
        {"session_id": group[0]["session_id"], "action": right},
        {"session_id": group[1]["session_id"], "action": right, "eos": False},
        {"session_id": "nope", "action": right},
        {"session_id": done, "action": "abc"},
        {"session_id": group[2]["session_id"], "action": "xyz"},
    ]
    r = client.post("/v1/sessions/steps", params={"score": "true", "credit": "true"}, json={"steps": steps})
    assert r.status_code == 200, r.text
    # One JSON line per step, in the order the steps finished, each naming its step's index.
    res = sorted((json.loads(line) for line in r.text.splitlines()), key=lambda x: x["i"])
    assert [x["i"] for x in res] == [0, 1, 2, 3, 4]
    assert [x["status"] for x in res] == [200, 200, 404, 409, 200]
    assert res[0]["response"]["reward"] == 1.0 and res[0]["response"]["credit"] == [[1.0, 1.0, 1.0, 1.0]]
    assert res[1]["response"]["reward"] == 0.75 and res[1]["response"]["credit"] == [[1.0, 1.0, 1.0, 0.0]]
    assert "unknown session 'nope'" in res[2]["detail"] and res[2]["response"] is None
    assert "done" in res[3]["detail"]
    assert res[4]["response"]["reward"] == 0.25  # three wrong letters, ended right after three
    # score=true closed every scored session
    for s in group:
        assert client.get(f"/v1/sessions/{s['session_id']}").status_code == 404
    for body, field in [
        ({"steps": []}, "steps"),
        ({"steps": [{"action": "a"}]}, "session_id"),
        ({}, "steps"),
    ]:
        r = client.post("/v1/sessions/steps", json=body)
        assert r.status_code == 422 and field in r.json()["detail"], r.text


def test_health_and_metrics(client: httpx.Client) -> None:
    sid = create(client, "reverse", 3)["session_id"]
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["sessions_open"] >= 1 and health["created"] >= 1
    assert "reverse" in health["envs"]
    client.post(f"/v1/sessions/{sid}/step", json={"action": "abc"})
    client.post(f"/v1/sessions/{sid}/score")
    text = client.get("/metrics").text
    for needle in [
        'relay_sandbox_sessions_created_total{env="reverse"}',
        'relay_sandbox_steps_total{env="reverse"}',
        'relay_sandbox_reward_bucket{env="reverse",le="1.0"}',
        'relay_sandbox_sessions_closed_total{env="reverse",how="score"}',
        "relay_sandbox_sessions_open",
    ]:
        assert needle in text, needle


# ------------------------------------------------------------------ limits, expiry, lifecycle


def test_full_then_expiry_frees_slots(small: Sandbox) -> None:
    with httpx.Client(base_url=small.url, timeout=10, headers=auth_headers()) as c:
        a, b = create(c, "echo"), create(c, "guess")
        r = c.post("/v1/sessions", json={"env": "echo"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert "max_sessions=2" in r.json()["detail"]
        # Keep `a` alive by touching it; `b` idles past the 1 s ttl and is swept.
        for _ in range(6):
            time.sleep(0.25)
            assert c.get(f"/v1/sessions/{a['session_id']}").status_code == 200
        r = c.post(f"/v1/sessions/{b['session_id']}/step", json={"action": "7"})
        assert r.status_code == 404 and "expired" in r.json()["detail"], r.text
        c3 = create(c, "echo")  # the slot came back
        health = c.get("/health").json()
        assert health["sessions_open"] == 2 and health["expired"] >= 1
        assert 'relay_sandbox_sessions_expired_total{env="guess"} 1.0' in c.get("/metrics").text
        time.sleep(1.8)  # everything idles out: nothing leaks
        assert c.get("/health").json()["sessions_open"] == 0
        assert c.post(f"/v1/sessions/{c3['session_id']}/score").status_code == 404


def test_sigterm_exits_zero_and_deregisters(redis_server: str, tmp_path: Path) -> None:
    sb = Sandbox(tmp_path, redis_server).wait_ready()
    assert sb.bus.services("sandbox")
    assert sb.stop() == 0, sb.log.read_text()
    assert sb.bus.services("sandbox") == []


def test_bad_plugin_fails_at_start(redis_server: str, tmp_path: Path) -> None:
    sb = Sandbox(tmp_path, redis_server, plugins=["no_such_plugin_module"])
    assert sb.proc.wait(30) == 2
    assert "cannot import 'no_such_plugin_module'" in sb.log.read_text()


def test_hostile_commands_and_paths_are_a_422_naming_the_field(client: httpx.Client) -> None:
    """What a command line or a C path cannot hold is refused before anything runs: a NUL byte,
    a command over one argument's limit (MAX_ARG_STRLEN), a NUL in a file path; and a 422 that
    echoes a NaN back stays valid JSON."""
    sid = create(client, "echo")["session_id"]
    cases = [
        ("post", f"/v1/sessions/{sid}/exec", {"json": {"cmd": "echo a\x00b"}}, "cmd"),
        ("post", f"/v1/sessions/{sid}/exec", {"json": {"cmd": "x" * (128 << 10)}}, "cmd"),
        ("put", f"/v1/sessions/{sid}/files", {"json": {"path": "a\x00b", "content": "x"}}, "path"),
        ("get", f"/v1/sessions/{sid}/files", {"params": {"path": "a\x00b"}}, "path"),
        ("get", f"/v1/sessions/{sid}/files", {"params": {"path": "a" * 4097}}, "path"),
        ("post", "/v1/sessions", {"content": b'{"env": "echo", "seed": NaN}'}, "seed"),
        (
            "post",
            f"/v1/sessions/{sid}/exec",
            {"content": b'{"cmd": "true", "timeout_s": Infinity}'},
            "timeout_s",
        ),
    ]
    for method, path, kw, field in cases:
        if "content" in kw:
            kw = {**kw, "headers": {"content-type": "application/json"}}
        r = client.request(method.upper(), path, **kw)
        assert r.status_code == 422, (path, field, r.text[:300])
        assert field in r.json()["detail"], r.text[:300]
    # A command over the sandbox's body limit is refused before it is read.
    r = client.post(f"/v1/sessions/{sid}/exec", json={"cmd": "x" * (17 << 20)})
    assert r.status_code == 413 and "sandbox.max_request_bytes" in r.json()["detail"]


def test_orchestrator_client_sends_a_groups_steps_in_one_request(sandbox: Sandbox) -> None:
    """The orchestrator's SandboxClient: the steps a group's samples send together travel as one
    POST /v1/sessions/steps (counted on the wire), each caller gets its own answer, a failing
    session fails only its own caller, and a caller that gave up does not disturb the others."""
    import asyncio

    import aiohttp

    from services.common.auth import auth_headers
    from services.common.registry import Registry
    from services.orchestrator.clients import Router, SandboxClient

    async def main() -> None:
        sent: list[str] = []

        async def on_start(_s: object, _ctx: object, params: aiohttp.TraceRequestStartParams) -> None:
            sent.append(f"{params.method} {params.url.path}")

        trace = aiohttp.TraceConfig()
        trace.on_request_start.append(on_start)
        async with aiohttp.ClientSession(headers=auth_headers(), trace_configs=[trace]) as http:
            client = SandboxClient(http, Router(Registry(sandbox.bus.services), "sandbox"), credit=True)
            group = await client.open_group("reverse", 7, 16)
            right = solve(group[0].prompt, "reverse")
            sent.clear()
            out = await asyncio.gather(
                *(s.step(right if i % 2 else "xyz", eos=True) for i, s in enumerate(group))
            )
            assert sent == ["POST /v1/sessions/steps"]
            assert [o.reward for o in out] == [0.25 if i % 2 == 0 else 1.0 for i in range(16)]
            assert all(s.closed for s in group) and out[1].credit == [[1.0, 1.0, 1.0, 1.0]]

            # Stepping a closed session fails that caller alone (a 4xx: ValueError).
            more = await client.open_group("reverse-turns", 3, 2)
            sent.clear()
            res = await asyncio.gather(
                group[0].step("abc", True), more[0].step("abc", True), return_exceptions=True
            )
            assert sent == ["POST /v1/sessions/steps"]
            assert isinstance(res[0], ValueError) and "404" in str(res[0])
            assert not isinstance(res[1], BaseException) and res[1].done is False
            # A caller that stops waiting (its turn timed out) leaves the batch to the others.
            slow = asyncio.ensure_future(more[1].step("abc", True))
            await asyncio.sleep(0)
            slow.cancel()
            again = await more[0].step("cba", True)
            assert again.done is False and len(sent) == 2

    asyncio.run(main())
