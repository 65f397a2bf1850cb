"""A minimal GGUF parser: header, key/values and tensor table, with the tensor data memory-mapped.
Large arrays (a 262k-entry vocabulary) are only located and read on demand (`GGUFContents.array`), so
opening a file takes milliseconds where `gguf.GGUFReader` takes seconds. Layout: llama.cpp's gguf.md."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from twinfer.runtime.errors import ModelError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
LARGE_ARRAY = 1024  # arrays with more elements than this stay out of the metadata dict

# GGUF value types -> (struct format, numpy dtype) for the fixed-size ones.
_SCALAR: dict[int, tuple[str, str]] = {
    0: ("B", "<u1"),
    1: ("b", "<i1"),
    2: ("H", "<u2"),
    3: ("h", "<i2"),
    4: ("I", "<u4"),
    5: ("i", "<i4"),
    6: ("f", "<f4"),
    7: ("?", "<u1"),
    10: ("Q", "<u8"),
    11: ("q", "<i8"),
    12: ("d", "<f8"),
}
_STRING, _ARRAY, _BOOL = 8, 9, 7


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in the GGUF tensor table. `ne` is GGUF order (fastest dimension first)."""

    name: str
    ne: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical numpy shape: reversed `ne`, so a matrix is [out, in] like torch's Linear."""
        return tuple(reversed(self.ne))


@dataclass(frozen=True)
class _LazyArray:
    elem_type: int
    count: int
    offset: int  # of the first element


