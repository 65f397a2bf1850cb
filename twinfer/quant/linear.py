"""Quantized linear weights: one container for every registry format, and its flat tensor layout.
A `QuantizedWeight` is what a quantized model hands `Ops.weight`: format name, logical [out, in] shape
and the format's packed object. Backends choose a run-time path by `fmt` and fall back to
`dequantize`; `to_tensors`/`from_tensors` round-trip it bit for bit."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from twinfer.formats import fp8, mxfp4, nvfp4
from twinfer.quant import affine
from twinfer.quant.registry import FORMAT_INFO, FORMATS, pack_weight
from twinfer.quant.turboquant import TQCodes, TQTensor, TurboQuant
from twinfer.quant.turboquant_weight import TQWeight
from twinfer.runtime.loaders.published import PUBLISHED
from twinfer.runtime.loaders.quantized import QUANT_METHOD, register_decoder

FLOAT_FORMATS = ("f32", "f16", "bf16")  # tensors a quantized folder keeps unquantized
_PACKED_TYPES: dict[str, type] = {
    "int8": affine.AffineTensor,
    "int4": affine.AffineTensor,
    "fp8": fp8.FP8Tensor,
    "fp8-block": fp8.FP8BlockTensor,
    "nvfp4": nvfp4.NVFP4Tensor,
    "mxfp4": mxfp4.MXFP4Tensor,
}


def check_format(fmt: str) -> str:
    """``fmt`` if it is a registry weight format, else a ValueError listing them."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return fmt


def weight_block(fmt: str) -> int:
    """The input-channel multiple a format needs (0: none)."""
    if fmt in ("int8", "int4"):
        return 64
    if fmt == "nvfp4":
        return 16
    if fmt == "mxfp4":
        return 32
    return 0


