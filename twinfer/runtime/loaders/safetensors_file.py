"""safetensors files read with numpy alone (no torch), memory-mapped, bf16 included."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from twinfer.runtime.errors import ModelError, WeightError
from twinfer.runtime.loaders.weights import FLOAT_STORAGE, Region, widen

# Integer tensors of packed formats (MXFP4 blocks and E8M0 scales): read as their values in float32.
INT_STORAGE: dict[str, str] = {"U8": "u1", "I8": "i1"}


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
        if self.dtype in INT_STORAGE:
            return self._ints().astype(np.float32)
        return widen(self.stored(), self.dtype)

    def read_region(self, region: Region) -> np.ndarray:
        """Only the region's elements are copied out of the mapping (what `safe_open(...).get_slice` does;
        its numpy framework cannot read BF16, so the mapping is sliced here)."""
        if self.dtype in INT_STORAGE:
            return self._ints()[region].astype(np.float32)
        return widen(self.stored()[region], self.dtype)

    def _ints(self) -> np.ndarray:
        dt = np.dtype(INT_STORAGE[self.dtype])
        return np.frombuffer(self.data, dtype=dt, count=self.nbytes // dt.itemsize, offset=self.offset).reshape(self.shape)

    def stored(self) -> np.ndarray:
        """The stored values as a read-only view of the file mapping (BF16 as uint16), shaped."""
        if self.dtype not in FLOAT_STORAGE:
            raise WeightError(
                f"tensor {self.name!r} in {self.file} is stored as {self.dtype}; twinfer reads F32, F16 "
                "and BF16 safetensors (dequantize the checkpoint first)"
            )
        stored = np.dtype(FLOAT_STORAGE[self.dtype])
        count = self.nbytes // stored.itemsize
        return np.frombuffer(self.data, dtype=stored, count=count, offset=self.offset).reshape(self.shape)


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
