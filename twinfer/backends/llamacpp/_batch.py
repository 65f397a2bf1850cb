"""A reusable `llama_batch` with numpy views on its arrays; `plan_windows` cuts a step into calls of at
most `capacity` tokens, splitting chunks where needed, logit rows still in batch order."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from twinfer.runtime.batch import LogitsWanted, SeqChunk


@dataclass(frozen=True)
class Piece:
    """Tokens [a, b) of chunk `chunk`, decoded in one window."""

    chunk: int
    a: int
    b: int


def plan_windows(chunks: list[SeqChunk], capacity: int) -> list[list[Piece]]:
    """Split the chunks' tokens, in order, into windows of at most `capacity` tokens."""
    windows: list[list[Piece]] = [[]]
    room = capacity
    for i, chunk in enumerate(chunks):
        a = 0
        while a < len(chunk.tokens):
            if room == 0:
                windows.append([])
                room = capacity
            b = min(len(chunk.tokens), a + room)
            windows[-1].append(Piece(i, a, b))
            room -= b - a
            a = b
    return [w for w in windows if w]


def output_flags(chunk: SeqChunk, a: int, b: int) -> np.ndarray:
    """int8 logits flags for tokens [a, b) of `chunk`, per its LogitsWanted."""
    flags = np.zeros(b - a, dtype=np.int8)
    if chunk.logits is LogitsWanted.ALL:
        flags[:] = 1
    elif chunk.logits is LogitsWanted.LAST and b == len(chunk.tokens):
        flags[-1] = 1
    return flags


class BatchBuffer:
    """One `llama_batch_init` allocation, refilled every window instead of allocated per step."""

    def __init__(self, lib: ModuleType, capacity: int):
        self._lib = lib
        self.capacity = capacity
        self.raw: Any = lib.llama_batch_init(capacity, 0, 1)  # tokens, no embeddings, 1 seq id per token
        as_array = np.ctypeslib.as_array
        self._token = as_array(self.raw.token, shape=(capacity,))
        self._pos = as_array(self.raw.pos, shape=(capacity,))
        self._logits = as_array(self.raw.logits, shape=(capacity,))
        as_array(self.raw.n_seq_id, shape=(capacity,))[:] = 1
        # seq_id is an array of per-token pointers (one malloc each): written one int per token.
        self._seq_rows = [self.raw.seq_id[i] for i in range(capacity)]

    def fill(self, chunks: list[SeqChunk], pieces: list[Piece], slots: list[int]) -> int:
        """Write one window; `slots[i]` is chunk i's llama seq id. Returns the number of output rows."""
        n = n_out = 0
        for p in pieces:
            chunk, m, seq = chunks[p.chunk], p.b - p.a, slots[p.chunk]
            if m == 1:  # a decode row: scalar writes (a step of them runs between two llama_decode calls)
                wanted = chunk.logits is LogitsWanted.ALL or (
                    chunk.logits is LogitsWanted.LAST and p.b == len(chunk.tokens))
                self._token[n] = chunk.tokens[p.a]
                self._pos[n] = chunk.start + p.a
                self._logits[n] = wanted
                self._seq_rows[n][0] = seq
                n_out += wanted
                n += 1
                continue
            flags = output_flags(chunk, p.a, p.b)
            self._token[n : n + m] = chunk.tokens[p.a : p.b]
            self._pos[n : n + m] = np.arange(chunk.start + p.a, chunk.start + p.b, dtype=np.int32)
            self._logits[n : n + m] = flags
            for row in self._seq_rows[n : n + m]:
                row[0] = seq
            n_out += int(np.count_nonzero(flags))
            n += m
        self.raw.n_tokens = n
        return n_out

    def free(self) -> None:
        if self.raw is not None:
            self._seq_rows = []
            self._lib.llama_batch_free(self.raw)
            self.raw = None
