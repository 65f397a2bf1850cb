"""Per-request generation parameters, validated where they are made."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from twinfer.runtime.constraints.spec import Constraint
from twinfer.runtime.errors import RequestError


@dataclass(frozen=True)
class GuardConfig:
    """Token-loop guard settings (on by default): what a loop is, engine/guard.py; how each default was
    measured, docs/guard.md. `retries`: re-run a looping request up to this many times with a fresh seed."""

    enabled: bool = True
    max_period: int = 64
    min_copies: int = 4
    text_copies: int = 64
    text_chars: int = 1024
    blank_chars: int = 512
    filler_chars: int = 8192
    retries: int = 0
    retry_temperature: float = 0.7  # a greedy request would loop identically, so its retries sample

    def __post_init__(self) -> None:
        checks = [
            (1 <= self.max_period <= 1024, f"guard max_period must be in [1, 1024], got {self.max_period}"),
            (self.min_copies >= 2, f"guard min_copies must be at least 2, got {self.min_copies}"),
            (self.text_copies >= 2, f"guard text_copies must be at least 2, got {self.text_copies}"),
            (min(self.text_chars, self.blank_chars, self.filler_chars) >= 2,
             "guard text_chars, blank_chars and filler_chars must be at least 2"),
            (self.retries >= 0, f"guard retries must be >= 0, got {self.retries}"),
            (0.0 <= self.retry_temperature <= 100.0, f"guard retry_temperature must be in [0, 100], got {self.retry_temperature}"),
        ]
        for ok, message in checks:
            if not ok:
                raise RequestError(message)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. temperature 0 means greedy."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: sampled token's logprob and top k
    # None: none; k >= 0: each prompt token's logprob and the top k after the tokens before it. Such a
    # request computes its whole prompt (it reads no prefix cache) in chunks at fixed positions.
    prompt_logprobs: int | None = None
    guard: GuardConfig = field(default_factory=GuardConfig)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]); -100 bans it
    constraint: Constraint | None = None  # a grammar the output must match (runtime/constraints)
    # KV hand-over between replicas (runtime/kv/connector.py); vLLM carries it in its sampling params too
    kv_transfer_params: dict[str, Any] | None = field(default=None, compare=False, hash=False)
    final_only: bool = False  # one output, when finished (a non-streamed answer; vLLM's FINAL_ONLY)

    def __post_init__(self) -> None:
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (0.0 <= self.temperature <= 100.0, f"temperature must be in [0, 100], got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (all(t >= 0 and -100.0 <= b <= 100.0 for t, b in self.logit_bias),
             "logit_bias maps token ids (>= 0) to values in [-100, 100]"),
        ]
        for ok, message in checks:
            if not ok:
                raise RequestError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
