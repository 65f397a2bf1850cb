"""WeightSet: a model's tensors under canonical names, read from the file only when asked for.

A `StoredTensor` is one tensor as the file holds it (GGUF block-quantized bytes or a safetensors
array). A canonical weight is built from one or more stored tensors by an optional named transform
(`TRANSFORMS`): a norm shift, un-permuting llama.cpp's rope layout, stacking or splitting experts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from twinfer.runtime.errors import WeightError
from twinfer.runtime.spec import ModelSpec

Shape = tuple[int, ...]


class StoredTensor(Protocol):
    """One tensor in a model file. `shape` is logical ([out, in] for a matrix); `read` dequantizes."""

    @property
    def name(self) -> str: ...

    @property
    def file(self) -> Path: ...

    @property
    def shape(self) -> Shape: ...

    @property
    def dtype(self) -> str:
        """As stored: "F32", "BF16", "Q4_K", ..."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes in the file."""
        ...

    def read(self) -> np.ndarray:
        """The values as a float32 array of `shape` (a fresh array the caller may modify)."""
        ...


# -- transforms ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Transform:
    """How stored tensors become one canonical weight. `apply` and `shape` see the sources in order."""

    apply: Callable[[list[np.ndarray], ModelSpec], np.ndarray]
    shape: Callable[[list[Shape], ModelSpec], Shape]
    many: bool = False  # takes one source per expert ({e} in the rule)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # Inverse of llama.cpp convert_hf_to_gguf.permute: rows of each head go from interleaved
    # (x0, x_half, x1, x_half+1, ...) back to HF's half-split rope layout.
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _half(part: int) -> Transform:
    def apply(a: list[np.ndarray], spec: ModelSpec) -> np.ndarray:
        fused = a[0]  # [E, 2I, C]: gate rows then up rows
        half = fused.shape[1] // 2
        return fused[:, part * half : (part + 1) * half]

    def shape(s: list[Shape], spec: ModelSpec) -> Shape:
        return (s[0][0], s[0][1] // 2, *s[0][2:])

    return Transform(apply, shape)


def _same(s: list[Shape], spec: ModelSpec) -> Shape:
    return s[0]


TRANSFORMS: dict[str, Transform] = {
    # Gemma's RMSNorm computes x * (1 + w) in HF checkpoints; canonical norms hold the multiplier.
    "norm_plus_one": Transform(lambda a, spec: a[0] + np.float32(1.0), _same),
    "unpermute_q": Transform(lambda a, spec: _unpermute(a[0], spec.num_heads), _same),
    "unpermute_k": Transform(lambda a, spec: _unpermute(a[0], spec.num_kv_heads), _same),
    "stack_experts": Transform(lambda a, spec: np.stack(a), lambda s, spec: (len(s), *s[0]), many=True),
    "gate_half": _half(0),
    "up_half": _half(1),
}


@dataclass(frozen=True)
class WeightEntry:
    """How to build one canonical weight: its stored sources and the transform applied to them."""

    sources: tuple[StoredTensor, ...]
    transform: str | None = None

    def shape(self, spec: ModelSpec) -> Shape:
        if self.transform is None:
            return self.sources[0].shape
        return TRANSFORMS[self.transform].shape([s.shape for s in self.sources], spec)


class WeightSet(Mapping[str, np.ndarray]):
    """A lazy mapping from canonical weight names to float32 arrays.

    Nothing is read until `load` (or `[]`); the file stays memory-mapped. Shapes and stored sizes are
    known without reading. A fused gate/up tensor counts half of its bytes to each of the two
    canonical weights split from it, so `nbytes_stored` sums to the file's size.
    """

    def __init__(self, spec: ModelSpec, entries: Mapping[str, WeightEntry]) -> None:
        self.spec = spec
        self._entries = dict(entries)

    def names(self) -> list[str]:
        return list(self._entries)

    def load(self, name: str) -> np.ndarray:
        """Read, dequantize and transform `name`; returns a C-contiguous float32 array."""
        entry = self._entry(name)
        arrays = [s.read() for s in entry.sources]
        out = arrays[0] if entry.transform is None else TRANSFORMS[entry.transform].apply(arrays, self.spec)
        return np.ascontiguousarray(out, dtype=np.float32)

    def shape(self, name: str) -> Shape:
        return self._entry(name).shape(self.spec)

    def nbytes_stored(self, name: str) -> int:
        entry = self._entry(name)
        total = sum(s.nbytes for s in entry.sources)
        return total // 2 if entry.transform in ("gate_half", "up_half") else total

    def dtype_stored(self, name: str) -> str:
        dtypes = {s.dtype for s in self._entry(name).sources}
        return dtypes.pop() if len(dtypes) == 1 else "+".join(sorted(dtypes))

    def sources(self, name: str) -> Sequence[StoredTensor]:
        """The stored tensors `name` is built from (for quantized backends that read raw blocks)."""
        return self._entry(name).sources

    def transform(self, name: str) -> str | None:
        return self._entry(name).transform

    def _entry(self, name: str) -> WeightEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise WeightError(f"no weight named {name!r} in this model") from None

    # Mapping protocol
    def __getitem__(self, name: str) -> np.ndarray:
        return self.load(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __repr__(self) -> str:
        return f"WeightSet({len(self._entries)} weights of {self.spec.model_type})"
