"""Counters of one proposer, for EngineMetrics.snapshot(), `twinfer bench` and the server's /metrics."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecStats:
    """What speculation did. `decodes` counts every decode of a request while speculation was on,
    whether or not it verified a draft; the speedup estimate prices each verification with the cost
    model's measured C(k) (a step with k drafted tokens over a plain step)."""

    proposer: str
    decodes: int = 0  # request decode steps (each emits 1 token, or 1 + accepted with a draft)
    verifications: int = 0  # decode steps that verified a draft
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens the target kept
    propose_seconds: float = 0.0
    errors: int = 0  # proposer failures (the step went on without drafts)
    draft_lengths: Counter[int] = field(default_factory=Counter)  # verifications by drafted tokens

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def record(self, proposed: int, accepted: int) -> None:
        self.verifications += 1
        self.proposed += proposed
        self.accepted += accepted
        self.draft_lengths[proposed] += 1

    def speedup_estimate(self, costs: list[float]) -> float:
        """Tokens per unit of decode time, relative to one token per plain decode step."""
        if not self.decodes:
            return 1.0
        plain = self.decodes - self.verifications
        spent = plain + sum(n * costs[min(k, len(costs) - 1)] for k, n in self.draft_lengths.items())
        return (self.decodes + self.accepted) / spent

    def snapshot(self, costs: list[float]) -> dict[str, Any]:
        return {
            "proposer": self.proposer,
            "decodes": self.decodes,
            "verifications": self.verifications,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted": self.accepted / self.verifications if self.verifications else 0.0,
            "draft_lengths": dict(sorted(self.draft_lengths.items())),
            "step_cost_by_k": [round(c, 3) for c in costs],
            "speedup_estimate": self.speedup_estimate(costs),
            "propose_seconds": self.propose_seconds,
            "errors": self.errors,
        }
