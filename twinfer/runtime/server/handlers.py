"""The generation routes' flow: check, prepare, submit, then answer as one JSON object or as SSE.

Submission happens before any byte of the response is sent, so overload (429), draining (503) and
engine rejections are ordinary error responses even for `stream: true`. A client that goes away
aborts its request: the engine frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from twinfer.runtime.engine.async_engine import EngineDead, Overloaded, RequestStream, ShuttingDown
from twinfer.runtime.errors import RequestError
from twinfer.runtime.server import prompts
from twinfer.runtime.server.errors import APIError, error_body
from twinfer.runtime.server.protocol import ChatCompletionRequest, CompletionRequest, unsupported
from twinfer.runtime.server.responses import DONE, Follower, sse

if TYPE_CHECKING:
    from twinfer.runtime.server.app import ServerState

SHUTDOWN_MESSAGE = "the server shut down before this request finished; retry it"


async def generation(state: ServerState, request: Request, body: ChatCompletionRequest | CompletionRequest) -> Response:
    arrival = time.perf_counter()
    engine, tokenizer = state.ready()
    state.check_model(body.model)
    problem = unsupported(body)
    if problem is not None:
        raise APIError(400, problem[0], param=problem[1], code="unsupported_parameter")
    chat = isinstance(body, ChatCompletionRequest)
    vocab = engine.vocab_size
    if isinstance(body, ChatCompletionRequest):
        ids = await prompts.chat_prompt(tokenizer, body)
    else:
        ids = await prompts.completion_prompt(tokenizer, body, vocab)
    params = prompts.sampling_params(body, len(ids), engine.max_context, vocab, state.guard)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    stream = await _submit(engine.generate(ids, params, request_id=request_id, priority=body.priority))
    follower = Follower(request_id, state.model_name, chat, tokenizer, state.metrics, arrival)
    want_logprobs = params.logprobs is not None
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _events(state, request, stream, follower, want_logprobs, usage)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    async with _abort_on_disconnect(request, stream):
        try:
            async for out in stream:
                follower.feed(out)
        except EngineDead as e:
            raise APIError(503, f"the engine failed while generating: {e}", "server_error", code="engine_failed") from e
    if follower.finish_reason == "abort":
        raise APIError(503, SHUTDOWN_MESSAGE, "server_error", code="shutting_down")
    return JSONResponse(follower.response(want_logprobs))


async def _submit(coro: Any) -> RequestStream:
    """Await `AsyncEngine.generate`, turning its refusals into HTTP answers."""
    try:
        return await coro
    except Overloaded as e:
        raise APIError(429, str(e), "rate_limit_error", code="overloaded",
                       headers={"Retry-After": str(max(1, math.ceil(e.retry_after_s)))}) from e
    except (ShuttingDown, EngineDead) as e:
        raise APIError(503, str(e), "server_error", code="unavailable") from e
    except RequestError as e:
        raise APIError(400, str(e)) from e


async def _events(state: ServerState, request: Request, stream: RequestStream, f: Follower,
                  want_logprobs: bool, usage: bool) -> AsyncIterator[str]:
    """The SSE body: a role chunk (chat), one chunk per delta, the finish chunk, usage, [DONE]."""
    async with _abort_on_disconnect(request, stream):
        try:
            if f.chat:
                yield f.chunk(role=True, text="", include_usage=usage)
            async for out in stream:
                f.feed(out)
                if out.text or out.logprobs:
                    yield f.chunk(text=out.text, logprobs=out.logprobs, want_logprobs=want_logprobs, include_usage=usage)
                if out.finished:
                    if f.finish_reason == "abort":
                        yield sse(error_body(SHUTDOWN_MESSAGE, "server_error", None, "shutting_down"))
                    yield f.chunk(text=None if f.chat else "", finish_reason=f.finish_reason, include_usage=usage)
            if usage:
                yield f.usage_chunk()
        except EngineDead as e:
            yield sse(error_body(f"the engine failed while generating: {e}", "server_error", None, "engine_failed"))
        finally:
            await stream.aclose()
        yield DONE


@asynccontextmanager
async def _abort_on_disconnect(request: Request, stream: RequestStream) -> AsyncIterator[None]:
    """Abort the request (freeing its KV blocks) as soon as the client disconnects."""

    async def watch(receive: Callable[[], Any]) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                await stream.aclose()
                return

    task = asyncio.create_task(watch(request.receive))
    try:
        yield
    finally:
        task.cancel()
