"""WeightSet: a model's tensors under canonical names, read from the file only when asked for.
A canonical weight is built from stored tensors by an optional named transform (`TRANSFORMS` or the
architecture's); `load_region` reads a box of a weight (a rank's rows, an expert group) alone."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from twinfer.runtime.errors import WeightError
from twinfer.runtime.spec import ModelSpec

Shape = tuple[int, ...]
Region = tuple[slice, ...]
"""A box of a tensor: one `slice(start, stop)` per leading axis (step 1); axes left out are whole."""

# Float formats stored as plain arrays: numpy dtype of the stored bytes (BF16 read as uint16 and widened).
FLOAT_STORAGE: dict[str, str] = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8"}


def widen(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Stored float values (`FLOAT_STORAGE[dtype]`, often a view of the file) as a fresh float32 array."""
    if dtype == "BF16":  # bf16 is the top half of a float32
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)  # always a copy, so the caller may modify it


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

    def read_region(self, region: Region) -> np.ndarray:
        """`read()[region]` as a fresh float32 array, reading only the region's bytes where it can."""
        ...


Finish = Callable[[list[np.ndarray]], np.ndarray]
# A box of the canonical weight read from the sources: (which sources, the box of each, how to combine).
Narrowed = tuple[list[int], Region, Finish]
Narrow = Callable[[Region, list[Shape], ModelSpec], Narrowed | None]


@dataclass(frozen=True)
class Transform:
    """How stored tensors become one canonical weight. `narrow` maps a box of the result to boxes of the
    sources (None where it cannot; None as the field: read whole, then cut)."""

    apply: Callable[[list[np.ndarray], ModelSpec], np.ndarray]
    shape: Callable[[list[Shape], ModelSpec], Shape]
    many: bool = False  # takes one source per expert ({e} in the rule)
    narrow: Narrow | None = None
    split: int = 1  # the weight is 1/split of its source (a half of a fused tensor): its share of the bytes
    parts: tuple[str, ...] = ()  # takes one source per named part ({part} in the rule), in this order


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # Inverse of llama.cpp's convert_hf_to_gguf.permute: interleaved rope rows back to HF's half-split
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute_transform(heads: Callable[[ModelSpec], int]) -> Transform:
    def narrow(box: Region, s: list[Shape], spec: ModelSpec) -> Narrowed | None:
        per_head = s[0][0] // heads(spec)
        rows = box[0]
        if rows.start % per_head or rows.stop % per_head:
            return None  # the permutation is within a head: only whole heads un-permute on their own
        n = (rows.stop - rows.start) // per_head
        return [0], box, lambda a: _unpermute(a[0], n)

    return Transform(lambda a, spec: _unpermute(a[0], heads(spec)), _same, narrow=narrow)


