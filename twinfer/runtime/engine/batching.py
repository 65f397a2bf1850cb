"""Batching modes: which requests share a step. The mode is a policy the scheduler calls once per step
(`Batching.fill`) and the engine reads once, when it is built (`StepMode`); neither branches on it.

- Continuous batching: running requests first (a decode costs one token, an unfinished prefill
  continues in chunks), then room for drafts, then waiting requests while the budget allows.
- Exact (batch-invariant) batching, in the shapes a runner declares exact (runtime/runner.py,
  `ExactShapes`): each prompt chunk runs alone at fixed boundaries, decode steps hold at most
  `invariant_rows` rows taken in turn, a resumed request replays its output one token per step, and
  drafts are verified only while one request runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from twinfer.runtime.kv.block_manager import OutOfBlocks
from twinfer.runtime.runner import ExactShapes

if TYPE_CHECKING:
    from twinfer.runtime.engine.scheduler import Schedule, Scheduler


class Batching(Protocol):
    """Fills one step's schedule. Called by `Scheduler.schedule` with the running queue sorted by
    importance; it may admit, grow and preempt through the scheduler's building blocks."""

    def fill(self, s: Scheduler, out: Schedule) -> None: ...


class ContinuousBatching:
    """Running requests within the token budget, then draft room, then admissions (none after a preemption)."""

    def fill(self, s: Scheduler, out: Schedule) -> None:
        budget = s.config.max_batch_tokens
        for request in list(s.running):
            if budget == 0:
                break
            if request not in s.running:  # preempted earlier in this loop
                continue
            n = s.chunk(request, budget)
            if n and s.grow(request, n, out):  # n == 0: its next image waits for a step with room
                out.add(request, n)
                budget -= n
        budget = s.draft_room(out.items, budget)
        if not out.preempted:
            s.admit(budget, out)


class ExactBatching:
    """A prompt chunk alone, else one admission alone, else up to `rows` decodes in turn."""

    def __init__(self, rows: int):
        self.rows = rows
        self._turn = 0  # rotation of the decode rows

    def fill(self, s: Scheduler, out: Schedule) -> None:
        chunk = s.config.max_prefill_chunk
        for request in s.running:
            if request.num_computed < len(request.prompt):
                n = min(len(request.prompt) - request.num_computed, chunk)
                n = s.fit_images(request, n, s.config.max_batch_tokens)
                if s.grow(request, n, out):
                    out.add(request, n)
                return
        if self._admit_alone(s, out):
            return
        turn = self._turn % max(len(s.running), 1)
        for request in (s.running[turn:] + s.running[:turn])[: self.rows]:
            if request in s.running and s.grow(request, 1, out):
                out.add(request, 1)
        self._turn += self.rows
        if len(s.running) == 1:  # a lone stream may verify drafts
            s.draft_room(out.items, self.rows - len(out.items))

    def _admit_alone(self, s: Scheduler, out: Schedule) -> bool:
        """Admit the first waiting request, only with room for its whole prompt and one more block per
        running request: a prompt step excludes decodes, so admitting into a full pool would preempt forever."""
        candidate = s.waiting[0] if s.waiting else None
        if candidate is None or len(s.running) >= s.config.max_seqs:
            return False
        if s.blocks.blocks_for(len(candidate.prompt) + 1) + len(s.running) > s.blocks.num_free:
            return False
        n = s.fit_images(candidate, min(len(candidate.prompt), s.config.max_prefill_chunk), s.config.max_batch_tokens)
        try:
            s.blocks.allocate(candidate.seq_id, [], n, candidate.tokens)
        except OutOfBlocks:
            return False
        s.waiting.pop(0)
        candidate.num_computed = 0
        s.start(candidate)
        out.add(candidate, n, admitted=True)
        return True


@dataclass(frozen=True)
class StepMode:
    """The batching mode as the engine reads it when it is built: `shapes` None for continuous batching,
    else the runner's exact shapes (`Runner.exact_shapes`) for exact batching."""

    shapes: ExactShapes | None = None

    @property
    def exact(self) -> bool:
        """Steps run in exact shapes (`StepBatch.exact`); a cached prefix would change a row's logits."""
        return self.shapes is not None

    @property
    def reserved_seqs(self) -> int:
        """Sequences the runner keeps for itself (to pad lone rows)."""
        return self.shapes.reserved_seqs if self.shapes is not None else 0

    @property
    def decode_rows(self) -> int | None:
        return self.shapes.decode_rows if self.shapes is not None else None
