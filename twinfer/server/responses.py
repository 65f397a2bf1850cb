"""OpenAI response objects (chat.completion, text_completion and their stream chunks) from engine outputs:
`Follower` accumulates one choice's deltas and metrics; `response` and the chunk builders render them."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from twinfer.runtime.engine.bill import merge_costs, with_server_time
from twinfer.runtime.engine.request import RequestOutput, TokenLogprob
from twinfer.runtime.tokenizer.detok import StreamDecoder
from twinfer.server.metrics import ServerMetrics
from twinfer.server.tools.events import Delta, OutputParser, PlainText, ToolCall

FINGERPRINT = "twinfer"


@dataclass(frozen=True)
class Echo:
    """A completion's echo: the prompt `text`, sent before the output; with logprobs the prompt's `ids`,
    whose logprobs lead the logprobs object; `only` with max_tokens 0 (the prompt scored, the one token
    generated dropped)."""

    text: str = ""
    ids: list[int] | None = None
    only: bool = False


class Follower:
    """One choice of a request as seen by the server."""

    def __init__(self, request_id: str, model: str, chat: bool, tokenizer: Any, metrics: ServerMetrics,
                 arrival: float, index: int = 0, parser: OutputParser | None = None, echo: Echo = Echo()):
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.arrival = arrival
        self.index = index
        self.parser: OutputParser = parser or PlainText()
        self.echo, self.echo_ids, self.echo_only = echo.text, echo.ids, echo.only  # see Echo
        self.prompt_logprobs: list[TokenLogprob] | None = None  # the engine's, of prompt tokens 1..
        self.created = int(time.time())
        self.out = Delta()
        self.logprobs: list[TokenLogprob] = []
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.image_tokens = 0  # prompt positions image features fill
        self.cost: dict[str, Any] | None = None  # the engine's bill, once finished
        self.kv_transfer_params: dict[str, Any] | None = None
        self.first_token: float | None = None
        self.text_offset = 0  # completions logprobs: characters before the next token
        self._special: StreamDecoder | None = None
        self._streamed: set[str] = set()  # ids of the calls sent in parts
        self.cancel: Callable[[], None] | None = None  # stops the engine request (set once submitted)
        self._cut = False  # the parser found the reply's calls over and the request was stopped

    def feed(self, out: RequestOutput) -> Delta:
        """Take one engine delta; returns what it adds to the choice (for a stream chunk)."""
        now = time.perf_counter()
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.token_ids and self.first_token is None:  # a final-only output: the engine's first token
            self.first_token = now - out.metrics.get("latency_s", 0.0) + out.metrics.get("ttft_s", 0.0)
        if self.echo_only:
            out = replace(out, text="", token_ids=[], logprobs=None)
        self.token_ids += out.token_ids
        delta = self.parser.feed(self._text(out))
        if out.finished:
            delta.extend(self.parser.finish())
        elif self.parser.done and not self._cut and self.cancel is not None:
            self._cut = True
            self.cancel()
        self.out.extend(delta)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        self.prompt_tokens = out.prompt_tokens
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = out.cached_tokens
        self.image_tokens = out.image_tokens
        if out.finished:
            self.kv_transfer_params = out.kv_transfer_params
            self.cost = with_server_time(out.cost, (now - self.arrival) * 1000.0) if out.cost else None
            reason = out.finish_reason or "stop"
            ended = reason == "stop" or (self._cut and reason in ("abort", "length"))
            self.finish_reason = "tool_calls" if self.out.calls and ended else reason
            self._record(now)
        return delta

    def _text(self, out: RequestOutput) -> str:
        """The delta's text; for parsers that read control tokens (harmony), decoded with them."""
        if not getattr(self.parser, "wants_special_tokens", False):
            return out.text
        if self._special is None:
            self._special = StreamDecoder(self.tokenizer, False)
        text = "".join(self._special.push(t) for t in out.token_ids)
        return text + (self._special.flush() if out.finished else "")

    def _record(self, now: float) -> None:
        ttft = None if self.first_token is None else self.first_token - self.arrival
        tpot = None
        if self.first_token is not None and self.completion_tokens > 1:
            tpot = (now - self.first_token) / (self.completion_tokens - 1)
        self.metrics.record_finish(self.finish_reason or "stop", self.prompt_tokens, self.completion_tokens, ttft,
                                   tpot, now - self.arrival, self.cached_tokens, self.out.failures)
        if self.cost is not None:
            self.metrics.record_cost(self.cost)

    def _piece(self, token: int) -> str:
        return str(self.tokenizer.decode([token]))

    def chat_logprobs(self, items: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if items is None:
            return None

        def entry(token: int, lp: float) -> dict[str, Any]:
            s = self._piece(token)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

        return {"content": [
            {**entry(i.token, i.logprob), "top_logprobs": [entry(t, lp) for t, lp in (i.top or [])]} for i in items
        ], "refusal": None}

    def completion_logprobs(self, items: list[TokenLogprob] | None, prompt: bool = False) -> dict[str, Any] | None:
        """OpenAI's legacy logprobs object of `items` after the prompt's (echo), built as vLLM builds it
        (each top_logprobs holds the token itself, then the k most likely)."""
        if items is None:
            return None
        rows: list[tuple[int, float | None, list[tuple[int, float]] | None]] = []
        if prompt and self.echo_ids:
            rows.append((self.echo_ids[0], None, None))
            rows += [(i.token, i.logprob, i.top) for i in self.prompt_logprobs or []]
        rows += [(i.token, i.logprob, i.top) for i in items]
        tokens, offsets = [], []
        for token, _, _ in rows:
            s = self._piece(token)
            tokens.append(s)
            offsets.append(self.text_offset)
            self.text_offset += len(s)
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else _json_logprob(lp) for _, lp, _ in rows],
            "top_logprobs": [None if lp is None else self._top(token, lp, top) for token, lp, top in rows],
            "text_offset": offsets,
        }

    def _top(self, token: int, logprob: float, top: list[tuple[int, float]] | None) -> dict[str, float]:
        by_id = {token: logprob, **dict(top or [])}
        return {self._piece(t): _json_logprob(lp) for t, lp in by_id.items()}

    def vllm_prompt_logprobs(self) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's `prompt_logprobs` of a choice: None for the first prompt token, then per token
        {id: {logprob, rank, decoded_token}} for the token itself and the k most likely."""
        if self.prompt_logprobs is None:
            return None
        out: list[dict[str, dict[str, Any]] | None] = [None]
        for i in self.prompt_logprobs:
            ranked = [(i.token, i.logprob, i.rank)] + [(t, lp, r) for r, (t, lp) in enumerate(i.top or [], 1)]
            row: dict[str, dict[str, Any]] = {}
            for t, lp, rank in ranked:
                row.setdefault(str(t), {"logprob": _json_logprob(lp), "rank": rank, "decoded_token": self._piece(t)})
            out.append(row)
        return out

    def choice(self, want_logprobs: bool) -> dict[str, Any]:
        if not self.chat:
            out = {"index": self.index, "text": self.echo + self.out.content, "finish_reason": self.finish_reason,
                   "logprobs": self.completion_logprobs(self.logprobs, prompt=True) if want_logprobs else None}
            if self.prompt_logprobs is not None:
                out["prompt_logprobs"] = self.vllm_prompt_logprobs()
            return out
        message: dict[str, Any] = {"role": "assistant", "content": self.out.content or None, "refusal": None}
        if self.out.calls:
            message["tool_calls"] = [tool_call(c) for c in self.out.calls]
        elif message["content"] is None:
            message["content"] = ""
        if self.out.reasoning:
            message["reasoning_content"] = message["reasoning"] = self.out.reasoning
        return {"index": self.index, "message": message, "finish_reason": self.finish_reason,
                "logprobs": self.chat_logprobs(self.logprobs) if want_logprobs else None}

    def chunk(self, delta: Delta | None = None, *, role: bool = False, logprobs: list[TokenLogprob] | None = None,
              want_logprobs: bool = False, finish_reason: str | None = None, include_usage: bool = False,
              text: str | None = None) -> str:
        """One SSE chunk of this choice (`text`: a completions chunk's raw text); a delta with tool
        calls also gets, per call, a chunk with its index, id and name, then one with its arguments."""
        lp = logprobs if want_logprobs and logprobs else None
        if self.chat:
            body = _chat_delta(delta, role)
            choice = {"index": self.index, "delta": body, "logprobs": self.chat_logprobs(lp) if lp else None,
                      "finish_reason": finish_reason}
            first = self._envelope(choice, include_usage) if body or lp or finish_reason else ""
            return first + self._call_chunks(delta, include_usage)
        choice = {"index": self.index, "text": text if text is not None else (delta.content if delta else ""),
                  "logprobs": self.completion_logprobs(lp) if lp else None}
        if finish_reason is not None:  # text_completion requires a reason string: only the last chunk has one
            choice["finish_reason"] = finish_reason
        return self._envelope(choice, include_usage)

    def echo_chunk(self, want_logprobs: bool, include_usage: bool) -> str:
        """A completions stream's echo: the prompt text, with the prompt's logprobs when asked for."""
        choice = {"index": self.index, "text": self.echo,
                  "logprobs": self.completion_logprobs([], prompt=True) if want_logprobs else None}
        return self._envelope(choice, include_usage)

    def _call_chunks(self, delta: Delta | None, include_usage: bool) -> str:
        """Streamed calls as the parser sent them (id and name, then argument fragments); a call that
        arrived whole as two chunks: its index, id and name, then its arguments."""
        if delta is None or not (delta.calls or delta.parts):
            return ""
        entries: list[dict[str, Any]] = []
        for p in delta.parts:
            if p.id is not None:
                self._streamed.add(p.id)
                entries.append({"index": p.index, "id": p.id, "type": "function",
                                "function": {"name": p.name, "arguments": ""}})
            if p.arguments:
                entries.append({"index": p.index, "function": {"arguments": p.arguments}})
        start = len(self.out.calls) - len(delta.calls)  # tool-call indices run per choice
        for i, c in enumerate(delta.calls):
            if c.id in self._streamed:
                continue
            index = c.index if c.index is not None else start + i
            entries += [{"index": index, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}},
                        {"index": index, "function": {"arguments": c.arguments}}]
        out = []
        for entry in entries:
            choice = {"index": self.index, "delta": {"tool_calls": [entry]}, "logprobs": None, "finish_reason": None}
            out.append(self._envelope(choice, include_usage))
        return "".join(out)

    def _envelope(self, choice: dict[str, Any], include_usage: bool) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        body: dict[str, Any] = {"id": self.request_id, "object": kind, "created": self.created, "model": self.model,
                                "system_fingerprint": FINGERPRINT, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return sse(body)


def _chat_delta(delta: Delta | None, role: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if role:
        out["role"] = "assistant"
        out["content"] = ""
    if delta is None:
        return out
    if delta.reasoning:
        out["reasoning_content"] = out["reasoning"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    return out


def _json_logprob(lp: float) -> float:
    """A logprob JSON can carry: -inf (a banned token) becomes -9999.0, as OpenAI and vLLM send it."""
    return max(lp, -9999.0)


def tool_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def usage(followers: list[Follower]) -> dict[str, Any]:
    """Usage of a request: the prompt once, the completion tokens of every choice."""
    first = followers[0]
    completion = sum(f.completion_tokens for f in followers)
    out: dict[str, Any] = {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
                           "total_tokens": first.prompt_tokens + completion,
                           "prompt_tokens_details": {"cached_tokens": max(f.cached_tokens for f in followers)}}
    if first.image_tokens:
        out["prompt_tokens_details"]["image_tokens"] = first.image_tokens
    costs = [f.cost for f in followers if f.cost is not None]
    if costs:
        out["cost"] = merge_costs(costs)
    return out


def response(followers: list[Follower], want_logprobs: bool) -> dict[str, Any]:
    first = followers[0]
    return {"id": first.request_id, "object": "chat.completion" if first.chat else "text_completion",
            "created": first.created, "model": first.model, "system_fingerprint": FINGERPRINT,
            "choices": [f.choice(want_logprobs) for f in followers], "usage": usage(followers),
            **({"kv_transfer_params": first.kv_transfer_params} if first.kv_transfer_params else {})}


def usage_chunk(followers: list[Follower]) -> str:
    first = followers[0]
    return sse({"id": first.request_id, "object": "chat.completion.chunk" if first.chat else "text_completion",
                "created": first.created, "model": first.model, "system_fingerprint": FINGERPRINT,
                "choices": [], "usage": usage(followers)})


def sse(body: dict[str, Any], event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(body, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"
