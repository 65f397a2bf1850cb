"""Block tables of the sliding-window layers, in a pool of their own, bounded by the window.
Blocks wholly before `start - window + 1` return to the pool when a chunk starts (never at the end, so a
rollback keeps what it needs); dropped positions map to the null block 0, which the window mask hides."""

from __future__ import annotations

NULL_BLOCK = 0


def per_sequence(window: int, block_size: int, chunk: int) -> int:
    """The most blocks one sequence's window layers hold while a chunk of `chunk` tokens runs."""
    return -(-(window - 1 + chunk) // block_size) + 1


class WindowBlocks:
    """Per-sequence block tables of the sliding-window layers (the runner, one thread): `table(seq_id,
    start, end)` frees what the window left behind and returns the table (NULL_BLOCK where dropped)."""

    def __init__(self, num_blocks: int, block_size: int, window: int):
        if num_blocks < 2 or block_size <= 0 or window <= 0:
            raise ValueError("a window pool needs at least 2 blocks (one is the null block), a block size and a window")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window
        self.free: list[int] = list(range(num_blocks - 1, NULL_BLOCK, -1))  # pop() gives low ids first
        self.tables: dict[int, list[int]] = {}

    def table(self, seq_id: int, start: int, end: int) -> list[int]:
        bs = self.block_size
        t = self.tables.get(seq_id)
        if t is None:
            if start:
                raise ValueError(f"sequence {seq_id} starts at position {start}, but the sliding-window layers hold "
                                 "no KV for its prefix (prefix reuse is off for this runner)")
            t = self.tables[seq_id] = []
        keep = max(0, start - self.window + 1) // bs  # first block a query of this chunk can read
        for i in range(min(keep, len(t))):
            if t[i] != NULL_BLOCK:
                self.free.append(t[i])
                t[i] = NULL_BLOCK
        if NULL_BLOCK in t[keep:]:
            raise ValueError(f"sequence {seq_id} went back to position {start}, before the window's KV it kept")
        need = -(-end // bs) - len(t)
        if need > len(self.free):
            raise ValueError(f"the sliding-window KV pool ({self.num_blocks - 1} blocks) is full: sequence {seq_id} "
                             f"needs {need} more; open the runner with a larger max_seqs or max_chunk")
        t.extend(self.free.pop() for _ in range(need))
        return t

    def held(self, seq_id: int) -> int:
        """Blocks the sequence holds now."""
        return sum(b != NULL_BLOCK for b in self.tables.get(seq_id, ()))

    def release(self, seq_id: int) -> None:
        for b in self.tables.pop(seq_id, ()):
            if b != NULL_BLOCK:
                self.free.append(b)

    @property
    def num_free(self) -> int:
        return len(self.free)
