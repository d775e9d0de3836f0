"""HTTP clients for the services the orchestrator drives, with routing over the live registry.

aiohttp, not httpx, on this hot path: a rollout group costs tens of requests, and on loopback
httpx spent ~3 ms of CPU per request (its connection pool scans every connection per request)
against ~0.25 ms for aiohttp, which made the orchestrator the bottleneck of the whole loop.

A request that fails because its service vanished (connection error, 5xx, timeout) raises
`ServiceUnavailable`; the rollout code re-issues the whole turn on another live replica, so a
crashed decode or sandbox loses no rollout.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict

import aiohttp

from services.common.registry import Registry
from services.common.schemas import (
    CreateSessionResponse,
    CreateSessionsRequest,
    CreateSessionsResponse,
    GenerateRequest,
    GenerateResponse,
    ScoreResponse,
    SessionStep,
    StepResponse,
    StepResult,
    StepsRequest,
    UpdateWeightsRequest,
    VerifiersGroupRequest,
    VerifiersGroupResponse,
)
from services.orchestrator.metrics import AFFINITY


class ServiceUnavailable(RuntimeError):
    """The chosen replica could not serve the request; retry elsewhere."""


class NoLiveService(ServiceUnavailable):
    pass


class Router:
    """Least-outstanding-requests choice among live replicas of one kind, with affinity: a
    preferred replica (where a sample's previous turn ran) is kept while its load is within
    `affinity_slack` requests of the least-loaded one."""

    def __init__(self, registry: Registry, kind: str, affinity_slack: int | None = None):
        self.registry, self.kind = registry, kind
        self.affinity_slack = affinity_slack
        self.outstanding: dict[str, int] = defaultdict(int)
        self._rr = itertools.count()

    async def pick(self, prefer: str | None = None) -> str:
        infos = await self.registry.live(self.kind)
        if not infos:
            infos = await self.registry.live(self.kind, force=True)
        if not infos:
            raise NoLiveService(f"no live {self.kind} service")
        tie = next(self._rr)
        best = min(range(len(infos)), key=lambda j: (self.outstanding[infos[j].url], (j - tie) % len(infos)))
        least = infos[best].url
        if prefer is None or self.affinity_slack is None:
            return least
        # A replica that is no longer live (crashed, quarantined) is simply not among `infos`.
        kept = any(i.url == prefer for i in infos) and (
            self.outstanding[prefer] <= self.outstanding[least] + self.affinity_slack
        )
        AFFINITY.labels(self.kind, "kept" if kept else "moved").inc()
        return prefer if kept else least


TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError)


JSON_HEADERS = {"Content-Type": "application/json"}


async def _post(client: aiohttp.ClientSession, url: str, body: object | None = None) -> bytes:
    """POST and return the body; transport failures and 5xx raise ServiceUnavailable.

    `body` is a JSON-able object, or an already serialised JSON document (str/bytes), sent as is."""
    try:
        if isinstance(body, str | bytes):
            request = client.post(url, data=body, headers=JSON_HEADERS)
        else:
            request = client.post(url, json=body)
        async with request as resp:
            content = await resp.read()
            status = resp.status
    except TRANSPORT_ERRORS as e:
        raise ServiceUnavailable(f"{url}: {type(e).__name__}: {e}") from e
    if status >= 400:
        raise http_error(status, f"{url}: HTTP {status}: {content[:500]!r}")
    return content


def http_error(status: int, message: str) -> Exception:
    """A 5xx: the replica could not serve it (retry elsewhere). A 4xx is our own bug (a bad
    request), not a vanished service: never retried blindly."""
    return ServiceUnavailable(message) if status >= 500 else ValueError(message)


class DecodeClient:
    def __init__(self, client: aiohttp.ClientSession, router: Router):
        self.client, self.router = client, router

    async def generate(self, req: GenerateRequest, prefer: str | None = None) -> tuple[str, GenerateResponse]:
        """Returns the replica that served the request (a later turn's `prefer`) and its answer."""
        url = await self.router.pick(prefer)
        self.router.outstanding[url] += 1
        try:
            # pydantic's Rust serialiser writes the JSON directly: at ~90k-token contexts
            # json.dumps(model_dump()) cost 13-24 ms per turn, model_dump_json() 2.5-8 ms.
            resp = await _post(self.client, f"{url}/v1/generate", req.model_dump_json())
        except ServiceUnavailable:
            self.router.registry.forget(url)
            raise
        finally:
            self.router.outstanding[url] -= 1
        return url, GenerateResponse.model_validate_json(resp)

    async def update_weights(self, url: str, path: str, version: int) -> None:
        body = UpdateWeightsRequest(path=path, version=version).model_dump()
        await _post(self.client, f"{url}/update_weights", body)

    async def health(self, url: str) -> dict[str, object]:
        try:
            async with self.client.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=5.0)) as resp:
                return dict(await resp.json())
        except (*TRANSPORT_ERRORS, ValueError):
            return {}


