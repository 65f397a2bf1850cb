"""Engine-wide counters and latency samples (the server exports them to Prometheus)."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from twinfer.runtime.engine.request import Request

if TYPE_CHECKING:
    from twinfer.runtime.speculative.speculator import Speculator


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class EngineMetrics:
    arrived: int = 0
    finished: Counter[str] = field(default_factory=Counter)  # by finish reason
    generated_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    steps: int = 0
    step_tokens: int = 0
    step_seconds: float = 0.0
    guard_trips: int = 0
    guard_retries: int = 0
    preemptions: int = 0
    ttft: deque[float] = field(default_factory=lambda: deque(maxlen=10000))
    tpot: deque[float] = field(default_factory=lambda: deque(maxlen=10000))
    queue: deque[float] = field(default_factory=lambda: deque(maxlen=10000))
    speculator: Speculator | None = None  # its counters join the snapshot

    def on_arrival(self) -> None:
        self.arrived += 1

    def on_step(self, tokens: int, seconds: float) -> None:
        self.steps += 1
        self.step_tokens += tokens
        self.step_seconds += seconds

    def on_finish(self, request: Request) -> None:
        self.finished[request.finish_reason or "unknown"] += 1
        self.prompt_tokens += len(request.prompt)
        self.cached_prompt_tokens += request.cached_tokens
        self.preemptions += request.preemptions
        timings = request.timings.as_dict(len(request.output))
        for key, sink in (("ttft_s", self.ttft), ("tpot_s", self.tpot), ("queue_s", self.queue)):
            if key in timings:
                sink.append(timings[key])

    def snapshot(self) -> dict[str, Any]:
        return {
            "requests_arrived": self.arrived,
            "requests_finished": dict(self.finished),
            "generated_tokens": self.generated_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "steps": self.steps,
            "guard_trips": self.guard_trips,
            "guard_retries": self.guard_retries,
            "preemptions": self.preemptions,
            "ttft_p50_s": percentile(list(self.ttft), 50),
            "tpot_p50_s": percentile(list(self.tpot), 50),
            "speculative": self.speculator.snapshot() if self.speculator is not None else None,
        }
