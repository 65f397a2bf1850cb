"""What the engine hands a runner for one forward step, and what comes back: a flat list of chunks, one
per sequence (new tokens, first position, KV blocks for `[0, start + len(tokens))`), prefill and decode
mixed."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from twinfer.runtime.vision import ChunkImage


class LogitsWanted(Enum):
    NONE = "none"  # a prefill chunk that is not the last one: only fill the KV cache
    LAST = "last"  # the row to sample the next token from
    ALL = "all"  # every position (teacher-forced evaluation, speculative verification)


@dataclass
class SeqChunk:
    """The part of one sequence computed in this step."""

    seq_id: int
    tokens: list[int]
    start: int  # position of tokens[0]
    block_table: list[int] = field(default_factory=list)  # KV block ids, in position order
    logits: LogitsWanted = LogitsWanted.LAST
    images: list[ChunkImage] = field(default_factory=list)  # image features over some of `tokens`

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ValueError(f"sequence {self.seq_id}: a chunk needs at least one token")
        if self.start < 0:
            raise ValueError(f"sequence {self.seq_id}: negative start position {self.start}")

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def logit_rows(self) -> int:
        if self.logits is LogitsWanted.LAST:
            return 1
        return len(self.tokens) if self.logits is LogitsWanted.ALL else 0


@dataclass
class StepBatch:
    """All chunks of one step; logit rows come back in chunk order, then position order. `exact`: built in
    the runner's `ExactShapes` (batch-invariant mode); any padding is the runner's, inside `step`."""

    chunks: list[SeqChunk]
    exact: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks)

    @property
    def num_logit_rows(self) -> int:
        return sum(c.logit_rows for c in self.chunks)

    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.tokens]

    def positions(self) -> list[int]:
        return [p for c in self.chunks for p in range(c.start, c.end)]

    def logit_token_index(self) -> list[int]:
        """Index into the flat token list of every row that needs logits."""
        rows: list[int] = []
        offset = 0
        for c in self.chunks:
            n = len(c.tokens)
            if c.logits is LogitsWanted.LAST:
                rows.append(offset + n - 1)
            elif c.logits is LogitsWanted.ALL:
                rows.extend(range(offset, offset + n))
            offset += n
        return rows

    def slot_mapping(self, block_size: int) -> list[int]:
        """Flat KV slot of every new token: block_table[pos // block_size] * block_size + pos % block_size."""
        slots: list[int] = []
        for c in self.chunks:
            needed = -(-c.end // block_size)
            if len(c.block_table) < needed:
                raise ValueError(
                    f"sequence {c.seq_id}: {len(c.block_table)} KV blocks cannot hold {c.end} positions"
                )
            for pos in range(c.start, c.end):
                slots.append(c.block_table[pos // block_size] * block_size + pos % block_size)
        return slots
