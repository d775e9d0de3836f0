"""AsyncEngine: drives an LLMEngine's step loop from a background thread for asyncio callers.

Only the loop thread touches the engine's scheduler and weights. Callers hand it work through an
inbox under a condition variable: new requests and weight updates are taken in at step
boundaries, so a request arriving mid-step joins the next one and a weight swap never lands
in the middle of a forward pass. Results come back through concurrent futures.

With EngineConfig.stage_weights a second thread, the stager, writes each update into the
engine's staging copy of the weights while the loop keeps stepping, then hands it to the loop,
which only swaps it in at the next step boundary; the stager waits for that swap before it
stages the next update (one staging copy).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from services.common.schemas import GenerateRequest, GenerateResponse
from services.engine.llm_engine import LLMEngine
from services.engine.loader import Checkpoint
from services.engine.sequence import RequestState

log = logging.getLogger(__name__)
T = TypeVar("T")


def _resolve(fut: Future[T], value: T | None = None, error: BaseException | None = None) -> None:
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)  # type: ignore[arg-type]
    except InvalidStateError:
        pass  # the caller gave up (cancelled) meanwhile


@dataclass
class WeightUpdate:
    ckpt: Checkpoint
    version: int
    fut: Future[int]
    # Seconds its staging took (EngineConfig.stage_weights), once staged: the loop then swaps.
    stage_s: float | None = None
    # Set once the loop has applied (or swapped in) the update, or given it up: the stager then
    # may write the staging copy again.
    done: threading.Event = field(default_factory=threading.Event)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._cv = threading.Condition()
        self._inbox: list[tuple[GenerateRequest, Future[GenerateResponse]]] = []
        self._weights: list[WeightUpdate] = []  # for the loop: to apply, or staged to swap in
        self._staging: list[WeightUpdate] = []  # for the stager (EngineConfig.stage_weights)
        self._waiters: dict[RequestState, Future[GenerateResponse]] = {}
        self._paused = False
        self._stopping = False
        # Held by the loop while it works on the engine; pause() takes it to wait out a step in flight.
        self._busy = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._stager: threading.Thread | None = None
        if engine.stager is not None:
            self._stager = threading.Thread(target=self._stage_loop, name="weight-stager", daemon=True)

    # ------------------------------------------------------------------ control

    def start(self) -> AsyncEngine:
        self.engine.background = True
        self._thread.start()
        if self._stager is not None:
            self._stager.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the loop; unfinished requests complete with finish_reason "abort"."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def fail(self, reason: str) -> None:
        """The engine cannot run another step (e.g. a rank of a multi-rank engine died): every
        request waiting or in flight fails now with `reason` and new ones are refused, without
        waiting for the loop thread, which may be blocked in a collective with a dead peer."""
        error = RuntimeError(reason)
        with self._cv:
            self._stopping = True
            inbox, self._inbox = self._inbox, []
            weights, self._weights = self._weights + self._staging, []
            self._staging = []
            self._cv.notify_all()
        # The loop thread owns _waiters; a snapshot is enough: a future answered twice is ignored.
        for fut in [*(f for _r, f in inbox), *(u.fut for u in weights), *list(self._waiters.values())]:
            _resolve(fut, error=error)
        for u in weights:
            u.done.set()

    def pause(self) -> None:
        """No steps run once this returns; requests queue. Weight updates still apply."""
        with self._cv:
            self._paused = True
        with self._busy:
            # Overlap scheduling: land the step in flight too (the loop thread is out of the engine
            # while we hold _busy), so paused means no tokens pending and finished requests answered.
            self._land_in_flight()

    def _land_in_flight(self) -> None:
        """Land the step in flight (overlap scheduling) and answer the requests it finished; if
        landing fails (a device error), fail every request as a failed step does. Hold _busy."""
        if not self.engine.in_flight:
            return
        try:
            finished = self.engine.flush()
        except Exception as e:  # noqa: BLE001 - fail the requests, keep serving
            self._fail_all("landing the step in flight", e)
            return
        self._answer(finished)

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def alive(self) -> bool:
        """The loop thread runs (or was asked to stop): false means no request is served again."""
        return self._stopping or self._thread.is_alive()

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def num_waiting(self) -> int:
        """Sequences not yet admitted (queued in the engine, or in the inbox, as 1 per sample)."""
        inbox = sum(r.sampling.n for r, _ in list(self._inbox))
        return inbox + self.engine.num_waiting

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    # ------------------------------------------------------------------ asyncio API

    async def submit(self, req: GenerateRequest) -> GenerateResponse:
        """Generate; raises InvalidRequest at once for a request the engine cannot serve."""
        self.engine.validate(req)
        fut: Future[GenerateResponse] = Future()
        with self._cv:
            if self._stopping:
                raise RuntimeError("engine is stopping")
            self._inbox.append((req, fut))
            self._cv.notify_all()
        return await asyncio.wrap_future(fut)

    async def load_weights(self, path: str | Path, version: int) -> int:
        """Read the directory here (raises WeightsError), swap at the next step boundary (staged
        first by the stager with EngineConfig.stage_weights: a load error is raised here and the
        old weights stay live), return once the new weights are live."""
        ckpt = await asyncio.to_thread(self.engine.read_weights, path)
        update = WeightUpdate(ckpt, version, Future())
        with self._cv:
            if self._stopping:
                raise RuntimeError("engine is stopping")
            (self._weights if self._stager is None else self._staging).append(update)
            self._cv.notify_all()
        return await asyncio.wrap_future(update.fut)

    # ------------------------------------------------------------------ the loop

    def _has_work(self) -> bool:
        return bool(self._inbox or self._weights) or (not self._paused and self.engine.has_work())

    def _run(self) -> None:
        stats = self.engine.stats
        while True:
            with self._cv:
                while not self._stopping and not self._has_work():
                    idle = not self._paused
                    t0 = time.monotonic()
                    self._cv.wait(0.5)
                    if idle:
                        stats.idle_seconds_total += time.monotonic() - t0
                if self._stopping:
                    break
                inbox, self._inbox = self._inbox, []
                weights, self._weights = self._weights, []
                self._busy.acquire()
            try:
                self._work(inbox, weights)
            finally:
                self._busy.release()
        self._shutdown()

    def _stage_loop(self) -> None:
        """The stager (EngineConfig.stage_weights): stage one update while the loop steps, hand
        it to the loop, wait for its swap, take the next."""
        while True:
            with self._cv:
                while not self._stopping and not self._staging:
                    self._cv.wait()
                if self._stopping:
                    return
                update = self._staging.pop(0)
            try:
                update.stage_s = self.engine.stage_weights(update.ckpt)
            except Exception as e:  # noqa: BLE001 - reported to the caller; the old weights stay live
                _resolve(update.fut, error=e)
                continue
            with self._cv:
                if self._stopping:
                    _resolve(update.fut, error=RuntimeError("engine stopped"))
                    return
                self._weights.append(update)
                self._cv.notify_all()
            while not update.done.wait(0.5):
                if self._stopping and not self._thread.is_alive():
                    return

    def _work(
        self, inbox: list[tuple[GenerateRequest, Future[GenerateResponse]]], weights: list[WeightUpdate]
    ) -> None:
        for u in weights:
            try:
                if u.stage_s is None:
                    self.engine.apply_weights(u.ckpt, u.version)
                else:
                    self.engine.swap_weights(u.ckpt, u.version, u.stage_s)
                _resolve(u.fut, u.version)
            except Exception as e:  # noqa: BLE001 - reported to the caller
                _resolve(u.fut, error=e)
            finally:
                u.done.set()
        for req, rfut in inbox:
            try:
                self._waiters[self.engine.add_request(req)] = rfut
            except Exception as e:  # noqa: BLE001 - reported to the caller
                _resolve(rfut, error=e)
        if self._paused:  # read while holding _busy, so pause() returns only after this check
            return
        try:
            finished = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the requests, keep serving
            self._fail_all("engine step", e)
            return
        self._answer(finished)
        self._drop_cancelled()

    def _answer(self, finished: list[RequestState]) -> None:
        for state in finished:
            fut = self._waiters.pop(state, None)
            if fut is not None:
                _resolve(fut, state.response())

    def _fail_all(self, what: str, e: Exception) -> None:
        """A step (or landing one) failed: the engine's state is unknown, so every request fails
        with the error and the engine starts clean; the service keeps serving."""
        log.exception("%s failed; aborting all requests", what)
        for state in self.engine.abort_all():
            fut = self._waiters.pop(state, None)
            if fut is not None:
                _resolve(fut, error=RuntimeError(f"engine step failed: {e}"))

    def _drop_cancelled(self) -> None:
        """Free the slots of requests whose caller went away (e.g. HTTP client disconnected)."""
        for state, fut in list(self._waiters.items()):
            if fut.cancelled():
                self.engine.abort(state)
                del self._waiters[state]

    def _shutdown(self) -> None:
        with self._busy:  # a concurrent pause() must not flush while we abort
            # The step in flight may have finished requests (overlap scheduling): they end as
            # they did, with their last token, not as aborted.
            self._land_in_flight()
            self._answer(self.engine.abort_all())
        with self._cv:
            inbox, self._inbox = self._inbox, []
            weights, self._weights = self._weights + self._staging, []
            self._staging = []
        for _req, rfut in inbox:
            _resolve(rfut, error=RuntimeError("engine stopped"))
        for u in weights:
            _resolve(u.fut, error=RuntimeError("engine stopped"))
            u.done.set()
