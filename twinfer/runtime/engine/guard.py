"""The token-loop guard: cut a generation that repeats itself.

A model that emits the same token 4 or more times in a row is looping (a serving-layer guard, as
the seeds describe), unless the token is punctuation, whitespace or box drawing: a model drawing a
table of dashes is fine. Short cycles (the same n-gram of period 2..8 repeated K times at the tail)
are loops too. The guard only reads tokens; the engine decides to stop or retry.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Sequence

from twinfer.runtime.engine.params import GuardConfig

_BOX_DRAWING = range(0x2500, 0x25A0)  # box drawing and block elements


def is_exempt_text(text: str) -> bool:
    """True for text made only of punctuation, whitespace, math/modifier symbols or box drawing."""
    if not text:
        return True
    for ch in text:
        cat = unicodedata.category(ch)
        if ch.isspace() or cat[0] in "PZ" or cat in ("Sm", "Sk") or ord(ch) in _BOX_DRAWING:
            continue
        if ch == "\u2581":  # SentencePiece's word-boundary marker
            continue
        return False
    return True


class LoopGuard:
    """Decides whether a token sequence ends in a loop. One per engine; caches exemptions per id."""

    def __init__(self, piece: Callable[[int], str]):
        self._piece = piece
        self._exempt: dict[int, bool] = {}
        self.trips = 0

    def exempt(self, token: int) -> bool:
        cached = self._exempt.get(token)
        if cached is None:
            cached = self._exempt[token] = is_exempt_text(self._piece(token))
        return cached

    def check(self, tokens: Sequence[int], cfg: GuardConfig) -> bool:
        """True when `tokens` (a request's output so far) ends in a loop under `cfg`."""
        if not cfg.enabled or not tokens:
            return False
        last = tokens[-1]
        n = cfg.max_repeats
        if len(tokens) >= n and all(t == last for t in tokens[-n:]) and not self.exempt(last):
            return True
        k = cfg.cycle_repeats
        for period in range(2, cfg.cycle_period + 1):
            span = period * k
            if len(tokens) < span:
                break
            cycle = list(tokens[-period:])
            if len(set(cycle)) == 1:
                continue  # a single repeated token: the rule above
            if list(tokens[-span:]) == cycle * k and not all(self.exempt(t) for t in cycle):
                return True
        return False
