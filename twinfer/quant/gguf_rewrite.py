"""Rewrite a GGUF file: copy its metadata and tensors, changing what the caller asks.
The one copy loop behind `twinfer prune` and `twinfer quantize --gguf`: metadata from twinfer's own
parser (fast on large vocabularies), written with `gguf.GGUFWriter` to a temporary name, then moved."""

from __future__ import annotations

import contextlib
import mmap
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from twinfer.runtime.loaders.gguf_reader import GGUFContents

ARRAY = 9  # GGUF value type of an array
SKIP = object()  # a `values` callback's answer: leave the key out

# (name, raw tensor bytes with the element axis last, ggml type id) -> the same, changed; None drops it
TensorEdit = Callable[[str, np.ndarray, int], "tuple[str, np.ndarray, int] | None"]
ValueEdit = Callable[[str, Any], Any]  # (key, value) -> new value, or SKIP


CHUNK_BYTES = 16 << 20  # how much of a tensor a rewrite holds (or keeps resident from the source) at once
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)


class Streamed:
    """Tensor bytes written chunk by chunk, dropping the source pages read, so a rewrite never holds a
    whole tensor; stands in for the array GGUFWriter writes (`nbytes`, `tofile`)."""

    def __init__(self, shape: tuple[int, ...], chunks: Callable[[], Iterable[np.ndarray]],
                 release: Callable[[], None] | None = None):
        self.shape = tuple(int(d) for d in shape)
        self.nbytes = int(np.prod(self.shape))
        self._chunks, self._release = chunks, release

    @classmethod
    def of(cls, raw: np.ndarray, contents: GGUFContents | None = None) -> Streamed:
        """`raw` (often a view of the source map) written in row blocks of about CHUNK_BYTES."""
        rows = raw.reshape(-1, raw.shape[-1]) if raw.ndim > 1 else raw.reshape(1, -1)
        step = max(1, CHUNK_BYTES // max(rows.shape[1], 1))
        return cls(raw.shape, lambda: (rows[i : i + step] for i in range(0, rows.shape[0], step)),
                   (lambda: drop_pages(contents)) if contents is not None else None)

    def tofile(self, fp: Any) -> None:
        written = 0
        for block in self._chunks():
            block = np.ascontiguousarray(block, dtype=np.uint8)
            block.tofile(fp)
            written += block.nbytes
            if self._release is not None:
                self._release()
        if written != self.nbytes:
            raise ValueError(f"streamed tensor wrote {written} bytes, declared {self.nbytes}")


def drop_pages(contents: GGUFContents | None) -> None:
    """Let the OS drop the source map's resident pages (they are re-read from the file if touched again)."""
    mapped = getattr(contents, "_map", None)
    if _DONTNEED is not None and isinstance(mapped, mmap.mmap):
        with contextlib.suppress(OSError, ValueError):
            mapped.madvise(_DONTNEED)


class TypedGGUF(GGUFContents):
    """twinfer's GGUF parser, also recording each key's (value type, array element type)."""

    def __init__(self, path: Path) -> None:
        self.types: dict[str, tuple[int, int | None]] = {}
        super().__init__(path)

    def _read_value(self, key: str, vtype: int, pos: int) -> int:
        sub = struct.unpack_from("<I", self._map, pos)[0] if vtype == ARRAY else None
        self.types[key] = (vtype, sub)
        return super()._read_value(key, vtype, pos)

    def value(self, key: str) -> Any:
        """A key's value as plain Python (arrays as lists)."""
        value = self.array(key) if self.types[key][0] == ARRAY else self.metadata[key]
        return value.tolist() if isinstance(value, np.ndarray) else value


def rewrite_gguf(source: Path | TypedGGUF, dest: Path, *, values: ValueEdit | None = None,
                 extra: Iterable[tuple[str, Any, int, int | None]] = (), tensors: TensorEdit | None = None) -> Path:
    """Copy `source` to `dest`, every key passed through `values`, `extra` (key, value, type, element
    type) keys added, and every tensor passed through `tensors`, in the source's order."""
    import gguf

    contents = source if isinstance(source, TypedGGUF) else TypedGGUF(source)
    arch = str(contents.metadata["general.architecture"])
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, arch)
    writer.data_alignment = int(contents.metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))

    def add(key: str, value: Any, vtype: int, sub: int | None) -> None:
        writer.add_key_value(key, value, gguf.GGUFValueType(vtype),
                             sub_type=None if sub is None else gguf.GGUFValueType(sub))

    for key, (vtype, sub) in contents.types.items():
        if key == "general.architecture":
            continue  # the writer adds it
        value = contents.value(key)
        value = values(key, value) if values is not None else value
        if value is not SKIP:
            add(key, value, vtype, sub)
    for key, value, vtype, sub in extra:
        add(key, value, vtype, sub)
    data: list[Any] = []
    for name, info in contents.tensors.items():
        item: tuple[str, Any, int] | None = (
            name, contents.tensor_bytes(info).reshape(*info.shape[:-1], -1), info.ggml_type)
        if tensors is not None:
            item = tensors(*item)  # type: ignore[misc]
        if item is None:
            continue
        out_name, raw, ggml_type = item
        if not isinstance(raw, Streamed):
            raw = Streamed.of(np.ascontiguousarray(raw), contents)
        writer.add_tensor_info(out_name, raw.shape, np.dtype(np.uint8), raw.nbytes, gguf.GGMLQuantizationType(ggml_type))
        data.append(raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for raw in data:
        writer.write_tensor_data(raw)
    writer.close()
    tmp.replace(dest)
    return dest
