"""`Knobs`: the sampling fields of a non-OpenAI request (Anthropic Messages, Responses) in the shape
`prompts.sampling_params` reads, so every API shares one set of checks and limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Knobs:
    requested_max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    num_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    repetition_guard: bool | dict[str, Any] | None = None

    def stop_list(self) -> list[str]:
        return list(self.stop)
