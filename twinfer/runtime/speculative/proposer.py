"""What a proposer is asked for (up to `k` next tokens of a decoding request) and what it answers;
`accept.verify` keeps the longest prefix the target agrees with."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from twinfer.runtime.engine.sampler import RowState

Dist = tuple[np.ndarray, np.ndarray]  # (candidate ids, probabilities), as sampler.filtered returns


@dataclass
class DraftQuery:
    """One request's question to a proposer: `tokens` are prompt and output, the last not yet in the
    target's KV, so verification starts at `len(tokens) - 1`."""

    seq_id: int
    tokens: list[int]
    k: int  # most draft tokens wanted (>= 1)
    row: RowState  # sampling parameters and the request's generator (sampled drafts draw from it)
    block_table: list[int]  # the target's KV blocks (proposers that share the target's KV read them)


@dataclass
class Draft:
    """Proposed next tokens. `dists[i]` is the distribution token i was drawn from (sampled drafts
    of a draft model); None means every token is a point mass (n-gram lookup, greedy drafts)."""

    tokens: list[int]
    dists: list[Dist] | None = None

    def __post_init__(self) -> None:
        if self.dists is not None and len(self.dists) != len(self.tokens):
            raise ValueError("a draft needs one distribution per token")


class Proposer(ABC):
    """Guesses the next tokens of decoding requests. Called by the engine's Speculator from the
    engine thread, once per step, before the target's forward pass of that step."""

    name: str

    @abstractmethod
    def propose(self, queries: list[DraftQuery]) -> list[Draft | None]:
        """One answer per query, in order: at most `query.k` tokens, or None for no guess."""

    def release(self, seq_id: int) -> None:  # noqa: B027 - optional hook
        """The request finished: forget its state (and a draft model's KV)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free what the proposer holds (a draft runner); it is unusable afterwards."""


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists (fast when one extends the other)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo = max(0, n - 64)  # a mismatch is usually near the end: a rejected draft
    if a[:lo] != b[:lo]:
        lo = 0
    while lo < n and a[lo] == b[lo]:
        lo += 1
    return lo
