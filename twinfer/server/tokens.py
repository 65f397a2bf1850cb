"""vLLM's /tokenize and /detokenize: the server's own tokenizer, chat template included."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from pydantic import Field

from twinfer.server import prompts
from twinfer.server.errors import APIError
from twinfer.server.protocol import ChatMessage, _Strict

if TYPE_CHECKING:
    from twinfer.server.app import ServerState


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=4096)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


async def tokenize(state: ServerState, body: TokenizeRequest) -> dict[str, Any]:
    engine, tokenizer = state.ready()
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send either 'prompt' (text) or 'messages' (a chat)", param="prompt")
    if body.messages is not None:
        ids = await prompts.chat_prompt(tokenizer, body)
    else:
        ids = await asyncio.to_thread(tokenizer.encode, body.prompt, body.add_special_tokens)
    return {"count": len(ids), "max_model_len": engine.max_context, "tokens": ids}


async def detokenize(state: ServerState, body: DetokenizeRequest) -> dict[str, Any]:
    engine, tokenizer = state.ready()
    state.check_model(body.model)
    bad = next((t for t in body.tokens if not 0 <= t < engine.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary [0, {engine.vocab_size})", param="tokens")
    return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens)}