class StepBatcher:
    """Sends the steps that sessions of one sandbox replica issue together as one request
    (POST /v1/sessions/steps). A group's samples get their turns back from decode at the same
    moment (the first turn is one request for all of them; later turns finish in the same engine
    step) and step at once: one HTTP round trip per group turn instead of one per sample, which
    on a small machine was the sandbox's and the orchestrator's largest CPU cost per rollout.
    Steps wait at most `window_s` for company; each caller gets its own result or exception."""

    MAX_ITEMS = 256

    def __init__(self, client: aiohttp.ClientSession, url: str, query: str, window_s: float = 0.002):
        self.client, self.url, self.query, self.window_s = client, url, query, window_s
        self.pending: list[tuple[SessionStep, asyncio.Future[StepResponse]]] = []
        self.flushing: asyncio.TimerHandle | None = None
        self.sending: set[asyncio.Task[None]] = set()  # the loop keeps only weak references

    async def step(self, session_id: str, action: str, eos: bool) -> StepResponse:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[StepResponse] = loop.create_future()
        self.pending.append((SessionStep(session_id=session_id, action=action, eos=eos), fut))
        if len(self.pending) >= self.MAX_ITEMS:
            self._flush()
        elif self.flushing is None:
            self.flushing = loop.call_later(self.window_s, self._flush)
        return await fut

    def _flush(self) -> None:
        if self.flushing is not None:
            self.flushing.cancel()
            self.flushing = None
        batch, self.pending = self.pending, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self.sending.add(task)
            task.add_done_callback(self.sending.discard)

    async def _send(self, batch: list[tuple[SessionStep, asyncio.Future[StepResponse]]]) -> None:
        """One request; the sandbox streams each step's result (a JSON line) as it completes, and
        each caller is answered then, so a slow step holds back no other."""
        url = f"{self.url}/v1/sessions/steps?score=true{self.query}"
        body = StepsRequest(steps=[item for item, _ in batch]).model_dump_json()
        try:
            async with self.client.post(url, data=body, headers=JSON_HEADERS) as resp:
                if resp.status >= 400:
                    content = await resp.read()
                    raise http_error(resp.status, f"{url}: HTTP {resp.status}: {content[:500]!r}")
                async for line in resp.content:
                    if line.strip():
                        self._answer(batch, StepResult.model_validate_json(line))
        except TRANSPORT_ERRORS as e:
            self._fail(batch, ServiceUnavailable(f"{url}: {type(e).__name__}: {e}"))
        except Exception as e:  # noqa: BLE001 - every caller still waiting sees the failure
            self._fail(batch, e)
        else:
            self._fail(batch, ServiceUnavailable(f"{url}: the answer ended before every step's result"))

    def _answer(self, batch: list[tuple[SessionStep, asyncio.Future[StepResponse]]], r: StepResult) -> None:
        item, fut = batch[r.i]
        if fut.done():  # its caller gave up (turn timeout): the step still happened
            return
        if r.response is not None:
            fut.set_result(r.response)
        else:
            fut.set_exception(
                http_error(r.status, f"{self.url} session {item.session_id}: HTTP {r.status}: {r.detail}")
            )

    @staticmethod
    def _fail(batch: list[tuple[SessionStep, asyncio.Future[StepResponse]]], e: Exception) -> None:
        for _, fut in batch:
            if not fut.done():
                fut.set_exception(e)