def supports(fmt: str, shape: tuple[int, ...]) -> bool:
    """Whether a 2-D weight of ``shape`` can be stored in ``fmt``."""
    if fmt not in FORMATS or len(shape) != 2:
        return False
    block = weight_block(fmt)
    if block and shape[1] % block:
        return False
    if fmt.startswith("tq"):
        from twinfer.quant.turboquant import split_rate
        from twinfer.quant.turboquant_weight import default_block

        try:
            split_rate(float(fmt[2:]), default_block(shape[1]))
        except ValueError:
            return False
    return True


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight ``[out, in]`` stored in registry format ``fmt`` (see the module docstring)."""

    fmt: str
    shape: tuple[int, int]
    packed: Any

    @classmethod
    def quantize(cls, fmt: str, w: np.ndarray, seed: int = 0) -> QuantizedWeight:
        """Pack float32 ``w [out, in]`` in ``fmt`` (affine groups of 64, TurboQuant blocks of <= 128)."""
        w = np.asarray(w, dtype=np.float32)
        check_format(fmt)
        if not supports(fmt, w.shape):
            raise ValueError(f"format {fmt} cannot store a weight of shape {w.shape}")
        return cls(fmt, (int(w.shape[0]), int(w.shape[1])), pack_weight(fmt, w, seed=seed))

    @property
    def nbytes(self) -> int:
        return int(self.packed.nbytes)

    @property
    def bits_per_weight(self) -> float:
        """The format's nominal storage cost (codes plus amortized scales and norms)."""
        return FORMAT_INFO[self.fmt].bits_per_weight

    def dequantize(self) -> np.ndarray:
        """Float32 ``[out, in]``."""
        return np.asarray(self.packed.unpack(), dtype=np.float32).reshape(self.shape)

    def to_tensors(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Named arrays (suffixes, e.g. ``"wq"``) and JSON-able metadata that rebuild this weight."""
        meta: dict[str, Any] = {"format": self.fmt, "shape": list(self.shape)}
        if isinstance(self.packed, TQWeight):
            return _tq_tensors(self.packed, meta)
        arrays: dict[str, np.ndarray] = {}
        for f in dataclasses.fields(self.packed):
            value = getattr(self.packed, f.name)
            if isinstance(value, np.ndarray):
                arrays[f.name] = value
            else:
                meta[f.name] = value.item() if isinstance(value, np.generic) else value
        return arrays, meta

    @classmethod
    def from_tensors(cls, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> QuantizedWeight:
        fmt = check_format(str(meta["format"]))
        shape = (int(meta["shape"][0]), int(meta["shape"][1]))
        if fmt.startswith("tq"):
            return cls(fmt, shape, _tq_from(meta, arrays, shape))
        kind = _PACKED_TYPES[fmt]
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(kind):
            if f.name in arrays:
                kwargs[f.name] = arrays[f.name]
            elif f.name in meta:
                kwargs[f.name] = np.float32(meta[f.name]) if isinstance(meta[f.name], float) else meta[f.name]
            else:
                raise ValueError(f"{fmt} weight is missing its {f.name!r} field")
        return cls(fmt, shape, kind(**kwargs))


def _tq_tensors(qw: TQWeight, meta: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    tq = qw.quantizer
    arrays: dict[str, np.ndarray] = {}
    for i, part in enumerate(qw.q.parts):
        arrays[f"codes{i}"] = part.codes
        arrays[f"norms{i}"] = part.norms
    if tq.outliers is not None:
        arrays["outliers"] = tq.outliers.astype(np.int32)
    seed = tq.quantizers[0].rotation.seed
    meta.update(block=qw.block, rate=tq.rate, seed=seed, rounds=tq.quantizers[0].rotation.rounds)
    return arrays, meta


def _tq_from(meta: dict[str, Any], arrays: dict[str, np.ndarray], shape: tuple[int, int]) -> TQWeight:
    block, rate = int(meta["block"]), float(meta["rate"])
    outliers = arrays.get("outliers")
    tq = TurboQuant(block, rate, int(meta["seed"]), outliers, int(meta.get("rounds", 3)))
    out, inp = shape
    parts = tuple(
        TQCodes(arrays[f"codes{i}"], arrays[f"norms{i}"], q.dim, q.bits) for i, q in enumerate(tq.quantizers)
    )
    return TQWeight(TQTensor(parts, (out, inp // block, block)), tq, shape, block)


@dataclass(frozen=True)
class TQLinearParts:
    """A TurboQuant weight laid out for a backend's rotate-then-lookup matmul, per channel set s:
    `channels`, `rotation`, `codes` [out, G, D_s], `scales` (norm / sqrt(D_s)) and `centroids`;
    y = sum_s (x_s R_s^T) . (centroids[codes] * scale)."""

    shape: tuple[int, int]
    block: int
    channels: tuple[np.ndarray, ...]
    rotation: tuple[np.ndarray, ...]
    codes: tuple[np.ndarray, ...]
    scales: tuple[np.ndarray, ...]
    centroids: tuple[np.ndarray, ...]


def tq_linear_parts(qw: TQWeight) -> TQLinearParts:
    """Unpack a :class:`TQWeight` into the arrays a backend's TurboQuant linear consumes."""
    tq = qw.quantizer
    out, inp = qw.shape
    G = inp // qw.block
    if tq.outliers is None or tq.rest is None:
        sets = [np.broadcast_to(np.arange(qw.block), (G, qw.block))]
    else:
        sets = [np.broadcast_to(tq.outliers, (G, tq.outliers.shape[1])),
                np.broadcast_to(tq.rest, (G, tq.rest.shape[1]))]  # fmt: skip
    channels, rotation, codes, scales, centroids = [], [], [], [], []
    for idx, q, part in zip(sets, tq.quantizers, qw.q.parts, strict=True):
        D = q.padded_dim
        channels.append(np.ascontiguousarray(idx, dtype=np.int64))
        rotation.append(q.rotation.matrix())  # [D, d]
        codes.append(q.codes(part).reshape(out, G, D))
        scales.append((part.norms.astype(np.float32) / np.float32(np.sqrt(D))).reshape(out, G))
        centroids.append(q.codebook.centroids.astype(np.float32))
    return TQLinearParts(qw.shape, qw.block, *map(tuple, (channels, rotation, codes, scales, centroids)))


@dataclass(frozen=True)
class QuantizedExperts:
    """A stacked expert weight ``[E, out, in]`` kept in one format: one :class:`QuantizedWeight` per expert
    (a published checkpoint's per-expert linears, or gpt-oss's MXFP4 ``*_blocks`` split by expert)."""

    fmt: str
    experts: tuple[QuantizedWeight, ...]

    @property
    def shape(self) -> tuple[int, int, int]:
        return (len(self.experts), *self.experts[0].shape)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.experts)

    def dequantize(self) -> np.ndarray:
        """Float32 ``[E, out, in]``."""
        return np.stack([e.dequantize() for e in self.experts])


def from_published(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> QuantizedWeight | QuantizedExperts:
    """A published layout's packed parts (`runtime/loaders/published.py`, twinfer's field names) as weights."""
    fmt, shape = str(meta["format"]), [int(x) for x in meta["shape"]]
    if len(shape) == 2:
        return QuantizedWeight.from_tensors(meta, arrays)
    if fmt == "mxfp4":  # gpt-oss experts: blocks [E, out, G, 16], scales [E, out, G]
        blocks, scales = arrays["blocks"], arrays["scales"]
        return QuantizedExperts(fmt, tuple(
            QuantizedWeight(fmt, (shape[1], shape[2]), mxfp4.MXFP4Tensor(blocks[e], scales[e]))
            for e in range(shape[0])))
    each = meta["experts"]
    return QuantizedExperts(fmt, tuple(
        QuantizedWeight.from_tensors(each[e], {k.split(".", 1)[1]: v for k, v in arrays.items()
                                               if k.split(".", 1)[0] == str(e)})
        for e in range(shape[0])))


# Quantized folders are read by the runtime's loader, which cannot import this layer: hand it the decoders.
register_decoder(QUANT_METHOD, QuantizedWeight.from_tensors)
register_decoder(PUBLISHED, from_published)
