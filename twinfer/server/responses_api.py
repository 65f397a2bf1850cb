"""OpenAI's Responses API (`POST /v1/responses`), stateless: `previous_response_id` is refused and
every request carries its conversation in `input`, served as /v1/chat/completions is."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from twinfer.runtime.engine.async_engine import EngineDead
from twinfer.server import prompts
from twinfer.server.errors import APIError, error_body
from twinfer.server.handlers import SSE_HEADERS, collect, tool_plan
from twinfer.server.images import image_part
from twinfer.server.knobs import Knobs
from twinfer.server.responses import Follower, sse
from twinfer.server.streams import Choice, abort_on_disconnect, close_all, merged, submit
from twinfer.server.structured import constraint_of
from twinfer.server.tools.events import Delta, ToolCall


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = Field(None, max_length=512)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    repetition_guard: bool | dict[str, Any] | None = None  # twinfer's: the loop guard


class _Format(BaseModel):
    """`text.format` in the shape `constraint_of` reads as `response_format`."""

    model_config = ConfigDict(extra="allow")
    type: str


class _Structured:
    def __init__(self, fmt: dict[str, Any] | None):
        self.response_format = None
        if fmt:
            extra = {"json_schema": {"schema": fmt.get("schema")}} if fmt.get("type") == "json_schema" else {}
            self.response_format = _Format(type=str(fmt.get("type")), **extra)


def _content_text(content: Any, where: str) -> str | list[dict[str, Any]]:
    """The text of a message; with input_image parts, the text and image parts in order."""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content or []):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            if part.get("image_url") is None:
                raise APIError(400, f"{where}[{j}]: input_image needs image_url (a data: URL); file_id is not "
                               "served", param=f"{where}[{j}]", code="invalid_image")
            parts.append(image_part(part["image_url"], f"{where}[{j}]"))
            continue
        if kind not in ("input_text", "output_text", "text"):
            raise APIError(400, f"{where}[{j}] must be an input_text or input_image part", param=where)
        texts.append(str(part.get("text", "")))
        parts.append({"type": "text", "text": texts[-1]})
    return parts if len(parts) > len(texts) else "\n".join(texts)


def chat_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if body.instructions:
        out.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return out + [{"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role")
            out.append({"role": role, "content": _content_text(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": str(item.get("output", ""))})
        elif kind != "reasoning":
            raise APIError(400, f"input[{i}] has type {kind!r}; this server takes message, function_call and "
                           "function_call_output items", param=f"input[{i}]")
    return out


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise APIError(400, f"tools[{i}] has type {t.get('type')!r}; only function tools are served",
                           param=f"tools[{i}]")
        fn = {k: t[k] for k in ("name", "description", "parameters") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


if TYPE_CHECKING:
    from twinfer.server.app import ServerState


async def create(state: ServerState, request: Request, body: ResponsesRequest) -> Response:
    arrival = time.perf_counter()
    engine, tokenizer = state.ready()
    state.check_model(body.model)
    if body.previous_response_id:
        raise APIError(400, "this server is stateless: send the whole conversation in input instead of "
                       "previous_response_id", param="previous_response_id", code="unsupported_parameter")
    constraint = constraint_of(_Structured((body.text or {}).get("format")))
    plan = tool_plan(_chat_tools(body.tools), _tool_choice(body.tool_choice), body.parallel_tool_calls, tokenizer,
                     constraint)
    ids, images, prompt_len = await prompts.chat_input(engine, tokenizer, body, plan, chat_messages(body),
                                                       state.images)
    knobs = Knobs(body.max_output_tokens, body.temperature, body.top_p, repetition_guard=body.repetition_guard)
    params = prompts.sampling_params(knobs, prompt_len, engine.max_context, engine.vocab_size, state.guard,
                                     plan.constraint or constraint, final_only=not body.stream and not plan.cuts)
    response_id = f"resp_{uuid.uuid4().hex}"
    choices = await submit(engine, ids, params, 1, response_id, 0, images)
    f = Follower(response_id, state.model_name, True, tokenizer, state.metrics, arrival, 0, plan.parser())
    f.cancel = choices[0].cancel
    if body.stream:
        return StreamingResponse(_events(request, choices, f, body), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    await collect(request, choices, [f])
    return JSONResponse(response_body(f, body, _items(f.out, f.request_id)))


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []}


def _call_item(c: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + c.id.removeprefix("call_"), "call_id": c.id, "name": c.name,
            "arguments": c.arguments if status == "completed" else "", "status": status}


def _items(out: Delta, response_id: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if out.reasoning:
        items.append({"type": "reasoning", "id": f"rs_{response_id[5:29]}", "summary": [],
                      "content": [{"type": "reasoning_text", "text": out.reasoning}]})
    if out.content or not out.calls:
        items.append(_message_item(f"msg_{response_id[5:29]}", out.content))
    return items + [_call_item(c) for c in out.calls]


def response_body(f: Follower, body: ResponsesRequest, output: list[dict[str, Any]]) -> dict[str, Any]:
    done = f.finish_reason is not None
    incomplete = f.finish_reason == "length"
    return {
        "id": f.request_id, "object": "response", "created_at": f.created, "model": f.model,
        "status": ("incomplete" if incomplete else "completed") if done else "in_progress",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": None,
        "temperature": body.temperature, "top_p": body.top_p, "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [], "text": body.text or {"format": {"type": "text"}}, "metadata": body.metadata or {},
        "store": False, "truncation": "disabled",
        **({"usage": {"input_tokens": f.prompt_tokens, "output_tokens": f.completion_tokens,
                      "total_tokens": f.prompt_tokens + f.completion_tokens,
                      "input_tokens_details": {"cached_tokens": f.cached_tokens, "cache_write_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0},
                      **({"cost": f.cost} if f.cost is not None else {})}} if done else {}),  # none until done
    }


class _Events:
    """Numbered Responses stream events."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.n, **fields}
        self.n += 1
        return sse(body, kind)


