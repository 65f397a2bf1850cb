"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) over the same engine path: a
Messages request becomes an OpenAI-style chat with the same checks, and the answer a `message` object
or Anthropic's event stream."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from twinfer.runtime.constraints.spec import Constraint
from twinfer.runtime.engine.async_engine import EngineDead
from twinfer.server import prompts
from twinfer.server.errors import APIError
from twinfer.server.handlers import SSE_HEADERS, collect, tool_plan
from twinfer.server.images import image_part
from twinfer.server.knobs import Knobs
from twinfer.server.responses import Follower, sse
from twinfer.server.streams import Choice, abort_on_disconnect, close_all, merged, submit
from twinfer.server.structured import make_constraint
from twinfer.server.tools.events import Delta, ToolCall

if TYPE_CHECKING:
    from twinfer.server.app import ServerState

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "loop": "end_turn"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(_Body):
    model: str | None = Field(None, max_length=512)
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=4096)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # {"format": {"type": "json_schema", "schema": {...}}}
    repetition_guard: bool | dict[str, Any] | None = None  # twinfer's: the loop guard


class CountTokensRequest(_Body):
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=4096)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


def _text(blocks: Any, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    parts = []
    for j, b in enumerate(blocks or []):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise APIError(400, f"{where}[{j}] must be a text block", param=where)
        parts.append(b["text"])
    return "\n".join(parts)


def chat_messages(body: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if body.system:
        out.append({"role": "system", "content": _text(body.system, "system")})
    for i, m in enumerate(body.messages):
        out += _turn(m, f"messages[{i}].content")
    return out


def _turn(m: AnthropicMessage, where: str) -> list[dict[str, Any]]:
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    texts, calls, results, parts = [], [], [], []  # parts: text and image parts in order
    for j, b in enumerate(m.content):
        kind = b.get("type")
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
            parts.append({"type": "text", "text": b["text"]})
        elif kind == "image" and m.role == "user":
            parts.append(image_part(_image_url(b.get("source"), f"{where}[{j}]"), f"{where}[{j}]"))
        elif kind == "tool_use" and m.role == "assistant":
            calls.append({"id": b.get("id"), "type": "function",
                          "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input", {}))}})
        elif kind == "tool_result" and m.role == "user":
            content = b.get("content", "")
            results.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                            "content": _text(content, f"{where}[{j}].content")})
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise APIError(400, f"{where}[{j}] has type {kind!r}; this server takes text, image (user), tool_use "
                           "(assistant) and tool_result (user) blocks", param=where)
    turns: list[dict[str, Any]] = list(results)
    if calls:
        turns.append({"role": "assistant", "content": "\n".join(texts) or None, "tool_calls": calls})
    elif len(parts) > len(texts):  # images: the parts in order, for the template
        turns.append({"role": m.role, "content": parts})
    elif texts or not results:
        turns.append({"role": m.role, "content": "\n".join(texts)})
    return turns


def _image_url(source: Any, where: str) -> str:
    """An image block's source as a URL: base64 data becomes a data: URL."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str):
        return f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return str(source["url"])
    raise APIError(400, f"{where}: an image block needs source {{'type': 'base64', 'media_type', 'data'}} (or "
                   f"'url' where the server fetches them), got {kind!r}", param=where, code="invalid_image")


def openai_tools(body: MessagesRequest | CountTokensRequest) -> tuple[list[dict[str, Any]] | None, Any]:
    """Anthropic tools and tool_choice in OpenAI's form."""
    tools = None
    if body.tools:
        tools = []
        for i, t in enumerate(body.tools):
            if not isinstance(t.get("name"), str):
                raise APIError(400, f"tools[{i}] needs a name and an input_schema", param=f"tools[{i}]")
            fn = {"name": t["name"], "parameters": t.get("input_schema", {"type": "object"})}
            if isinstance(t.get("description"), str):
                fn["description"] = t["description"]
            tools.append({"type": "function", "function": fn})
    choice: Any = None
    tc = body.tool_choice or {}
    kind = tc.get("type")
    if kind == "any":
        choice = "required"
    elif kind == "tool":
        choice = {"type": "function", "function": {"name": tc.get("name")}}
    elif kind in ("none", "auto"):
        choice = kind
    elif kind is not None:
        raise APIError(400, f"tool_choice type {kind!r} is unknown; use auto, any, tool or none", param="tool_choice")
    parallel = None if not tc.get("disable_parallel_tool_use") else False
    return tools, (choice, parallel)


def _output_format(config: dict[str, Any] | None) -> Constraint | None:
    """Anthropic's structured outputs: output_config.format {"type": "json_schema", "schema": ...}."""
    fmt = (config or {}).get("format")
    if not fmt:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise APIError(400, "output_config.format must be {'type': 'json_schema', 'schema': {...}}",
                       param="output_config.format")
    return make_constraint("json_schema", fmt.get("schema"), "output_config.format.schema")


async def count_tokens(state: ServerState, body: CountTokensRequest) -> dict[str, Any]:
    engine, tokenizer = state.ready()
    state.check_model(body.model)
    tools, (choice, parallel) = openai_tools(body)
    plan = tool_plan(tools, choice, parallel, tokenizer, None)
    _, _, length = await prompts.chat_input(engine, tokenizer, body, plan, chat_messages(body), state.images)
    return {"input_tokens": length}


