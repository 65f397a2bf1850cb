"""Allowed-token masks for a step's constrained rows, and the matcher bookkeeping around sampling.

A `Guide` is one request's matcher plus the engine's counters. `allowed_rows` fills the bitmasks of
every constrained row of a step in one parallel llguidance call; `apply` turns them into -inf on the
logits. For a drafted decode, `draft_masks` gives the mask after each draft prefix, so the verifier
sees the constrained distribution at every position (a draft token the grammar refuses is rejected,
and the matcher is only advanced over the tokens the request emits).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from twinfer.runtime.constraints.compile import ConstraintStats, Grammars
from twinfer.runtime.constraints.spec import Constraint


@dataclass
class Guide:
    """One request's grammar state. `consumed` counts the output tokens the matcher has taken;
    `done_at` is that count when the grammar completed (a drafted step advances several at once)."""

    matcher: Any  # llguidance.LLMatcher
    grammars: Grammars
    consumed: int = 0
    done_at: int | None = None

    @property
    def stats(self) -> ConstraintStats:
        return self.grammars.stats

    def advance(self, tokens: Sequence[int]) -> None:
        """The request emitted `tokens`: move the matcher over them."""
        for token in tokens:
            if self.matcher.is_stopped():
                return  # only EOS is left to accept; the engine stops the request on it
            if not self.matcher.consume_token(int(token)):
                self.stats.rejected_tokens += 1
                return
            self.consumed += 1
            if self.matcher.is_stopped():
                self.done_at = self.consumed

    def reset(self) -> None:
        self.matcher.reset()
        self.consumed, self.done_at = 0, None

    def complete_at(self, output_tokens: int) -> bool:
        """Whether the grammar was complete once the request had `output_tokens` tokens."""
        return self.done_at is not None and output_tokens >= self.done_at


def _unpack(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """bool [R, vocab] from llguidance's int32 bitmask [R, ceil(n / 32)] (bit i of word j: token 32j+i)."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab].astype(bool)


def allowed_rows(guides: Sequence[Guide], vocab: int) -> np.ndarray:
    """bool [len(guides), vocab]: the tokens each guide's grammar allows next."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

    grammars = guides[0].grammars
    started = time.perf_counter()
    bitmask = allocate_token_bitmask(len(guides), grammars.ll_tokenizer().vocab_size)
    fill_next_token_bitmask_par(grammars.executor(), [(g.matcher, i) for i, g in enumerate(guides)], bitmask)
    allowed = _unpack(bitmask, vocab)
    _count(grammars.stats, len(guides), time.perf_counter() - started)
    return allowed


def draft_masks(guide: Guide, draft: Sequence[int], vocab: int) -> np.ndarray:
    """bool [len(draft) + 1, vocab]: the mask before the draft and after each of its prefixes.
    Rows past the first draft token the grammar refuses allow everything (the verifier stops there)."""
    started = time.perf_counter()
    m = guide.matcher
    rows = np.ones((len(draft) + 1, vocab), dtype=bool)
    consumed = 0
    for i in range(len(draft) + 1):
        rows[i] = _single(m, vocab)
        if i == len(draft) or m.is_stopped() or not rows[i][draft[i]]:
            break  # consuming a refused token would put the matcher in its error state for good
        m.consume_token(int(draft[i]))
        consumed += 1
    if consumed:
        m.rollback(consumed)
    _count(guide.stats, consumed + 1, time.perf_counter() - started)
    return rows


def _single(matcher: Any, vocab: int) -> np.ndarray:
    raw = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    return np.unpackbits(raw, bitorder="little")[:vocab].astype(bool)


def apply(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """A copy of `logits` with the disallowed tokens at -inf (a row allowing nothing keeps its logits:
    the matcher is in an error state and the request is about to end)."""
    dead = ~allowed.any(axis=-1, keepdims=True)
    return np.where(allowed | dead, logits, -np.inf).astype(np.float32, copy=False)


def _count(stats: ConstraintStats, rows: int, seconds: float) -> None:
    stats.mask_steps += 1
    stats.mask_rows += rows
    stats.mask_seconds += seconds


def guide_for(grammars: Grammars, constraint: Constraint | None) -> Guide | None:
    """A request's Guide for `constraint` (None: unconstrained); GrammarError if it does not compile."""
    if constraint is None:
        return None
    guide = Guide(grammars.matcher(constraint), grammars)
    grammars.stats.constrained_requests += 1
    return guide
