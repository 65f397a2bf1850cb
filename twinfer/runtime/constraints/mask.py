"""Allowed-token masks for a step's constrained rows, and the matcher bookkeeping around sampling.
`row_masks` fills every constrained row's bitmask in one llguidance call; a `RowMask` stays packed and
is expanded only when needed. `draft_masks` gives the mask after each draft prefix, so the verifier
sees the constrained distribution and the matcher advances only over emitted tokens."""

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


class RowMask:
    """One row's allowed tokens as llguidance packs them (bit i of word j: token 32j + i). Testing a
    token is a bit lookup; the full [vocab] expansion is made only when a row needs it."""

    def __init__(self, words: np.ndarray, vocab: int):
        self.words = words  # int32 [ceil(n / 32)]
        self.vocab = vocab

    def allows(self, token: int) -> bool:
        return token < 32 * len(self.words) and bool((int(self.words[token >> 5]) >> (token & 31)) & 1)

    def bools(self) -> np.ndarray:
        """bool [vocab]; a row that allows nothing allows everything (the matcher is in its error
        state and the request ends on the next stop rule)."""
        bits = np.unpackbits(self.words.view(np.uint8), bitorder="little")[: self.vocab].view(bool)
        return bits if bits.any() else np.ones(self.vocab, dtype=bool)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """A copy of one row of logits with the refused tokens at -inf."""
        return np.where(self.bools(), logits, np.float32(-np.inf)).astype(np.float32, copy=False)

    def argmax(self, logits: np.ndarray, probe: int = 32) -> int:
        """The most likely allowed token. The model's own choice is usually allowed, so the top few
        are tested bit by bit before the row is expanded."""
        best = int(np.argmax(logits))
        if self.allows(best):
            return best
        top = np.argpartition(-logits, probe)[:probe]
        for t in top[np.argsort(-logits[top], kind="stable")]:
            if self.allows(int(t)):
                return int(t)
        return int(np.argmax(self.apply(logits)))


def row_masks(guides: Sequence[Guide], vocab: int) -> list[RowMask]:
    """The next-token masks of a step's constrained rows, filled in one parallel llguidance call."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

    grammars = guides[0].grammars
    started = time.perf_counter()
    bitmask = allocate_token_bitmask(len(guides), grammars.ll_tokenizer().vocab_size)
    fill_next_token_bitmask_par(grammars.executor(), [(g.matcher, i) for i, g in enumerate(guides)], bitmask)
    _count(grammars.stats, len(guides), time.perf_counter() - started)
    return [RowMask(words, vocab) for words in bitmask]


def draft_masks(guide: Guide, draft: Sequence[int], vocab: int) -> list[RowMask]:
    """The mask before the draft and after each of its prefixes, up to the first draft token the
    grammar refuses (the verifier stops there; later rows are left unmasked)."""
    started = time.perf_counter()
    m = guide.matcher
    masks: list[RowMask] = []
    for i in range(len(draft) + 1):
        masks.append(RowMask(np.frombuffer(m.compute_bitmask(), dtype=np.int32), vocab))
        if i == len(draft) or m.is_stopped() or not masks[-1].allows(int(draft[i])):
            break  # consuming a refused token would put the matcher in its error state for good
        m.consume_token(int(draft[i]))
    if len(masks) > 1:
        m.rollback(len(masks) - 1)
    _count(guide.stats, len(masks), time.perf_counter() - started)
    return masks


def timed_apply(guide: Guide, mask: RowMask, logits: np.ndarray) -> np.ndarray:
    """`mask.apply`, its time counted with the mask work."""
    started = time.perf_counter()
    out = mask.apply(logits)
    guide.stats.mask_seconds += time.perf_counter() - started
    return out


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