async def messages(state: ServerState, request: Request, body: MessagesRequest) -> Response:
    arrival = time.perf_counter()
    engine, tokenizer = state.ready()
    state.check_model(body.model)
    tools, (choice, parallel) = openai_tools(body)
    constraint = _output_format(body.output_config)
    plan = tool_plan(tools, choice, parallel, tokenizer, constraint)
    ids, images, prompt_len = await prompts.chat_input(engine, tokenizer, body, plan, chat_messages(body),
                                                       state.images)
    knobs = Knobs(body.max_tokens, body.temperature, body.top_p, body.top_k, list(body.stop_sequences or []),
                  repetition_guard=body.repetition_guard)
    params = prompts.sampling_params(knobs, prompt_len, engine.max_context, engine.vocab_size, state.guard,
                                     plan.constraint or constraint, final_only=not body.stream and not plan.cuts)
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    choices = await submit(engine, ids, params, 1, message_id, 0, images)
    f = Follower(message_id, state.model_name, True, tokenizer, state.metrics, arrival, 0, plan.parser())
    f.cancel = choices[0].cancel
    if body.stream:
        return StreamingResponse(_events(request, choices, f, knobs.stop), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    await collect(request, choices, [f])
    return JSONResponse(message_body(f, _blocks(f.out), knobs.stop))


def _blocks(out: Delta) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if out.reasoning:
        blocks.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
    if out.content or not out.calls:
        blocks.append({"type": "text", "text": out.content})
    blocks += [_tool_use(c) for c in out.calls]
    return blocks


def _tool_use(c: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": _tool_use_id(c.id), "name": c.name, "input": json.loads(c.arguments)}


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _stop(f: Follower, stops: list[str]) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence of a finished follower."""
    reason = STOP_REASONS.get(f.finish_reason or "stop", "end_turn")
    if reason == "end_turn" and stops:
        full = f.tokenizer.decode(f.token_ids)
        tail = full[len(f.out.content):] if full.startswith(f.out.content) else ""
        hit = next((s for s in stops if tail.startswith(s) or s in tail[:64]), None)
        if hit is not None:
            return "stop_sequence", hit
    return reason, None


def message_body(f: Follower, content: list[dict[str, Any]], stops: list[str]) -> dict[str, Any]:
    reason, sequence = _stop(f, stops) if f.finish_reason else (None, None)
    return {"id": f.request_id, "type": "message", "role": "assistant", "model": f.model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": f.prompt_tokens, "output_tokens": f.completion_tokens,
                      "cache_read_input_tokens": f.cached_tokens, "cache_creation_input_tokens": 0,
                      **({"cost": f.cost} if f.cost is not None else {})}}


class _BlockStream:
    """Anthropic content-block events for one message, from parser deltas."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None
        self.streamed: set[str] = set()  # ids of the calls whose blocks were streamed in parts

    def start(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index += 1
        self.open = kind
        return events + [sse({"type": "content_block_start", "index": self.index, "content_block": block},
                             "content_block_start")]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")]

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse({"type": "content_block_delta", "index": self.index, "delta": delta}, "content_block_delta")

    def feed(self, d: Delta) -> list[str]:
        events: list[str] = []
        if d.reasoning:
            if self.open != "thinking":
                events += self.start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": d.reasoning}))
        if d.content:
            if self.open != "text":
                events += self.start("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": d.content}))
        for p in d.parts:  # a call streamed as generated: its block opens on its name, then its arguments
            if p.id is not None:
                self.streamed.add(p.id)
                block: dict[str, Any] = {"type": "tool_use", "id": _tool_use_id(p.id), "name": p.name, "input": {}}
                events += self.start("tool_use", block)
            if p.arguments:
                events.append(self._delta({"type": "input_json_delta", "partial_json": p.arguments}))
        for c in d.calls:
            if c.id in self.streamed:
                continue
            events += self.start("tool_use", {**_tool_use(c), "input": {}})
            events.append(self._delta({"type": "input_json_delta", "partial_json": c.arguments}))
        return events


async def _events(request: Request, choices: list[Choice], f: Follower, stops: list[str]) -> AsyncIterator[str]:
    start = message_body(f, [], stops)
    yield sse({"type": "message_start", "message": {**start, "usage": {"input_tokens": 0, "output_tokens": 0}}},
              "message_start")
    blocks = _BlockStream()
    async with abort_on_disconnect(request, choices):
        try:
            async for _, out in merged(choices):
                for event in blocks.feed(f.feed(out)):
                    yield event
            if blocks.index < 0:  # nothing was generated: one empty text block, as Anthropic sends
                for event in blocks.start("text", {"type": "text", "text": ""}):
                    yield event
            for event in blocks.close():
                yield event
            reason, sequence = _stop(f, stops)
            yield sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                       "usage": {"input_tokens": f.prompt_tokens, "output_tokens": f.completion_tokens,
                                 **({"cost": f.cost} if f.cost is not None else {})}},
                      "message_delta")
            yield sse({"type": "message_stop"}, "message_stop")
        except EngineDead as e:
            yield sse({"type": "error", "error": {"type": "api_error", "message": f"the engine failed: {e}"}}, "error")
        finally:
            await close_all(choices)
