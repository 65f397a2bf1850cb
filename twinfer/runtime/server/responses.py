"""OpenAI response objects (chat.completion, text_completion and their stream chunks) from engine outputs.

`Follower` accumulates one request's deltas (text, tokens, logprobs, timings) and records its metrics
when it finishes; the builders below turn that into the JSON OpenAI clients parse.
"""

from __future__ import annotations

import json
import time
from typing import Any

from twinfer.runtime.engine.request import RequestOutput, TokenLogprob
from twinfer.runtime.server.metrics import ServerMetrics

FINGERPRINT = "twinfer"


class Follower:
    """One request's progress as seen by the server."""

    def __init__(self, request_id: str, model: str, chat: bool, tokenizer: Any, metrics: ServerMetrics,
                 arrival: float):
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.arrival = arrival
        self.created = int(time.time())
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.first_token: float | None = None
        self.text_offset = 0  # completions logprobs: characters before the next token

    def feed(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        if out.token_ids and self.first_token is None:
            self.first_token = now
        self.text.append(out.text)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        self.prompt_tokens = out.prompt_tokens
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = out.cached_tokens
        if out.finished:
            self.finish_reason = out.finish_reason or "stop"
            ttft = None if self.first_token is None else self.first_token - self.arrival
            tpot = None
            if self.first_token is not None and self.completion_tokens > 1:
                tpot = (now - self.first_token) / (self.completion_tokens - 1)
            self.metrics.record_finish(self.finish_reason, self.prompt_tokens, self.completion_tokens, ttft, tpot,
                                       now - self.arrival)

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    # -- logprobs ------------------------------------------------------------------------------------
    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def chat_logprobs(self, items: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if items is None:
            return None

        def entry(token: int, lp: float) -> dict[str, Any]:
            s = self._piece(token)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

        return {"content": [
            {**entry(i.token, i.logprob), "top_logprobs": [entry(t, lp) for t, lp in (i.top or [])]} for i in items
        ], "refusal": None}

    def completion_logprobs(self, items: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if items is None:
            return None
        tokens, offsets = [], []
        for i in items:
            s = self._piece(i.token)
            tokens.append(s)
            offsets.append(self.text_offset)
            self.text_offset += len(s)
        return {
            "tokens": tokens,
            "token_logprobs": [i.logprob for i in items],
            "top_logprobs": [{self._piece(t): lp for t, lp in (i.top or [])} for i in items],
            "text_offset": offsets,
        }

    # -- whole responses -----------------------------------------------------------------------------
    def response(self, want_logprobs: bool) -> dict[str, Any]:
        text = "".join(self.text)
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": self.chat_logprobs(self.logprobs) if want_logprobs else None,
                "finish_reason": self.finish_reason,
            }
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": self.finish_reason,
                      "logprobs": self.completion_logprobs(self.logprobs) if want_logprobs else None}
            kind = "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": FINGERPRINT, "choices": [choice], "usage": self.usage()}

    # -- stream chunks -------------------------------------------------------------------------------
    def chunk(self, *, text: str | None = None, role: bool = False, logprobs: list[TokenLogprob] | None = None,
              want_logprobs: bool = False, finish_reason: str | None = None, include_usage: bool = False) -> str:
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta,
                                      "logprobs": self.chat_logprobs(logprobs) if want_logprobs and logprobs else None,
                                      "finish_reason": finish_reason}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish_reason,
                      "logprobs": self.completion_logprobs(logprobs) if want_logprobs and logprobs else None}
            kind = "text_completion"
        body: dict[str, Any] = {"id": self.request_id, "object": kind, "created": self.created, "model": self.model,
                                "system_fingerprint": FINGERPRINT, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return sse(body)

    def usage_chunk(self) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({"id": self.request_id, "object": kind, "created": self.created, "model": self.model,
                    "system_fingerprint": FINGERPRINT, "choices": [], "usage": self.usage()})


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"
