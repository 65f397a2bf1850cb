"""Recurrent-state slots: which slot of a backend's state pool each sequence holds, and how far it ran.
Linear-attention state only moves forward, so `StateSlots` refuses, with the reason, any chunk that
would cut it back or share it: wrong output is never silent. The backend's Ops owns the pool."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from twinfer.runtime.batch import SeqChunk
from twinfer.runtime.runner import KVSync


@dataclass(frozen=True)
class StateBinding:
    """The state slot of each chunk of a step, in chunk order, and which start from a zero state."""

    slots: list[int]
    reset: list[bool]


class StateSlots:
    """Per-sequence state slots of one runner (Ops' `bind`, the runner's `release`; one thread): a chunk at
    position 0 starts from zeros, any other must continue where its state stopped."""

    def __init__(self) -> None:
        self.slot: dict[int, int] = {}
        self.position: dict[int, int] = {}  # seq_id -> positions its state has consumed
        self.free: list[int] = []
        self.capacity = 0

    def bind(self, chunks: list[SeqChunk]) -> StateBinding:
        slots, reset = [], []
        for c in chunks:
            slot = self.slot.get(c.seq_id)
            if c.start == 0:
                slot = self._take() if slot is None else slot
            elif slot is None:
                raise ValueError(f"sequence {c.seq_id} starts at position {c.start}, but no recurrent state is held "
                                 "for it: a model with linear-attention layers cannot start from a cached prefix")
            elif self.position[c.seq_id] != c.start:
                raise ValueError(f"sequence {c.seq_id} continues at position {c.start}, but its recurrent state is "
                                 f"at {self.position[c.seq_id]}: the state cannot be rolled back (no drafts)")
            self.slot[c.seq_id] = slot
            self.position[c.seq_id] = c.end
            slots.append(slot)
            reset.append(c.start == 0)
        return StateBinding(slots, reset)

    def release(self, seq_id: int) -> None:
        slot = self.slot.pop(seq_id, None)
        self.position.pop(seq_id, None)
        if slot is not None:
            self.free.append(slot)

    @property
    def held(self) -> int:
        """Sequences holding a slot now."""
        return len(self.slot)

    def _take(self) -> int:
        if self.free:
            return self.free.pop()
        self.capacity += 1
        return self.capacity - 1


class StateSync(KVSync):
    """The KVSync of a runner with recurrent state: a sequence preempted, dropped (a guard retry) or
    finished gives its state slot back; recomputing it starts again from position 0 and a zero state."""

    def __init__(self, release: Callable[[int], None]):
        self._release = release

    def reusable(self, block_ids: list[int]) -> int:
        return 0  # the state after a cached prefix was never kept

    def begin_step(self, preempted: list[int], admitted: list[tuple[int, int]]) -> None:
        for seq_id in preempted:
            self._release(seq_id)

    def finished(self, seq_id: int, table: list[int]) -> None:
        self._release(seq_id)

    def dropped(self, seq_id: int) -> None:
        self._release(seq_id)
