"""OpenAI request bodies as pydantic models, with OpenAI's limits.
Strict types; unknown fields ignored (as vLLM); fields twinfer cannot honour are rejected saying so.
vLLM's and llama-server's extras that twinfer honours: docs/api.md."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_INT64 = 2**63


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")  # the template may read e.g. `name`
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ResponseFormat(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str


class _Sampling(_Strict):
    """Fields shared by chat and completions."""

    model: str | None = Field(None, max_length=512)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    seed: int | None = Field(None, ge=-_INT64, lt=2 * _INT64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # structured output as vLLM and llama-server spell it (server/structured.py)
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    grammar: str | None = None
    # vLLM's extras
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    priority: int = Field(0, ge=-(2**31), lt=2**31)
    kv_transfer_params: dict[str, Any] | None = None  # prefill/decode hand-over (runtime/kv/connector.py)
    repetition_guard: bool | dict[str, Any] | None = None  # twinfer's: the loop guard (prompts.repetition_guard)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    reasoning_effort: str | None = None  # gpt-oss (harmony): low, medium or high
    # vLLM's extras
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    echo: bool = False  # vLLM's, refused: prompt logprobs come from the completions API
    prompt_logprobs: int | None = None  # likewise

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False  # with logprobs: the prompt tokens' logprobs lead the output's; max_tokens 0 scores only
    suffix: str | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's: each prompt token's logprob and top k
    best_of: int | None = Field(None, ge=1, le=128)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


def unsupported(req: ChatCompletionRequest | CompletionRequest) -> tuple[str, str] | None:
    """(message, param) for a valid OpenAI field value twinfer cannot honour, else None."""
    if req.stream_options is not None and not req.stream:
        return "stream_options is only allowed when stream is true", "stream_options"
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            return "top_logprobs requires logprobs to be true", "top_logprobs"
        if req.echo or req.prompt_logprobs is not None:
            param = "echo" if req.echo else "prompt_logprobs"
            return (f"{param} is not supported on the chat API: for prompt logprobs use /v1/completions with "
                    "echo and logprobs (or prompt_logprobs)", param)
    else:
        if req.best_of not in (None, 1, req.n):
            return "best_of must equal n: twinfer returns every completion it generates", "best_of"
        if req.suffix:
            return "suffix (insertion) is not supported", "suffix"
    return None