class SandboxSession:
    """One environment episode, pinned to the sandbox replica that holds its state."""

    def __init__(
        self,
        client: aiohttp.ClientSession,
        url: str,
        created: CreateSessionResponse,
        credit: bool,
        steps: StepBatcher,
    ):
        self.client, self.url, self.created, self.steps = client, url, created, steps
        # ask for the env's per-character credit with the reward (orchestrator.advantage = "token")
        self.credit_query = "&credit=true" if credit else ""
        self.closed = False

    @property
    def prompt(self) -> str:
        return self.created.prompt

    async def step(self, action: str, eos: bool) -> StepResponse:
        """Step; if that ends the episode the sandbox scores and closes it in the same call."""
        out = await self.steps.step(self.created.session_id, action, eos)
        self.closed = out.reward is not None
        return out

    async def score(self) -> ScoreResponse:
        query = f"?{self.credit_query[1:]}" if self.credit_query else ""
        resp = await _post(self.client, f"{self.url}/v1/sessions/{self.created.session_id}/score{query}")
        self.closed = True
        return ScoreResponse.model_validate_json(resp)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            async with self.client.delete(f"{self.url}/v1/sessions/{self.created.session_id}"):
                pass
        except TRANSPORT_ERRORS:
            pass  # the sandbox expires abandoned sessions itself


class SandboxClient:
    def __init__(self, client: aiohttp.ClientSession, router: Router, credit: bool = False):
        self.client, self.router = client, router
        self.credit = credit  # sessions ask for the env's per-character credit (token credit)
        self.batchers: dict[str, StepBatcher] = {}  # one per replica: its sessions' steps

    async def open_group(self, env: str, seed: int, n: int) -> list[SandboxSession]:
        """n episodes of one task on one replica, in one round trip."""
        url = await self.router.pick()
        body = CreateSessionsRequest(env=env, seed=seed, n=n).model_dump()
        try:
            resp = await _post(self.client, f"{url}/v1/sessions/batch", body)
        except ServiceUnavailable:
            self.router.registry.forget(url)
            raise
        created = CreateSessionsResponse.model_validate_json(resp).sessions
        steps = self.batchers.get(url)
        if steps is None:
            steps = self.batchers[url] = StepBatcher(self.client, url, "&credit=true" if self.credit else "")
        return [SandboxSession(self.client, url, c, self.credit, steps) for c in created]

    async def verifiers_group(
        self, env: str, req: VerifiersGroupRequest, timeout_s: float
    ) -> VerifiersGroupResponse:
        """A whole group of a verifiers environment, run by the sandbox against decode: one call
        that lasts the group's episode, hence its own timeout."""
        url = await self.router.pick()
        try:
            async with self.client.post(
                f"{url}/v1/verifiers/{env}/group",
                data=req.model_dump_json(),
                headers=JSON_HEADERS,
                timeout=aiohttp.ClientTimeout(total=timeout_s, connect=5.0),
            ) as resp:
                content = await resp.read()
                status = resp.status
        except TRANSPORT_ERRORS as e:
            self.router.registry.forget(url)
            raise ServiceUnavailable(f"{url}: {type(e).__name__}: {e}") from e
        if status >= 400:
            raise http_error(status, f"{url}: HTTP {status}: {content[:500]!r}")
        return VerifiersGroupResponse.model_validate_json(content)
