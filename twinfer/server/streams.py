"""Submitting a request's n choices to the engine, and reading them back as one stream. For n > 1 the
first choice goes alone until its first output, so the others prefill only past its cached prefix."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from fastapi import Request

from twinfer.runtime.constraints.spec import GrammarError
from twinfer.runtime.engine.async_engine import AsyncEngine, EngineDead, Overloaded, ShuttingDown
from twinfer.runtime.engine.params import SamplingParams
from twinfer.runtime.engine.request import RequestOutput
from twinfer.runtime.errors import RequestError
from twinfer.runtime.vision import Image
from twinfer.server.errors import APIError


class Choice:
    """One engine request's outputs, with an output already read from it put back in front."""

    def __init__(self, stream: Any, head: RequestOutput | None = None):
        self.stream = stream
        self.head = head

    def __aiter__(self) -> Choice:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.head is not None:
            head, self.head = self.head, None
            return head
        out: RequestOutput = await self.stream.__anext__()
        return out

    def cancel(self) -> None:
        """Stop generating; the choice's last output still arrives."""
        self.stream.cancel()

    async def aclose(self) -> None:
        await self.stream.aclose()


async def submit(engine: AsyncEngine, ids: list[int], params: SamplingParams, n: int, request_id: str,
                 priority: int, images: Sequence[Image] = ()) -> list[Choice]:
    """The n choices of a request, submitted (APIError for refusals: 429, 503, 400)."""
    first = await _submit(engine.generate(ids, params, request_id=request_id if n == 1 else f"{request_id}-0",
                                          priority=priority, images=images))
    if n == 1:
        return [Choice(first)]
    try:
        head = await first.__anext__()
    except EngineDead as e:
        raise APIError(503, f"the engine failed while generating: {e}", "server_error", code="engine_failed") from e
    choices = [Choice(first, head)]
    try:
        for i in range(1, n):
            seeded = params if params.seed is None else replace(params, seed=(params.seed + i) % 2**64)
            stream = await _submit(engine.generate(ids, seeded, request_id=f"{request_id}-{i}", priority=priority,
                                                   images=images))
            choices.append(Choice(stream))
    except BaseException:
        for c in choices:
            await c.aclose()
        raise
    return choices


async def _submit(coro: Any) -> Any:
    """Await `AsyncEngine.generate`, turning its refusals into HTTP answers."""
    try:
        return await coro
    except Overloaded as e:
        raise APIError(429, str(e), "rate_limit_error", code="overloaded",
                       headers={"Retry-After": str(max(1, math.ceil(e.retry_after_s)))}) from e
    except (ShuttingDown, EngineDead) as e:
        raise APIError(503, str(e), "server_error", code="unavailable") from e
    except GrammarError as e:
        raise APIError(400, str(e), code="invalid_grammar") from e
    except RequestError as e:
        raise APIError(400, str(e)) from e


async def merged(choices: Sequence[Choice]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from every choice as they arrive; errors are raised here."""
    if len(choices) == 1:
        async for out in choices[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, choice: Choice) -> None:
        try:
            async for out in choice:
                await queue.put((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the reader
            await queue.put((i, e))
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(choices)]
    try:
        done = 0
        while done < len(choices):
            i, item = await queue.get()
            if item is None:
                done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def close_all(choices: Sequence[Choice]) -> None:
    for c in choices:
        with contextlib.suppress(Exception):
            await c.aclose()


@asynccontextmanager
async def abort_on_disconnect(request: Request, choices: Sequence[Choice]) -> AsyncIterator[None]:
    """Abort the request's choices (freeing their KV blocks) as soon as the client disconnects."""

    async def watch(receive: Callable[[], Any]) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                await close_all(choices)
                return

    task = asyncio.create_task(watch(request.receive))
    try:
        yield
    finally:
        task.cancel()