class GGUFContents:
    """A parsed GGUF file: `metadata` (small values), `tensors` (by name) and the mapped bytes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with path.open("rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:  # ValueError: mmap of an empty file
            raise ModelError(f"cannot read GGUF file {path}: {e}; check that the file is complete") from e
        self.metadata: dict[str, Any] = {}
        self.array_lengths: dict[str, int] = {}  # large arrays left out of metadata
        self._arrays: dict[str, _LazyArray] = {}
        self.tensors: dict[str, TensorInfo] = {}
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError, OverflowError, ValueError) as e:
            raise ModelError(
                f"corrupt or truncated GGUF file {path} ({type(e).__name__}: {e}); re-download or re-convert it"
            ) from e

    def array(self, key: str) -> list[Any] | np.ndarray:
        """A metadata array by key, including the large ones (e.g. `tokenizer.ggml.tokens`).
        Numeric arrays come back as numpy arrays, string arrays as a list of str."""
        if key in self.metadata:
            value = self.metadata[key]
            if not isinstance(value, list | np.ndarray):
                raise KeyError(f"GGUF key {key!r} is not an array")
            return value
        if key not in self._arrays:
            raise KeyError(key)
        lazy = self._arrays[key]
        value, _ = self._read_array_body(lazy.elem_type, lazy.count, lazy.offset)
        return value

    def tensor_bytes(self, info: TensorInfo) -> np.ndarray:
        """The tensor's stored bytes as a read-only uint8 view of the mapping (no copy)."""
        return np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def _parse(self) -> None:
        buf = self._map
        if buf[:4] != GGUF_MAGIC:
            raise ModelError(
                f"{self.path} is not a GGUF file (starts with {bytes(buf[:4])!r}, expected b'GGUF')"
            )
        (version,) = struct.unpack_from("<I", buf, 4)
        if version & 0xFFFF == 0 and version:
            raise ModelError(f"{self.path} is a big-endian GGUF file; twinfer reads little-endian GGUF only")
        if version < 2:
            raise ModelError(f"{self.path} is GGUF version {version}; re-convert it with a recent llama.cpp")
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        pos = 24
        for _ in range(n_kv):
            key, pos = self._read_string(pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            pos = self._read_value(key, vtype, pos + 4)
        infos = []
        for _ in range(n_tensors):
            name, pos = self._read_string(pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            ne = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, tuple(int(n) for n in ne), int(ggml_type), int(offset)))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = (pos + alignment - 1) // alignment * alignment
        for name, ne, ggml_type, offset in infos:
            info = TensorInfo(name, ne, ggml_type, data_start + offset, _tensor_nbytes(name, ne, ggml_type))
            if info.offset + info.nbytes > len(buf):
                raise ModelError(
                    f"GGUF file {self.path} is truncated: tensor {name!r} ends at byte "
                    f"{info.offset + info.nbytes} but the file has {len(buf)} bytes; re-download it"
                )
            self.tensors[name] = info

    def _read_string(self, pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._map, pos)
        end = pos + 8 + n
        if end > len(self._map):
            raise IndexError(f"string of {n} bytes at offset {pos} runs past the end of the file")
        return self._map[pos + 8 : end].decode("utf-8"), end

    def _read_value(self, key: str, vtype: int, pos: int) -> int:
        """Store key's value in metadata (or record a large array) and return the next position."""
        if vtype == _ARRAY:
            elem_type, count = struct.unpack_from("<IQ", self._map, pos)
            pos += 12
            if count > LARGE_ARRAY:
                self._arrays[key] = _LazyArray(elem_type, count, pos)
                self.array_lengths[key] = count
                return self._skip_array_body(elem_type, count, pos)
            self.metadata[key], pos = self._read_array_body(elem_type, count, pos)
            return pos
        value, pos = self._read_scalar(vtype, pos)
        self.metadata[key] = value
        return pos

    def _read_scalar(self, vtype: int, pos: int) -> tuple[Any, int]:
        if vtype == _STRING:
            return self._read_string(pos)
        if vtype not in _SCALAR:
            raise ValueError(f"unknown GGUF value type {vtype} at offset {pos}")
        fmt = _SCALAR[vtype][0]
        (value,) = struct.unpack_from("<" + fmt, self._map, pos)
        return value, pos + struct.calcsize(fmt)

    def _read_array_body(self, elem_type: int, count: int, pos: int) -> tuple[Any, int]:
        if elem_type == _STRING:
            items = []
            for _ in range(count):
                item, pos = self._read_string(pos)
                items.append(item)
            return items, pos
        if elem_type not in _SCALAR:
            raise ValueError(f"unsupported GGUF array element type {elem_type} at offset {pos}")
        dtype = np.dtype(_SCALAR[elem_type][1])
        arr = np.frombuffer(self._map, dtype=dtype, count=count, offset=pos)
        if elem_type == _BOOL:
            arr = arr.astype(bool)
        # Small arrays become lists so metadata is plain Python; large ones stay numpy.
        value: Any = arr.tolist() if count <= LARGE_ARRAY else arr.copy()
        return value, pos + count * dtype.itemsize

    def _skip_array_body(self, elem_type: int, count: int, pos: int) -> int:
        if elem_type == _STRING:
            unpack, buf = struct.Struct("<Q").unpack_from, self._map
            for _ in range(count):
                pos += 8 + unpack(buf, pos)[0]
            if pos > len(buf):
                raise IndexError("string array runs past the end of the file")
            return pos
        if elem_type not in _SCALAR:
            raise ValueError(f"unsupported GGUF array element type {elem_type} at offset {pos}")
        return pos + count * np.dtype(_SCALAR[elem_type][1]).itemsize


def _tensor_nbytes(name: str, ne: tuple[int, ...], ggml_type: int) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType(ggml_type)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError) as e:
        raise ModelError(f"tensor {name!r} has unknown GGML type {ggml_type}; update the gguf package") from e
    if ne and ne[0] % block_size:
        raise ModelError(
            f"tensor {name!r}: row of {ne[0]} elements is not a multiple of the {qtype.name} block size {block_size}"
        )
    n = 1
    for d in ne:
        n *= d
    return n // block_size * type_size


def ggml_type_name(ggml_type: int) -> str:
    from gguf.constants import GGMLQuantizationType

    return GGMLQuantizationType(ggml_type).name
