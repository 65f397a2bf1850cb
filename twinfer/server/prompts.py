"""From a validated request body to what the engine runs: prompt token ids and SamplingParams. Everything
a user can get wrong (template verdict, empty prompt, bad ids, length, `max_tokens`) is checked here."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from twinfer.runtime.constraints.spec import Constraint
from twinfer.runtime.engine.params import GuardConfig, SamplingParams
from twinfer.runtime.errors import ModelError, RequestError
from twinfer.runtime.tokenizer.harmony import render_harmony
from twinfer.runtime.vision import Image
from twinfer.server.errors import APIError
from twinfer.server.images import ImageLimits, take_images
from twinfer.server.protocol import CompletionRequest
from twinfer.server.tools.plan import ToolPlan

if TYPE_CHECKING:
    from twinfer.runtime.engine.async_engine import AsyncEngine

_TEMPLATE_RESERVED = {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "documents"}
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
MAX_LOGIT_BIAS = 1024
GREEDY_BELOW = 1e-5  # temperatures under this are greedy


async def chat_prompt(tokenizer: Any, req: Any, plan: ToolPlan | None = None,
                      messages: list[dict[str, Any]] | None = None) -> list[int]:
    """The messages (default: the request's) rendered with the model's chat template, as token ids;
    `plan` adds the tools (to the template, or to the messages in the generic form)."""
    if messages is None:
        messages = openai_messages(req)
    extra = {k: v for k, v in (getattr(req, "chat_template_kwargs", None) or {}).items() if k not in _TEMPLATE_RESERVED}
    if plan is not None and plan.rewrite is not None:
        messages = plan.rewrite(messages)
    if plan is not None and plan.template_tools is not None:
        extra["tools"] = plan.template_tools
    add_generation_prompt = getattr(req, "add_generation_prompt", True)
    try:
        if plan is not None and plan.family == "harmony":  # gpt-oss: rendered as openai-harmony renders it
            effort = getattr(req, "reasoning_effort", None) or extra.get("reasoning_effort")
            text = render_harmony(messages, plan.template_tools, add_generation_prompt, effort)
            return await asyncio.to_thread(tokenizer.encode, text, False)
        return await asyncio.to_thread(tokenizer.encode_chat, messages, add_generation_prompt, **extra)
    except RequestError as e:
        raise APIError(400, str(e), param="messages") from e
    except ModelError as e:
        raise APIError(500, f"the model's chat template cannot be used: {e}", "server_error") from e


def openai_messages(req: Any) -> list[dict[str, Any]]:
    """A chat request's messages as plain dicts, the developer role as system."""
    messages = []
    for m in req.messages:
        d = m.model_dump(exclude_none=True)
        if d["role"] == "developer":  # OpenAI's newer name for the system role
            d["role"] = "system"
        messages.append(d)
    return messages


async def chat_input(engine: AsyncEngine, tokenizer: Any, req: Any, plan: ToolPlan | None,
                     messages: list[dict[str, Any]], limits: ImageLimits) -> tuple[list[int], list[Image], int]:
    """`chat_prompt` for messages that may carry images: the ids, the decoded images (server/images.py)
    and the prompt's length once the images' placeholders expand."""
    messages, images = await take_images(messages, limits, engine.reads_images)
    ids = await chat_prompt(tokenizer, req, plan, messages)
    try:
        return ids, images, engine.prompt_length(ids, images)
    except RequestError as e:
        raise APIError(400, f"the images do not match the rendered prompt: {e}", param="messages") from e


async def completion_prompt(tokenizer: Any, req: CompletionRequest, vocab_size: int) -> list[int]:
    """The prompt as token ids: text is encoded (with BOS where the model wants it), ids are checked."""
    prompt: Any = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"got {len(prompt)} prompts; send one prompt per request", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = await asyncio.to_thread(tokenizer.encode, prompt) if prompt else []
    else:
        ids = list(prompt)
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise APIError(400, f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})", param="prompt")
    if not ids:
        raise APIError(400, "the prompt is empty; send at least one token of text", param="prompt")
    return ids


def logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias ({"token id": bias}) checked: ids in the vocabulary, biases in [-100, 100]."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise APIError(400, f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens", param="logit_bias")
    out = []
    for key, value in bias.items():
        if not key.strip().isdigit() or not 0 <= int(key) < vocab_size:
            raise APIError(400, f"logit_bias key {key!r} is not a token id in [0, {vocab_size})", param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise APIError(400, f"logit_bias value {value} for token {key} is outside [-100, 100]", param="logit_bias")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


GUARD_FIELDS = ("max_period", "min_copies", "text_copies", "text_chars", "blank_chars", "filler_chars")


def repetition_guard(default: GuardConfig, asked: bool | dict[str, Any] | None) -> GuardConfig:
    """A request's `repetition_guard` over the server's default: absent keeps it, true/false turns the
    guard on/off, an object sets thresholds (and turns it on unless it says `"enabled": false`)."""
    if asked is None:
        return default
    if isinstance(asked, bool):
        return replace(default, enabled=asked)
    bad = next((k for k in asked if k not in ("enabled", *GUARD_FIELDS)), None)
    if bad is not None:
        raise APIError(400, f"repetition_guard has no field {bad!r}; use enabled, {', '.join(GUARD_FIELDS)}",
                       param="repetition_guard")
    enabled = asked.get("enabled", True)
    values = {k: asked[k] for k in GUARD_FIELDS if k in asked}
    if not isinstance(enabled, bool) or any(type(v) is not int for v in values.values()):
        raise APIError(400, "repetition_guard.enabled is a boolean and its thresholds are integers",
                       param="repetition_guard")
    try:
        return replace(default, enabled=enabled, **values)
    except RequestError as e:
        raise APIError(400, str(e).replace("guard ", "repetition_guard.", 1), param="repetition_guard") from e


def scores_prompt_only(req: Any) -> bool:
    """A completions request with echo and max_tokens 0: it returns the prompt (and its logprobs) only."""
    return isinstance(req, CompletionRequest) and req.echo and req.max_tokens == 0


def prompt_logprobs(req: Any) -> int | None:
    """How many top logprobs each prompt token gets: vLLM's prompt_logprobs, else logprobs with echo."""
    if not isinstance(req, CompletionRequest):
        return None
    if req.prompt_logprobs is not None:
        return req.prompt_logprobs
    return req.logprobs if req.echo else None


def sampling_params(req: Any, prompt_len: int, max_context: int, vocab_size: int, guard: GuardConfig,
                    constraint: Constraint | None = None, final_only: bool = False) -> SamplingParams:
    """SamplingParams for a request whose prompt has `prompt_len` tokens; APIError when it cannot run."""
    where = "prompt" if isinstance(req, CompletionRequest) else "messages"
    if prompt_len >= max_context:
        raise APIError(400, f"the prompt has {prompt_len} tokens but this model's context window is {max_context}; "
                       "shorten it", param=where, code="context_length_exceeded")
    room = max_context - prompt_len
    wanted = req.requested_max_tokens
    name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
    if wanted == 0 and scores_prompt_only(req):
        wanted = 1  # as vLLM: one token is generated, and the response leaves it out
    if wanted is not None and wanted < 1:
        raise APIError(400, f"{name} must be at least 1 (0 only with echo, to score the prompt), got {wanted}",
                       param=name)
    if wanted is not None and wanted > room:
        raise APIError(400, f"this model's context window is {max_context} tokens, but you asked for {prompt_len + wanted} "
                       f"({prompt_len} in the prompt, {wanted} to generate); lower {name} to at most {room}",
                       param=name, code="context_length_exceeded")
    stop = req.stop_list()
    if len(stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in stop):
        raise APIError(400, f"stop must be at most {MAX_STOP_STRINGS} non-empty strings of at most "
                       f"{MAX_STOP_CHARS} characters", param="stop")
    stop_ids = tuple(req.stop_token_ids or ())
    if any(not 0 <= t < vocab_size for t in stop_ids):
        raise APIError(400, f"stop_token_ids must be in [0, {vocab_size})", param="stop_token_ids")
    asked = getattr(req, "repetition_guard", None)
    if req.ignore_eos and asked is None:
        # a client that ignores EOS asks for exactly max_tokens (benchmark traffic): the guard would cut it
        guard = replace(guard, enabled=False)
    guard = repetition_guard(guard, asked)
    temperature, top_p = req.temperature, req.top_p
    if top_p == 0.0 or temperature < GREEDY_BELOW:  # a nucleus of mass 0 is the most likely token, and
        temperature, top_p = 0.0, 1.0  # logits / 1e-300 overflow to NaN: both mean greedy (as in vLLM)
    try:
        return SamplingParams(
            max_tokens=wanted if wanted is not None else room,
            temperature=temperature, top_p=top_p, top_k=max(req.top_k, 0), min_p=req.min_p,
            repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, seed=None if req.seed is None else req.seed % 2**64,
            stop=tuple(stop), stop_token_ids=stop_ids, ignore_eos=req.ignore_eos,
            logprobs=req.num_logprobs, prompt_logprobs=prompt_logprobs(req),
            guard=guard, logit_bias=logit_bias(req.logit_bias, vocab_size),
            constraint=constraint, kv_transfer_params=getattr(req, "kv_transfer_params", None),
            final_only=final_only,
        )
    except RequestError as e:
        raise APIError(400, str(e)) from e
