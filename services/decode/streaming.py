"""Server-sent events for `stream: true`: drive one request through the engine and yield its
OpenAI chunks as the engine produces tokens.

The engine thread reports progress through LLMEngine.watchers (a Progress copies the new tokens
there); the reports cross to the event loop with call_soon_threadsafe and become chunks. The
request itself is an ordinary submit, so its final response (and errors) arrive as usual and
close the stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import HTTPException

from services.common.schemas import GenerateRequest, GenerateResponse
from services.decode.openai import Delta, Progress, Stream
from services.engine import LLMEngine
from services.engine.sequence import RequestState


async def sse_events(
    engine: LLMEngine,
    submit: Callable[[GenerateRequest], Awaitable[GenerateResponse]],
    req: GenerateRequest,
    stream: Stream,
) -> AsyncIterator[str]:
    """req.request_id must be set (and unique): it keys the watcher."""
    assert req.request_id is not None
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[list[Delta]] = asyncio.Queue()
    progress = Progress()

    def watch(state: RequestState) -> None:  # engine thread
        deltas = progress(state)
        if deltas:
            loop.call_soon_threadsafe(queue.put_nowait, deltas)

    engine.watchers[req.request_id] = watch
    task = asyncio.ensure_future(submit(req))
    try:
        for event in stream.start():
            yield event
        while not task.done():
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                for event in stream.progress(getter.result()):
                    yield event
            else:
                getter.cancel()
        while not queue.empty():  # reports that landed together with the final response
            for event in stream.progress(queue.get_nowait()):
                yield event
        try:
            resp = task.result()
        except HTTPException as e:
            for event in stream.error(str(e.detail)):
                yield event
            return
        except Exception as e:  # noqa: BLE001 - the status line is sent: report in-band
            for event in stream.error(f"{type(e).__name__}: {e}"):
                yield event
            return
        for event in stream.finish(resp):
            yield event
    finally:
        engine.watchers.pop(req.request_id, None)
        if not task.done():
            task.cancel()  # client went away: AsyncEngine aborts the request and frees its pages
