"""Streaming detokenization: turn generated token ids into text as they arrive.
`StreamDecoder` decodes a short window with a prefix offset (vLLM's and mlx-lm's technique) and emits
only text not ending in U+FFFD, so a split character comes out once, whole; O(1) amortized per token."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"


class _Decodes(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


class StreamDecoder:
    """Incremental detokenizer for one sequence, fed by the engine per generated token: every `push` plus
    the final `flush` equals `tokenizer.decode(ids)`, never ending inside a character. `context_ids` are
    decoded for context, never emitted (keeps the first word's leading space)."""

    def __init__(
        self, tokenizer: _Decodes, skip_special_tokens: bool = False, context_ids: Sequence[int] = ()
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(context_ids)
        # ids[prefix:read] decode to text that was already emitted; ids[read:] are not emitted yet.
        self._prefix = 0
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids) if self._ids else ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is still incomplete)."""
        self._ids.append(token_id)
        text = self._decode(self._ids[self._prefix :])
        if text.endswith(_REPLACEMENT) or len(text) <= len(self._prefix_text):
            return ""
        new_text = text[len(self._prefix_text) :]
        self._advance()
        return new_text

    def flush(self) -> str:
        """Return whatever is still held back (e.g. an incomplete character at the end, as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        text = self._decode(self._ids[self._prefix :])
        new_text = text[len(self._prefix_text) :]
        self._advance()
        return new_text

    def _advance(self) -> None:
        # The window restarts at the tokens just emitted: they are the context for the next ones.
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        if self._prefix > 64:  # drop ids no window will read again
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0

    @property
    def token_ids(self) -> list[int]:
        """Pushed ids not yet dropped (context ids included); for debugging."""
        return list(self._ids)