def _half(part: int) -> Transform:
    def apply(a: list[np.ndarray], spec: ModelSpec) -> np.ndarray:
        fused = a[0]  # [E, 2I, C]: gate rows then up rows
        half = fused.shape[1] // 2
        return fused[:, part * half : (part + 1) * half]

    def shape(s: list[Shape], spec: ModelSpec) -> Shape:
        return (s[0][0], s[0][1] // 2, *s[0][2:])

    def narrow(box: Region, s: list[Shape], spec: ModelSpec) -> Narrowed:
        first = part * (s[0][1] // 2)
        rows = slice(box[1].start + first, box[1].stop + first)
        return [0], (box[0], rows, *box[2:]), lambda a: a[0]

    return Transform(apply, shape, narrow=narrow, split=2)


def _stack_narrow(box: Region, s: list[Shape], spec: ModelSpec) -> Narrowed | None:
    experts = list(range(box[0].start, box[0].stop))
    return (experts, box[1:], np.stack) if experts else None  # only the chosen experts' tensors are read


def _same(s: list[Shape], spec: ModelSpec) -> Shape:
    return s[0]


def elementwise(fn: Callable[[np.ndarray], np.ndarray]) -> Transform:
    """A transform that maps each value on its own (a norm offset): any box of it reads the same box."""
    return Transform(lambda a, spec: fn(a[0]), _same, narrow=lambda box, s, spec: ([0], box, lambda a: fn(a[0])))


# The generic transforms any name table may use; an architecture adds its own in `NameTable.transforms`.
TRANSFORMS: dict[str, Transform] = {
    "unpermute_q": _unpermute_transform(lambda spec: spec.num_heads),
    "unpermute_k": _unpermute_transform(lambda spec: spec.num_kv_heads),
    "stack_experts": Transform(lambda a, spec: np.stack(a), lambda s, spec: (len(s), *s[0]), many=True,
                               narrow=_stack_narrow),
    "gate_half": _half(0),
    "up_half": _half(1),
}


@dataclass(frozen=True)
class WeightEntry:
    """How to build one canonical weight: its stored sources and the named transform (`impl` defaults to
    the `TRANSFORMS` entry)."""

    sources: tuple[StoredTensor, ...]
    transform: str | None = None
    impl: Transform | None = None

    def __post_init__(self) -> None:
        if self.transform is not None and self.impl is None:
            if self.transform not in TRANSFORMS:
                raise WeightError(f"unknown weight transform {self.transform!r}")
            object.__setattr__(self, "impl", TRANSFORMS[self.transform])

    def shape(self, spec: ModelSpec) -> Shape:
        if self.impl is None:
            return self.sources[0].shape
        return self.impl.shape([s.shape for s in self.sources], spec)


class WeightSet(Mapping[str, np.ndarray]):
    """A lazy mapping from canonical weight names to float32 arrays: nothing is read until `load`; a fused
    tensor counts half its bytes to each weight split from it, so `nbytes_stored` sums to the file."""

    def __init__(self, spec: ModelSpec, entries: Mapping[str, WeightEntry]) -> None:
        self.spec = spec
        self._entries = dict(entries)

    def names(self) -> list[str]:
        return list(self._entries)

    def load(self, name: str) -> np.ndarray:
        """Read, dequantize and transform `name`; returns a C-contiguous float32 array."""
        entry = self._entry(name)
        arrays = [s.read() for s in entry.sources]
        out = arrays[0] if entry.impl is None else entry.impl.apply(arrays, self.spec)
        return np.ascontiguousarray(out, dtype=np.float32)

    def load_region(self, name: str, region: Region) -> np.ndarray:
        """`load(name)[region]`, reading only the region's bytes where format and transform allow, else
        the whole weight, cut. C-contiguous float32."""
        entry = self._entry(name)
        shape = entry.shape(self.spec)
        box = full_region(region, shape, name)
        if entry.impl is None:
            plan: Narrowed | None = [0], box, lambda a: a[0]
        else:
            narrow = entry.impl.narrow
            plan = None if narrow is None else narrow(box, [s.shape for s in entry.sources], self.spec)
        if plan is None:
            return np.ascontiguousarray(self.load(name)[box])
        picked, sub, finish = plan
        out = finish([entry.sources[i].read_region(sub) for i in picked])
        return np.ascontiguousarray(out, dtype=np.float32)

    def shape(self, name: str) -> Shape:
        return self._entry(name).shape(self.spec)

    def nbytes_stored(self, name: str) -> int:
        entry = self._entry(name)
        total = sum(s.nbytes for s in entry.sources)
        return total // (1 if entry.impl is None else entry.impl.split)

    def dtype_stored(self, name: str) -> str:
        dtypes = {s.dtype for s in self._entry(name).sources}
        return dtypes.pop() if len(dtypes) == 1 else "+".join(sorted(dtypes))

    def sources(self, name: str) -> Sequence[StoredTensor]:
        """The stored tensors `name` is built from (for quantized backends that read raw blocks)."""
        return self._entry(name).sources

    def transform(self, name: str) -> str | None:
        return self._entry(name).transform

    def transform_impl(self, name: str) -> Transform | None:
        """The transform `name` is built with (for readers that apply it to a slice of the sources)."""
        return self._entry(name).impl

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


def full_region(region: Region, shape: Shape, name: str = "tensor") -> Region:
    """`region` with one `slice(start, stop)` per axis of `shape` (whole axes filled in, bounds concrete)."""
    if len(region) > len(shape) or any(r.step not in (None, 1) for r in region):
        raise ValueError(f"region {region} of {name!r} {shape}: at most one step-1 slice per axis")
    out = []
    for i, n in enumerate(shape):
        start, stop, _ = region[i].indices(n) if i < len(region) else (0, n, 1)
        out.append(slice(start, max(start, stop)))
    return tuple(out)
