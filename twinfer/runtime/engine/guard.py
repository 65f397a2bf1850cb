"""The token-loop guard: cut a generation that has collapsed into repeating itself.
A loop is a tail made of one unit (1..`max_period` tokens) repeated at least `min_copies` times; how
long it must be before a cut depends on whether the unit is text, blank or filler (docs/guard.md).
The guard never cuts where a grammar bounds the next token; it only reads, the engine stops or retries."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from twinfer.runtime.engine.params import GuardConfig

_HEX_LETTERS = frozenset("abcdefABCDEFxX")  # 0x1f, \xff, deadbeef: digits, not words
UNIT_CACHE = 4096  # units whose kind is remembered (repeats recur token after token)
BOUNDED_FRACTION = 0.5  # a grammar allowing under half the vocabulary bounds the token (measured: 0.97 vs 1e-4)


def unit_kind(text: str) -> str:
    """What a repeating unit's text is: "blank", "text" or "filler" (see the module docstring)."""
    text = text.replace("\u2581", " ")  # SentencePiece's word-boundary marker
    if not text.strip():
        return "blank"
    if len(set(text)) == 1:
        return "filler"  # one character repeated: 0000, AAAA (base64 of zeros), ----
    if not any(ch.isalpha() and ch not in _HEX_LETTERS for ch in text):
        return "filler"
    if text.isascii() and all(ch.isalnum() or ch in "+/=" for ch in text):
        return "filler"  # letters and digits with nothing between: base64, hashes (text spaces its words)
    return "text"


@dataclass(frozen=True)
class Loop:
    """A loop found at the tail: its unit of `period` tokens, the `span` of tokens it covers, its kind."""

    period: int
    span: int
    kind: str


class LoopGuard:
    """Decides whether a token sequence ends in a loop. One per engine; caches each token's text."""

    def __init__(self, piece: Callable[[int], str]):
        self._piece = piece
        self._text: dict[int, str] = {}
        self._units: dict[tuple[int, ...], tuple[str, int]] = {}  # a unit's kind and characters
        self.trips = 0

    def text(self, token: int) -> str:
        cached = self._text.get(token)
        if cached is None:
            cached = self._text[token] = self._piece(token)
        return cached

    def check(self, tokens: Sequence[int], cfg: GuardConfig) -> bool:
        """True when `tokens` (a request's output so far) ends in a loop under `cfg`."""
        return cfg.enabled and self.find(tokens, cfg) is not None

    def find(self, tokens: Sequence[int], cfg: GuardConfig, end: int | None = None) -> Loop | None:
        """The loop that `tokens[:end]` ends in, or None. Cheap when there is none: only periods whose
        unit already occurs twice at the tail are looked at, and a multiple of a period already judged
        is skipped while that period's run covers it (its tail cannot be longer)."""
        seq = tokens if isinstance(tokens, list) else list(tokens)
        n = len(seq) if end is None else end
        top = min(cfg.max_period, n // cfg.min_copies)
        if top < 1:
            return None
        window = seq[n - 1 - top : n - 1][::-1]  # window[j] is the token p = j + 1 before the last one
        last, j = seq[n - 1], 0
        judged: list[tuple[int, int]] = []  # (period, tokens of the tail known to repeat it)
        while True:
            try:
                j = window.index(last, j)
            except ValueError:
                return None
            p, j = j + 1, j + 1
            if any(p % q == 0 and p <= run for q, run in judged) or not _repeats(seq, n, p, 2 * p):
                continue
            kind, need = self._need(seq[n - p : n], cfg)
            run = 2 * p  # grown by doubling: the cost follows the repeat, not the (long) limit
            while run < need and _repeats(seq, n, p, min(2 * run, need)):
                run = min(2 * run, need)
            if run >= need:
                return Loop(p, need, kind)
            if run >= 2 * top:
                return None  # every longer period is a multiple of p here, and needs no fewer tokens
            judged.append((p, run))
            j = max(j, run // 2)  # a period q <= run / 2 repeats here only as a multiple of p: skip them

    def _need(self, unit: list[int], cfg: GuardConfig) -> tuple[str, int]:
        """The unit's kind and how many tokens of it in a row make a loop."""
        key = tuple(unit)
        found = self._units.get(key)
        if found is None:
            if len(self._units) >= UNIT_CACHE:
                self._units.clear()
            text = "".join(self.text(t) for t in unit)
            found = self._units[key] = (unit_kind(text), len(text))
        kind, length = found
        chars = {"text": cfg.text_chars, "blank": cfg.blank_chars}.get(kind, cfg.filler_chars)
        copies = -(-chars // max(length, 1))
        if kind == "text":
            copies = min(copies, cfg.text_copies)
        return kind, len(unit) * max(cfg.min_copies, copies)


def token_text(tokenizer: Any) -> Callable[[int], str]:
    """A token's text for the guard: decoded alone, with the leading space SentencePiece decoders drop
    from a lone word piece put back (so " yes yes" is words, not the run "yesyes")."""
    if tokenizer is None:
        return lambda token: f" t{token}"  # no vocabulary: every token is its own word

    def text(token: int) -> str:
        out = str(tokenizer.decode([token]))
        piece = tokenizer.id_to_piece(token) if hasattr(tokenizer, "id_to_piece") else None
        if isinstance(piece, str) and piece.startswith("\u2581") and out == piece[1:].replace("\u2581", " "):
            out = " " + out
        return out

    return text


def _repeats(seq: list[int], n: int, p: int, span: int) -> bool:
    """Whether the `span` tokens before `n` repeat with period `p` (False when fewer are there)."""
    return span <= n and seq[n - span + p : n] == seq[n - span : n - p]


def bounded_by_grammar(guide: Any) -> bool:
    """Whether a request's grammar (a constraints `Guide`, or None) bounds its next token: it allows
    under BOUNDED_FRACTION of the vocabulary (a number, a key, an enum), not free text (a JSON
    string, a think block, the text around a tool call). Costs one mask, so it is asked only when
    the guard would cut. A completed grammar allows only EOS: bounded too (the request stops on it)."""
    if guide is None:
        return False
    words = np.frombuffer(guide.matcher.compute_bitmask(), dtype=np.uint32)
    allowed = int(np.bitwise_count(words).sum())
    return 0 < allowed < BOUNDED_FRACTION * 32 * len(words)  # none allowed: the matcher failed, the text is free
