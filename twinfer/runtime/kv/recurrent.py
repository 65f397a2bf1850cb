"""Recurrent-state slots: which slot of a backend's state pool each sequence holds, and how far it ran.
Linear-attention state only moves forward. To take back rejected drafts, the backend keeps the state
after each token of a short verification chunk (`DRAFT_ROLLBACK`), and the next chunk may start at any
of those positions; `StateSlots` refuses, with the reason, any other chunk that would cut a state back
or share it: wrong output is never silent. The backend's Ops owns the pool."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from twinfer.runtime.batch import LogitsWanted, SeqChunk
from twinfer.runtime.runner import KVSync

# Drafted tokens a recurrent runner can take back: a verification chunk of up to this many tokens past
# its first keeps the state after each of them (each one state_bytes_per_seq, for the next step only).
DRAFT_ROLLBACK = 8


@dataclass(frozen=True)
class StateBinding:
    """Per chunk of a step, in chunk order: its state slot, whether it starts from a zero state,
    `restore`: which kept state of its sequence's last chunk it starts from (-1: the slot's own), and
    `keep`: how many states after its tokens the backend keeps (after its 1st, 2nd, ... token; 0: none)."""

    slots: list[int]
    reset: list[bool]
    restore: list[int]
    keep: list[int]


class StateSlots:
    """Per-sequence state slots of one runner (Ops' `bind`, the runner's `release`; one thread): a chunk at
    position 0 starts from zeros, any other continues where its state stopped or, after a verification
    chunk whose states were kept (`rollback` > 0), at one of that chunk's positions."""

    def __init__(self, rollback: int = 0) -> None:
        self.rollback = rollback
        self.slot: dict[int, int] = {}
        self.position: dict[int, int] = {}  # seq_id -> positions its state has consumed
        self.kept: dict[int, int] = {}  # seq_id -> start of its last chunk, whose per-token states are kept
        self.free: list[int] = []
        self.capacity = 0

    def bind(self, chunks: list[SeqChunk]) -> StateBinding:
        b = StateBinding([], [], [], [])
        for c in chunks:
            slot = self.slot.get(c.seq_id)
            restore = -1
            if c.start == 0:
                slot = self._take() if slot is None else slot
            elif slot is None:
                raise ValueError(f"sequence {c.seq_id} starts at position {c.start}, but no recurrent state is held "
                                 "for it: a model with linear-attention layers cannot start from a cached prefix")
            elif self.position[c.seq_id] != c.start:
                restore = self._restore_index(c)
            self.kept.pop(c.seq_id, None)
            keep = len(c.tokens) - 1 if c.logits is LogitsWanted.ALL and len(c.tokens) - 1 <= self.rollback else 0
            if keep:
                self.kept[c.seq_id] = c.start
            self.slot[c.seq_id] = slot
            self.position[c.seq_id] = c.end
            b.slots.append(slot)
            b.reset.append(c.start == 0)
            b.restore.append(restore)
            b.keep.append(keep)
        return b

    def _restore_index(self, c: SeqChunk) -> int:
        """Which kept state a chunk starting inside its sequence's last chunk starts from."""
        first, held = self.kept.get(c.seq_id), self.position[c.seq_id]
        if first is None or not first < c.start < held:
            raise ValueError(f"sequence {c.seq_id} continues at position {c.start}, but its recurrent state is at "
                             f"{held} and no state was kept there: a state is taken back only into the chunk "
                             f"before, of at most {self.rollback + 1} tokens")
        return c.start - first - 1

    def held_at(self, seq_id: int, position: int) -> int:
        """The slot of a sequence whose state has consumed exactly `position` positions (a hand-over's save)."""
        if self.position.get(seq_id) != position:
            raise ValueError(f"sequence {seq_id}'s recurrent state is at {self.position.get(seq_id)}, not at "
                             f"{position}: only the state right after the handed-over positions can travel")
        return self.slot[seq_id]

    def adopt(self, seq_id: int, position: int) -> int:
        """A slot for a sequence whose state arrives from another runner after `position` positions (a
        hand-over's load); its next chunk continues there."""
        slot = self.slot.get(seq_id)
        self.slot[seq_id] = self._take() if slot is None else slot
        self.position[seq_id] = position
        self.kept.pop(seq_id, None)
        return self.slot[seq_id]

    def release(self, seq_id: int) -> None:
        slot = self.slot.pop(seq_id, None)
        self.position.pop(seq_id, None)
        self.kept.pop(seq_id, None)
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


class StatePool:
    """A backend's per-layer state arrays (`conv`, `delta`) indexed by `slots`: what every backend does
    the same way, whatever its array type. Subclasses supply `_grow` and may sync in `_stored`."""

    slots: StateSlots
    conv: dict[int, Any]
    delta: dict[int, Any]
    kept: dict[int, Any]
    _capacity: int

    def _grow(self, capacity: int) -> None:
        raise NotImplementedError

    def _stored(self, layer: int) -> None:
        """After `put_state` wrote `layer`'s arrays (MLX evaluates them here)."""

    def release(self, seq_id: int) -> None:
        self.slots.release(seq_id)
        self.kept.pop(seq_id, None)

    def state(self, layer: int, seq_id: int, num_tokens: int) -> tuple[Any, Any]:
        """The conv [K-1, Ch] and delta [Hv, Dk, Dv] state of a sequence in a LINEAR layer, right after its
        first `num_tokens` positions (a hand-over's save; ValueError when the state is elsewhere)."""
        slot = self.slots.held_at(seq_id, num_tokens)
        return self.conv[layer][slot], self.delta[layer][slot]

    def put_state(self, layer: int, seq_id: int, num_tokens: int, conv: Any, delta: Any) -> None:
        """Hold an arriving state of a sequence's LINEAR layer, after `num_tokens` positions (a hand-over's load)."""
        slot = self.slots.adopt(seq_id, num_tokens)
        if self.slots.capacity > self._capacity:
            self._grow(max(self.slots.capacity, 2 * self._capacity))
        self.conv[layer][slot] = conv
        self.delta[layer][slot] = delta
        self._stored(layer)


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