async def _events(request: Request, choices: list[Choice], f: Follower, body: ResponsesRequest) -> AsyncIterator[str]:
    ev = _Events()
    yield ev("response.created", response=response_body(f, body, []))
    yield ev("response.in_progress", response=response_body(f, body, []))
    message_id = f"msg_{f.request_id[5:29]}"
    output: list[dict[str, Any]] = []
    text_open = False
    async with abort_on_disconnect(request, choices):
        try:
            async for _, out in merged(choices):
                delta = f.feed(out)
                if delta.content:
                    if not text_open:
                        text_open = True
                        output.append(_message_item(message_id, "", "in_progress"))
                        yield ev("response.output_item.added", output_index=len(output) - 1, item=output[-1])
                        yield ev("response.content_part.added", item_id=message_id, output_index=len(output) - 1,
                                 content_index=0, part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                    yield ev("response.output_text.delta", item_id=message_id, output_index=len(output) - 1,
                             content_index=0, delta=delta.content, logprobs=[])
                for c in delta.calls:
                    for event in _call_events(ev, output, c):
                        yield event
        except EngineDead as e:
            yield ev("error", **error_body(f"the engine failed: {e}", "server_error")["error"])
            return
        finally:
            await close_all(choices)
    final = _items(f.out, f.request_id)
    if text_open:
        index = next(i for i, item in enumerate(output) if item["id"] == message_id)
        done_item = _message_item(message_id, f.out.content)
        part = done_item["content"][0]
        yield ev("response.output_text.done", item_id=message_id, output_index=index, content_index=0,
                 text=f.out.content, logprobs=[])
        yield ev("response.content_part.done", item_id=message_id, output_index=index, content_index=0, part=part)
        yield ev("response.output_item.done", output_index=index, item=done_item)
    kind = "response.incomplete" if f.finish_reason == "length" else "response.completed"
    yield ev(kind, response=response_body(f, body, final))


def _call_events(ev: _Events, output: list[dict[str, Any]], c: ToolCall) -> list[str]:
    output.append(_call_item(c, "in_progress"))
    index, item_id = len(output) - 1, output[-1]["id"]
    return [ev("response.output_item.added", output_index=index, item=output[-1]),
            ev("response.function_call_arguments.delta", item_id=item_id, output_index=index, delta=c.arguments),
            ev("response.function_call_arguments.done", item_id=item_id, output_index=index, arguments=c.arguments,
               name=c.name),
            ev("response.output_item.done", output_index=index, item=_call_item(c))]

