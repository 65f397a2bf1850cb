"""The llama.cpp runner's KV for a KV connector: a sequence's cells as llama.cpp serializes them
(`llama_state_seq_get_data`, one "layer"); `parse_seq_state` splits that blob into its K/V rows and the
rest, following llama.cpp's writer (the layout: docs/internals.md, "llama.cpp sequence state")."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from twinfer.backends.llamacpp.runner import LlamaCppRunner

STATE_MAGIC = 0xAF143CD8  # llama_context's io_magic, first in every sequence state
CELL_EXT_BYTES = 12  # llama_kv_cell_ext: x, y, tok (written only by models that keep them)
_LIMIT = 1 << 20  # a sanity bound on counts read from the blob


@dataclass(frozen=True)
class SeqState:
    """What a sequence-state blob holds, by byte: K/V rows, per-cell metadata, headers."""

    kv: int  # K and V rows of every layer at every cell written
    cell_meta: int  # each cell's position and sequence ids (and cell ext)
    headers: int  # magic, seq id, stream/cell/layer counts, each layer's type and row size
    cells: tuple[int, ...]  # cells written per KV cache (a sliding-window cache may hold fewer)

    @property
    def framing(self) -> int:
        return self.cell_meta + self.headers


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def take(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += struct.calcsize(fmt)
        return int(value)

    def skip(self, n: int) -> None:
        if self.at + n > len(self.data):
            raise ValueError(f"a section of {n} bytes at offset {self.at} runs past the {len(self.data)}-byte state")
        self.at += n

    def count(self, what: str) -> int:
        n = self.take("<I")
        if n > _LIMIT:
            raise ValueError(f"{what} {n} at offset {self.at - 4} is not a count")
        return n


def _parse(data: bytes, values: bool, ext: int) -> SeqState:
    r = _Reader(data)
    if r.take("<I") != STATE_MAGIC:
        raise ValueError("it does not start with llama.cpp's sequence-state magic")
    r.skip(4)  # seq_id
    kv = meta = 0
    headers = 8
    cells: list[int] = []
    while r.at < len(data):  # one KV cache after another
        n_stream = r.count("n_stream")
        headers += 4
        written = 0
        for _ in range(n_stream):
            count = r.count("cell_count")
            headers += 4
            if not count:
                continue
            written += count
            for _ in range(count):
                r.skip(4)  # pos
                n_seq = r.count("n_seq_id")
                r.skip(ext + 4 * n_seq)
                meta += 8 + ext + 4 * n_seq
            v_trans, n_layer = r.count("v_trans"), r.count("n_layer")
            headers += 8
            if v_trans > 1:
                raise ValueError(f"v_trans {v_trans} is not a flag")
            for _ in range(n_layer):  # K rows
                r.skip(4)
                row = r.take("<Q")
                headers += 12
                r.skip(row * count)
                kv += row * count
            for _ in range(n_layer if values else 0):  # V rows (or V transposed: element by element)
                r.skip(4)
                size = r.take("<I") * r.count("n_embd_v_gqa") if v_trans else r.take("<Q")
                headers += 12  # type + row size (v_trans: type + element size + row width)
                r.skip(size * count)
                kv += size * count
        cells.append(written)
    return SeqState(kv, meta, headers, tuple(cells))


def parse_seq_state(data: bytes, values: bool = True) -> SeqState:
    """Split a `llama_state_seq_get_data` blob; `values`: the cache keeps V (not under MLA).
    ValueError when it is not a KV cache's state (a recurrent model's, say)."""
    error = ""
    for ext in (0, CELL_EXT_BYTES):  # whether cells carry their ext is the model's, not the blob's
        try:
            state = _parse(data, values, ext)
        except (ValueError, struct.error) as e:
            error = str(e)
            continue
        return state
    raise ValueError(f"not a llama.cpp KV cache's sequence state: {error}")


class LlamaCppKVPort:
    """`runtime.kv.connector.KVPort` over `LlamaCppRunner`'s sequence state (one layer: the whole state)."""

    def __init__(self, runner: LlamaCppRunner):
        self.runner = runner
        spec = runner.spec
        self.values = spec.mla is None  # llama.cpp keeps no V beside an MLA latent
        self.format = (f"llamacpp:{spec.name}:{runner.path.stat().st_size}:{runner.kv_type}:"
                       f"{'unified' if runner.unified_kv else 'streams'}")

    def num_layers(self) -> int:
        return 1

    def check(self) -> None:
        """Every KV type moves as llama.cpp serializes it."""

    def kv_bytes(self, layer: int, data: bytes) -> int:
        """The K/V rows in the state; a state that is not a KV cache's (recurrent) counts whole."""
        try:
            return parse_seq_state(data, self.values).kv
        except ValueError:
            return len(data)

    def save_layer(self, layer: int, seq_id: int, table: list[int], num_tokens: int) -> bytes:
        held = self.runner.num_stored(seq_id)
        if held < num_tokens:
            raise ValueError(f"sequence {seq_id} holds {held} positions, not the {num_tokens} to hand over")
        if held > num_tokens:
            self.runner.truncate(seq_id, num_tokens)
        return self.runner.save_seq_state(seq_id)

    def load_layer(self, layer: int, seq_id: int, table: list[int], num_tokens: int, data: bytes) -> None:
        held = self.runner.load_seq_state(seq_id, data)
        if held != num_tokens:
            self.runner.release(seq_id)
            raise ValueError(f"the KV state holds {held} positions, expected {num_tokens}")
