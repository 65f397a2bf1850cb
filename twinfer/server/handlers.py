"""The OpenAI generation routes' flow: check, prepare, submit, then answer as one JSON object or as SSE.
Submission precedes the first byte, so 429, 503 and 400 stay ordinary errors even when streaming; a
client that goes away aborts its request."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from twinfer.runtime.engine.async_engine import EngineDead
from twinfer.runtime.errors import RequestError
from twinfer.server import prompts
from twinfer.server.errors import APIError, error_body
from twinfer.server.protocol import ChatCompletionRequest, CompletionRequest, unsupported
from twinfer.server.responses import DONE, Echo, Follower, response, sse, usage_chunk
from twinfer.server.streams import Choice, abort_on_disconnect, close_all, merged, submit
from twinfer.server.structured import constraint_of
from twinfer.server.tools.plan import ToolPlan, plan_tools

if TYPE_CHECKING:
    from twinfer.server.app import ServerState

SHUTDOWN_MESSAGE = "the server shut down before this request finished; retry it"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def generation(state: ServerState, request: Request, body: ChatCompletionRequest | CompletionRequest) -> Response:
    arrival = time.perf_counter()
    engine, tokenizer = state.ready()
    state.check_model(body.model)
    problem = unsupported(body)
    if problem is not None:
        raise APIError(400, problem[0], param=problem[1], code="unsupported_parameter")
    chat = isinstance(body, ChatCompletionRequest)
    constraint = constraint_of(body)
    plan = ToolPlan.none()
    echo, echo_ids = "", None
    images: list[Any] = []
    if isinstance(body, ChatCompletionRequest):
        plan = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls, tokenizer, constraint)
        ids, images, prompt_len = await prompts.chat_input(engine, tokenizer, body, plan,
                                                           prompts.openai_messages(body), state.images)
        constraint = plan.constraint or constraint
    else:
        ids = await prompts.completion_prompt(tokenizer, body, engine.vocab_size)
        prompt_len = len(ids)
        echo = await asyncio.to_thread(tokenizer.decode, ids, True) if body.echo else ""
        echo_ids = ids if body.echo and body.logprobs is not None else None
    params = prompts.sampling_params(body, prompt_len, engine.max_context, engine.vocab_size, state.guard, constraint,
                                     final_only=not body.stream and not plan.cuts)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    choices = await submit(engine, ids, params, body.n, request_id, body.priority, images)
    echoed = Echo(echo, echo_ids, prompts.scores_prompt_only(body))
    followers = [Follower(request_id, state.model_name, chat, tokenizer, state.metrics, arrival, i,
                          plan.parser(), echoed) for i in range(body.n)]
    for f, c in zip(followers, choices, strict=True):
        f.cancel = c.cancel
    want_logprobs = params.logprobs is not None
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _events(request, choices, followers, want_logprobs, usage)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    await collect(request, choices, followers)
    return JSONResponse(response(followers, want_logprobs))


def tool_plan(tools: Any, tool_choice: Any, parallel: bool | None, tokenizer: Any, constraint: Any) -> ToolPlan:
    """`plan_tools`, its refusals as 400s naming the field."""
    try:
        return plan_tools(tools, tool_choice, parallel, tokenizer, constraint)
    except RequestError as e:
        raise APIError(400, str(e), param=e.field or "tools", code="invalid_tools") from e


async def collect(request: Request, choices: list[Choice], followers: list[Any]) -> None:
    """Run every choice to its end, feeding its follower (non-streaming answers)."""
    async with abort_on_disconnect(request, choices):
        try:
            async for i, out in merged(choices):
                followers[i].feed(out)
        except EngineDead as e:
            raise APIError(503, f"the engine failed while generating: {e}", "server_error", code="engine_failed") from e
        finally:
            await close_all(choices)
    if any(f.finish_reason == "abort" for f in followers):
        raise APIError(503, SHUTDOWN_MESSAGE, "server_error", code="shutting_down")


async def _events(request: Request, choices: list[Choice], followers: list[Follower], want_logprobs: bool,
                  usage: bool) -> AsyncIterator[str]:
    """The SSE body: role chunks (chat) or echoes, one chunk per delta, finish chunks, usage, [DONE].
    An echo with logprobs waits for the choice's first output, which carries the prompt's logprobs."""
    async with abort_on_disconnect(request, choices):
        try:
            for f in followers:
                if f.chat:
                    yield f.chunk(role=True, include_usage=usage)
                elif f.echo and f.echo_ids is None:
                    yield f.chunk(text=f.echo, include_usage=usage)
            echoed: set[int] = set()
            async for i, out in merged(choices):
                f = followers[i]
                delta = f.feed(out)
                if f.echo_ids is not None and i not in echoed:
                    echoed.add(i)
                    yield f.echo_chunk(want_logprobs, usage)
                if not f.echo_only and (delta or out.logprobs):
                    yield f.chunk(delta, logprobs=out.logprobs, want_logprobs=want_logprobs, include_usage=usage)
                if out.finished:
                    if f.finish_reason == "abort":
                        yield sse(error_body(SHUTDOWN_MESSAGE, "server_error", None, "shutting_down"))
                    yield f.chunk(finish_reason=f.finish_reason, include_usage=usage)
            if usage:
                yield usage_chunk(followers)
        except EngineDead as e:
            yield sse(error_body(f"the engine failed while generating: {e}", "server_error", None, "engine_failed"))
        finally:
            await close_all(choices)
        yield DONE
