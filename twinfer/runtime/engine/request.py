"""A request's life inside the engine: tokens, KV progress, sampling state, output and timings."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from twinfer.runtime.constraints.mask import Guide
from twinfer.runtime.engine.bill import Bill
from twinfer.runtime.engine.params import SamplingParams
from twinfer.runtime.engine.sampler import RowState
from twinfer.runtime.vision import ImageSpan


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] | None = None
    rank: int | None = None  # 1 + how many tokens were more likely (prompt logprobs)


@dataclass
class RequestOutput:
    """What a request produced since the last step (a stream delta), or all of it when finished."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "loop", "abort"
    logprobs: list[TokenLogprob] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    image_tokens: int = 0  # prompt positions an image's features fill
    metrics: dict[str, float] = field(default_factory=dict)
    cost: dict[str, Any] | None = None  # the request's bill (engine/bill.py), on its final output
    kv_transfer_params: dict[str, Any] | None = None  # what a KV connector hands the client (final output)
    # prompt tokens 1.. with their logprobs (SamplingParams.prompt_logprobs), on the first delta only
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class Timings:
    arrival: float = field(default_factory=time.perf_counter)
    scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None

    def as_dict(self, output_tokens: int) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.scheduled is not None:
            out["queue_s"] = self.scheduled - self.arrival
        if self.first_token is not None:
            out["ttft_s"] = self.first_token - self.arrival
            if self.finished is not None and output_tokens > 1:
                out["tpot_s"] = (self.finished - self.first_token) / (output_tokens - 1)
        if self.finished is not None:
            out["latency_s"] = self.finished - self.arrival
        return out


class Request:
    """One generation. `seq_id` names its KV to the block manager and the runner."""

    def __init__(self, request_id: str, seq_id: int, prompt: list[int], params: SamplingParams,
                 priority: int = 0, new_decoder: Callable[[], Any] | None = None, guide: Guide | None = None,
                 images: Sequence[ImageSpan] = (), prompt_keys: list[int] | None = None):
        self.request_id = request_id
        self.seq_id = seq_id
        self.prompt = list(prompt)
        self.images = list(images)  # where each image's features go, in position order
        self._prompt_keys = prompt_keys  # the prompt as prefix-cache keys read it (engine/images.py)
        self.params = params
        self.priority = priority
        self.output: list[int] = []
        self.num_computed = 0  # tokens whose KV is stored
        self.cached_tokens = 0  # prompt tokens served from the prefix cache
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.row = RowState(params, np.random.default_rng(params.seed), self.prompt, Counter(), guide=guide)
        self.new_decoder = new_decoder
        self.decoder = new_decoder() if new_decoder else None  # a StreamDecoder, or None: token ids only
        self.text = ""  # decoded output so far (stop strings already cut)
        self.emitted = 0  # characters of `text` already streamed
        self.emitted_tokens = 0
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob] = []  # of prompt tokens 1.., as their rows are computed
        self.prompt_logprobs_sent = False
        self.retries = 0
        self.preemptions = 0
        self.timings = Timings()
        self.bill = Bill()
        self.kv_transfer_params: dict[str, Any] | None = None  # set at finish by a KV connector

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def key_tokens(self) -> list[int]:
        """The ids prefix-cache keys hash: `tokens`, with each image's positions keyed by its digest."""
        return self.tokens if self._prompt_keys is None else self._prompt_keys + self.output

    @property
    def image_tokens(self) -> int:
        return sum(span.length for span in self.images)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether prompt rows are still to be scored (SamplingParams.prompt_logprobs)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt) - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def sort_key(self) -> tuple[int, float]:
        return (self.priority, self.timings.arrival)

    def make_output(self, text: str, token_ids: list[int], *, final: bool, logprobs: list[TokenLogprob] | None,
                    prompt_logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        """The one way an output of this request is built: `text` and `token_ids` (a delta, or everything),
        with the request's id, finish reason and token counts filled in."""
        return RequestOutput(request_id=self.request_id, text=text, token_ids=token_ids, finished=final,
                             finish_reason=self.finish_reason, logprobs=logprobs, prompt_tokens=len(self.prompt),
                             completion_tokens=len(self.output), cached_tokens=self.cached_tokens,
                             image_tokens=self.image_tokens, prompt_logprobs=prompt_logprobs)

    def reset_output(self, seed: int | None, temperature: float | None) -> None:
        """Start the generation over (the guard's retry): same prompt, fresh seed."""
        self.output.clear()
        self.logprobs.clear()
        guide = self.row.guide
        if guide is not None:
            guide.reset()
        self.row = RowState(self.params, np.random.default_rng(seed), self.prompt, Counter(), temperature, guide)
        self.text, self.emitted, self.emitted_tokens = "", 0, 0
        self.decoder = self.new_decoder() if self.new_decoder else None
        self.num_computed = min(self.num_computed, len(self.prompt))
