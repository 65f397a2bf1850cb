"""safetensors files read with numpy alone (no torch), memory-mapped, bf16 included.

Layout: u64 little-endian header size N, N bytes of JSON {name: {dtype, shape, data_offsets: [b, e]},
"__metadata__": {...}}, then the data; offsets are relative to the end of the header.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from twinfer.runtime.errors import ModelError, WeightError

# safetensors dtype -> numpy dtype of the stored bytes (BF16 is read as uint16 and widened).
_DTYPES: dict[str, str] = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8"}


@dataclass(frozen=True)
class SafetensorsTensor:
    """A StoredTensor in a safetensors file."""

    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    offset: int  # absolute byte offset in the file
    data: np.memmap

    def read(self) -> np.ndarray:
        if self.dtype not in _DTYPES:
            raise WeightError(
                f"tensor {self.name!r} in {self.file} is stored as {self.dtype}; twinfer reads F32, F16 "
                "and BF16 safetensors (dequantize the checkpoint first)"
            )
        stored = np.dtype(_DTYPES[self.dtype])
        count = self.nbytes // stored.itemsize
        raw = np.frombuffer(self.data, dtype=stored, count=count, offset=self.offset)
        if self.dtype == "BF16":  # bf16 is the top half of a float32
            values = (raw.astype(np.uint32) << 16).view(np.float32)
        else:
            values = raw.astype(np.float32)  # always a copy, so the caller may modify it
        return values.reshape(self.shape)


def read_safetensors(path: Path) -> dict[str, SafetensorsTensor]:
    """The tensors of one safetensors file, by name; raises ModelError on a damaged file."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ValueError(f"header of {header_len} bytes in a {size}-byte file")
            header = json.loads(f.read(header_len))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise ModelError(f"corrupt or truncated safetensors file {path} ({e}); re-download it") from e
    data = np.memmap(path, dtype=np.uint8, mode="r") if size else None
    start = 8 + header_len
    out: dict[str, SafetensorsTensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = (int(x) for x in entry["data_offsets"])
        if start + end > size or data is None:
            raise ModelError(
                f"safetensors file {path} is truncated: tensor {name!r} ends at byte {start + end} but the "
                f"file has {size} bytes; re-download it"
            )
        shape = tuple(int(d) for d in entry["shape"])
        out[name] = SafetensorsTensor(name, path, shape, entry["dtype"], end - begin, start + begin, data)
    return out
