"""The bill of one request: where its wall time went, which tokens it cost, and the bytes it moved.
Times partition arrival -> finish (queue, KV transfer, prefill, decode, verification) and add up to
the wall time; bytes come from the runner's `StepTraffic`, shared out over a step's tokens. Field names
follow vLLM's per-request metrics (docs/internals.md, "The bill")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from twinfer.runtime.kv.traffic import StepBytes


@dataclass
class Bill:
    """Accumulated by the engine while a request runs; `as_dict` is the `cost` object of a response."""

    kv_transfer_s: float = 0.0
    spec_verify_s: float = 0.0
    cached_device: int = 0  # prompt tokens from this replica's prefix cache
    cached_remote: int = 0  # prompt tokens whose KV came through a KV connector
    computed: int = 0  # prompt positions computed here (recomputation after preemption included)
    spec_proposed: int = 0
    spec_accepted: int = 0
    weights_read: float = 0.0
    experts_read: float = 0.0
    kv_read: float = 0.0
    kv_written: float = 0.0
    kv_transferred: float = 0.0  # K/V bytes a KV connector loaded: the prompt's KV, nothing else
    kv_transfer_overhead: float = 0.0  # the rest of what it received: positions, headers, framing
    image_tokens: int = 0  # prompt positions image features fill
    encoder_s: float = 0.0  # vision tower time spent on its images (inside prefill; 0 when cached)
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. the connector's route facts

    def charge(self, share: float, weights: float, experts: float, kv_read: float, kv_written: float) -> None:
        self.weights_read += weights * share
        self.experts_read += experts * share
        self.kv_read += kv_read
        self.kv_written += kv_written

    def as_dict(self, arrival: float, scheduled: float | None, first_token: float | None, finished: float,
                prompt: int, output: int) -> dict[str, Any]:
        """The bill; the five times add up to finished - arrival."""
        scheduled = finished if scheduled is None else scheduled
        images = {"images": {"tokens": self.image_tokens, "encoder_ms": self.encoder_s * 1000.0}}
        first = finished if first_token is None else max(first_token, scheduled)
        transfer = min(self.kv_transfer_s, scheduled - arrival)
        verify = min(self.spec_verify_s, finished - first)
        ms = 1000.0
        return {
            "time_ms": {"queue": (scheduled - arrival - transfer) * ms, "kv_transfer": transfer * ms,
                        "prefill": (first - scheduled) * ms, "decode": (finished - first - verify) * ms,
                        "spec_verify": verify * ms, "total": (finished - arrival) * ms},
            "tokens": {"prompt": prompt, "cached": {"device": self.cached_device, "remote": self.cached_remote},
                       "computed": self.computed, "output": output, "spec_proposed": self.spec_proposed,
                       "spec_accepted": self.spec_accepted},
            "bytes": {"weights_read": round(self.weights_read), "experts_read": round(self.experts_read),
                      "kv_read": round(self.kv_read), "kv_written": round(self.kv_written),
                      "kv_transferred": round(self.kv_transferred),
                      "kv_transfer_overhead": round(self.kv_transfer_overhead)},
            **(images if self.image_tokens else {}),
        }


def charge_step(bills: Sequence[Bill], chunk_tokens: Sequence[int], step: StepBytes) -> None:
    """Share a step's weight and expert bytes over its tokens; each chunk keeps its own KV bytes."""
    total = sum(chunk_tokens) or 1
    for i, (bill, n) in enumerate(zip(bills, chunk_tokens, strict=True)):
        bill.charge(n / total, step.weights_read, step.experts_read, step.kv_read[i], step.kv_written[i])


def charge_request(bill: Bill, prompt_len: int, num_computed: int, num_tokens: int, verified: bool,
                   seconds: float) -> None:
    """A request's share of a step's work other than bytes: prompt positions computed, verify time."""
    if num_computed < prompt_len:
        bill.computed += min(num_tokens, prompt_len - num_computed)
    if verified:
        bill.spec_verify_s += seconds


def with_server_time(cost: dict[str, Any], wall_ms: float) -> dict[str, Any]:
    """The bill as a server reports it: time the request spent in the server outside the engine (parsing,
    tokenizing, the hand-over to the engine thread) is queue time, so the phases add up to `wall_ms`."""
    times = dict(cost["time_ms"])
    extra = max(0.0, wall_ms - times["total"])
    times["queue"] += extra
    times["total"] += extra
    return {**cost, "time_ms": times}


def merge_costs(costs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One cost object for several choices of a request: numbers summed, the rest from the first."""
    if len(costs) == 1:
        return costs[0]

    def add(values: list[Any]) -> Any:
        if isinstance(values[0], dict):
            return {k: add([v.get(k, 0) for v in values]) for k in values[0]}
        if isinstance(values[0], (int, float)) and not isinstance(values[0], bool):
            return sum(values)
        return values[0]

    return dict(add(list(costs)))
