"""A small reader for the key/value header of a GGUF file.

`gguf.GGUFReader` maps every tensor and builds numpy records for each of the 262,144 vocabulary strings,
which takes over ten seconds for Gemma 3; the tokenizer only needs the header, which this reads in a
fraction of a second. Layout (GGUF v2/v3): magic "GGUF", u32 version, u64 n_tensors, u64 n_kv, then
n_kv times (string key, u32 type, value); strings are u64 length + UTF-8 bytes.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, Literal

import numpy as np

from twinfer.runtime.errors import ModelError

GGUF_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# GGUF value type -> (struct code, numpy dtype)
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("B", "u1"),
    1: ("b", "i1"),
    2: ("H", "u2"),
    3: ("h", "i2"),
    4: ("I", "u4"),
    5: ("i", "i4"),
    6: ("f", "f4"),
    7: ("?", "?"),
    10: ("Q", "u8"),
    11: ("q", "i8"),
    12: ("d", "f8"),
}


def is_gguf(path: str | Path) -> bool:
    """True when `path` is a file that starts with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def read_gguf_metadata(path: str | Path, keys_prefix: tuple[str, ...] = ()) -> dict[str, Any]:
    """Return the header key/values of the GGUF file at `path`.

    Numeric arrays come back as numpy arrays, string arrays as lists of str, scalars as Python values.
    With `keys_prefix`, only keys starting with one of those prefixes are decoded (others are skipped).
    """
    p = Path(path)
    try:
        with p.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _Parser(buf, str(p)).read_all(keys_prefix)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read GGUF file {p}: {e}") from e


class _Parser:
    def __init__(self, buf: mmap.mmap, name: str) -> None:
        self.buf, self.name, self.off = buf, name, 0
        if buf[:4] != GGUF_MAGIC:
            raise ModelError(f"{name} is not a GGUF file (bad magic {bytes(buf[:4])!r})")
        (version,) = struct.unpack_from("<I", buf, 4)
        # A big-endian file shows its version byte-swapped when read little-endian.
        self.endian: Literal["<", ">"] = "<" if version < 0x10000 else ">"
        (self.version,) = struct.unpack_from(self.endian + "I", buf, 4)
        if self.version < 2:
            raise ModelError(f"{name} is GGUF v{self.version}; only v2 and later are supported: reconvert it")
        self.n_tensors, self.n_kv = struct.unpack_from(self.endian + "QQ", buf, 8)
        self.off = 24

    def read_all(self, keys_prefix: tuple[str, ...]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for _ in range(self.n_kv):
            key = self._string()
            (vtype,) = self._unpack("I")
            if keys_prefix and not key.startswith(keys_prefix):
                self._skip(vtype)
            else:
                out[key] = self._value(vtype)
        return out

    def _unpack(self, code: str) -> tuple[Any, ...]:
        fmt = self.endian + code
        vals = struct.unpack_from(fmt, self.buf, self.off)
        self.off += struct.calcsize(fmt)
        return vals

    def _string(self) -> str:
        (n,) = self._unpack("Q")
        s = self.buf[self.off : self.off + n]
        self.off += n
        return s.decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            atype, n = self._unpack("IQ")
            if atype == _STRING:
                return self._string_array(n)
            if atype in _SCALARS:
                dtype = np.dtype(_SCALARS[atype][1]).newbyteorder(self.endian)
                arr = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.off).copy()
                self.off += n * dtype.itemsize
                return arr
            return [self._value(atype) for _ in range(n)]
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype][0])[0]
        raise ModelError(f"{self.name}: unknown GGUF value type {vtype} at byte {self.off}")

    def _string_array(self, n: int) -> list[str]:
        buf, off, out = self.buf, self.off, []
        unpack = struct.Struct(self.endian + "Q").unpack_from
        for _ in range(n):
            (k,) = unpack(buf, off)
            out.append(buf[off + 8 : off + 8 + k].decode("utf-8", errors="replace"))
            off += 8 + k
        self.off = off
        return out

    def _skip(self, vtype: int) -> None:
        if vtype == _STRING:
            (n,) = self._unpack("Q")
            self.off += n
        elif vtype == _ARRAY:
            atype, n = self._unpack("IQ")
            if atype in _SCALARS:
                self.off += n * struct.calcsize(_SCALARS[atype][0])
            else:
                for _ in range(n):
                    self._skip(atype)
        elif vtype in _SCALARS:
            self.off += struct.calcsize(_SCALARS[vtype][0])
        else:
            raise ModelError(f"{self.name}: unknown GGUF value type {vtype} at byte {self.off}")
