"""N-gram prompt lookup (vLLM's `ngram`, llama.cpp's lookup decoding): propose what followed the most
recent earlier occurrence of the request's last n tokens (`max_n` down to `min_n`, at least 3). An
incremental index keeps a lookup O(max_n); the draft is a point mass."""

from __future__ import annotations

from dataclasses import dataclass, field

from twinfer.runtime.speculative.proposer import Draft, DraftQuery, Proposer, common_prefix


@dataclass
class _Index:
    tokens: list[int] = field(default_factory=list)  # the tokens indexed so far
    after: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> position following it


class NgramProposer(Proposer):
    """Prompt-lookup proposer over each request's own tokens; no model, no KV."""

    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 3):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes need 1 <= min_n <= max_n (got min_n={min_n}, max_n={max_n})")
        self.max_n, self.min_n = max_n, min_n
        self._index: dict[int, _Index] = {}

    def propose(self, queries: list[DraftQuery]) -> list[Draft | None]:
        return [self._lookup(q) for q in queries]

    def release(self, seq_id: int) -> None:
        self._index.pop(seq_id, None)

    def _lookup(self, q: DraftQuery) -> Draft | None:
        tokens = q.tokens
        index = self._update(q.seq_id, tokens)
        end = len(tokens)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            start = index.after.get(tuple(tokens[end - n :]))
            if start is not None:
                return Draft(continuation(tokens, start, q.k))
        return None

    def _update(self, seq_id: int, tokens: list[int]) -> _Index:
        """Index every n-gram that ends before the last token (the last one is what we look up)."""
        index = self._index.get(seq_id)
        if index is None or common_prefix(index.tokens, tokens) < len(index.tokens):
            index = self._index[seq_id] = _Index()  # new request, or its output was replaced (retry)
        after = index.after
        for pos in range(len(index.tokens), len(tokens) - 1):  # n-grams ending at pos, followed by pos + 1
            for n in range(self.min_n, min(self.max_n, pos + 1) + 1):
                after[tuple(tokens[pos + 1 - n : pos + 1])] = pos + 1
        index.tokens = tokens[: max(len(tokens) - 1, 0)]
        return index


def continuation(tokens: list[int], start: int, k: int) -> list[int]:
    """k tokens from `start` on; past the end, the period `len(tokens) - start` repeats."""
    period = len(tokens) - start
    return [tokens[start + i % period] for i in range(k)]
