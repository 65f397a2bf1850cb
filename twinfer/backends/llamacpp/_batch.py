"""A reusable `llama_batch` with numpy views on its arrays; `plan_windows` cuts a step into calls of at
most `capacity` tokens, splitting chunks where needed, logit rows still in batch order. An image's feature
rows go in calls of their own: llama.cpp decodes a batch of token ids or of embeddings, not both."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from twinfer.runtime.batch import LogitsWanted, SeqChunk


@dataclass(frozen=True)
class Piece:
    """Tokens [a, b) of chunk `chunk` in one window; `image` >= 0: rows of that `chunk.images` entry."""

    chunk: int
    a: int
    b: int
    image: int = -1


def plan_windows(chunks: list[SeqChunk], capacity: int) -> list[list[Piece]]:
    """Split the chunks' tokens, in order, into windows of at most `capacity` tokens, image rows alone."""
    windows: list[list[Piece]] = [[]]
    room = capacity
    for i, chunk in enumerate(chunks):
        for a, end, image in _segments(chunk):
            if image >= 0:
                windows += [[Piece(i, s, min(end, s + capacity), image)] for s in range(a, end, capacity)]
                windows.append([])
                room = capacity
                continue
            while a < end:
                if room == 0:
                    windows.append([])
                    room = capacity
                b = min(end, a + room)
                windows[-1].append(Piece(i, a, b))
                room -= b - a
                a = b
    return [w for w in windows if w]


def _segments(chunk: SeqChunk) -> list[tuple[int, int, int]]:
    """(a, b, image index or -1) covering the chunk's tokens in order: text runs and image rows."""
    out: list[tuple[int, int, int]] = []
    at = 0
    for k, im in sorted(enumerate(chunk.images), key=lambda e: e[1].offset):
        if im.offset > at:
            out.append((at, im.offset, -1))
        out.append((im.offset, im.offset + im.rows, k))
        at = im.offset + im.rows
    if at < len(chunk.tokens):
        out.append((at, len(chunk.tokens), -1))
    return out


def output_flags(chunk: SeqChunk, a: int, b: int) -> np.ndarray:
    """int8 logits flags for tokens [a, b) of `chunk`, per its LogitsWanted."""
    flags = np.zeros(b - a, dtype=np.int8)
    if chunk.logits is LogitsWanted.ALL:
        flags[:] = 1
    elif chunk.logits is LogitsWanted.LAST and b == len(chunk.tokens):
        flags[-1] = 1
    return flags


class BatchBuffer:
    """One `llama_batch_init` allocation (of ids, or with `n_embd` of embeddings), refilled every window."""

    def __init__(self, lib: ModuleType, capacity: int, n_embd: int = 0):
        self._lib = lib
        self.capacity = capacity
        self.raw: Any = lib.llama_batch_init(capacity, n_embd, 1)  # 1 seq id per token
        as_array = np.ctypeslib.as_array
        if n_embd:
            self._embd = as_array(self.raw.embd, shape=(capacity, n_embd))
        else:
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

    def fill_embeddings(self, rows: np.ndarray, start: int, seq: int, flags: np.ndarray) -> int:
        """Write `rows` [m, n_embd] at positions start.. of llama seq `seq`; returns the output rows."""
        m = rows.shape[0]
        self._embd[:m] = rows
        self._pos[:m] = np.arange(start, start + m, dtype=np.int32)
        self._logits[:m] = flags
        for row in self._seq_rows[:m]:
            row[0] = seq
        self.raw.n_tokens = m
        return int(np.count_nonzero(flags))

    def free(self) -> None:
        if self.raw is not None:
            self._seq_rows = []
            self._lib.llama_batch_free(self.raw)
            self.raw = None


def check_images(chunk: SeqChunk, n_embd: int, whole_limit: int) -> None:
    """Refuse image rows outside the chunk, overlapping, of another width, or bidirectional beyond one
    ubatch (`whole_limit` rows): llama.cpp's rows see each other only inside one."""
    at = 0
    for im in sorted(chunk.images, key=lambda e: e.offset):
        shape: tuple[int, ...] = tuple(getattr(im.features, "shape", ()))
        if len(shape) != 2 or shape[1] != n_embd:
            raise ValueError(f"sequence {chunk.seq_id}: image features {tuple(shape)} are not [rows, {n_embd}]")
        if im.offset < at or im.offset + im.rows > len(chunk.tokens):
            raise ValueError(f"sequence {chunk.seq_id}: image rows [{im.offset}, {im.offset + im.rows}) overlap "
                             f"another image or fall outside its chunk of {len(chunk.tokens)} tokens")
        if im.bidirectional and im.rows > whole_limit:
            raise ValueError(f"sequence {chunk.seq_id}: an image of {im.rows} rows attends both ways, but one "
                             f"llama.cpp batch holds {whole_limit}; raise n_batch and n_ubatch")
        at = im.offset + im.rows


def decode_image(lib: ModuleType, ctx: Any, buffer: BatchBuffer, chunk: SeqChunk, piece: Piece,
                 slot: int) -> tuple[int, int]:
    """One image's rows of `piece` as embeddings, non-causal if bidirectional; (output rows, llama_decode's code)."""
    image = chunk.images[piece.image]
    rows = np.asarray(image.features, dtype=np.float32)[piece.a - image.offset : piece.b - image.offset]
    n_out = buffer.fill_embeddings(rows, chunk.start + piece.a, slot, output_flags(chunk, piece.a, piece.b))
    if image.bidirectional:
        lib.llama_set_causal_attn(ctx, False)
    try:
        return n_out, int(lib.llama_decode(ctx, buffer.raw))
    finally:
        if image.bidirectional:
            lib.llama_set_causal_attn(ctx, True)
