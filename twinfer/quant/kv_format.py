"""KV-cache formats the torch and MLX backends run: TurboQuant per head, optionally QJL keys.
`tq<rate>`: keys and values by TurboQuant-MSE at `rate` bits (fractional rates pick outlier channels
from a layer's first block); `tq<bits>-qjl`: keys by TurboQuant-prod; `tq<rate>c`: each head's mean key
and value subtracted first (docs/quantization.md, "Layouts")."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from twinfer.formats.bitpack import packed_width
from twinfer.quant.hadamard import next_pow2
from twinfer.quant.qjl import TurboQuantProd
from twinfer.quant.turboquant import TurboQuantMSE, split_rate

FULL_PRECISION = ("", "none", "f32", "f16", "bf16", "fp32", "float")


@dataclass(frozen=True)
class KVFormat:
    """A parsed KV-cache format (see the module docstring)."""

    rate: float
    qjl: bool = False
    seed: int = 0
    centered: bool = False

    def __post_init__(self) -> None:
        if self.qjl and self.centered:
            raise ValueError("QJL keys are not mean-centered; use tqN-qjl or tqNc")
        if self.qjl and (self.rate != int(self.rate) or self.rate < 2):
            raise ValueError(f"QJL keys need an integer rate of at least 2 bits, got {self.rate:g}")
        if not 1 <= self.rate <= 8:
            raise ValueError(f"KV rate must be between 1 and 8 bits, got {self.rate:g}")

    @property
    def name(self) -> str:
        return f"tq{self.rate:g}" + ("c" if self.centered else "") + ("-qjl" if self.qjl else "")

    def check_head_dim(self, head_dim: int) -> None:
        split_rate(self.rate, head_dim)  # raises when the rate does not split this head size

    def bits_per_element(self, head_dim: int) -> float:
        """Stored bits per cached element (keys and values averaged) as the backends' caches hold them:
        each channel set's codes bit-packed over its rotated width (formats/bitpack.py) plus a float16 norm;
        QJL keys add a bit per channel and a float16 residual norm."""
        low, n_hi = split_rate(self.rate, head_dim)
        sets = [(n_hi, low + 1), (head_dim - n_hi, low)] if n_hi else [(head_dim, low)]
        value_bytes = sum(packed_width(next_pow2(d), b) + 2 for d, b in sets)
        if not self.qjl:
            return value_bytes * 8 / head_dim
        key_bytes = packed_width(next_pow2(head_dim), int(self.rate) - 1) + 2 + packed_width(head_dim, 1) + 2
        return (key_bytes + value_bytes) * 4 / head_dim  # bytes * 8 / head_dim, averaged over K and V


def parse_kv_format(text: str | None) -> KVFormat | None:
    """``"tq4"``, ``"tq2.5"``, ``"tq3-qjl"`` -> KVFormat; ``None``/``"f32"``/``"none"`` -> None."""
    if text is None or text.strip().lower() in FULL_PRECISION:
        return None
    t = text.strip().lower()
    qjl = t.endswith("-qjl")
    body = t[: -len("-qjl")] if qjl else t
    centered = body.endswith("c")
    body = body[:-1] if centered else body
    if not body.startswith("tq"):
        raise ValueError(f"unknown KV format {text!r}: use tq2, tq2.5, tq3, tq3.5, tq4 (or tqN-qjl), or f32")
    try:
        rate = float(body[2:])
    except ValueError:
        raise ValueError(f"unknown KV format {text!r}: the rate after 'tq' must be a number") from None
    if not math.isfinite(rate):
        raise ValueError(f"unknown KV format {text!r}")
    return KVFormat(rate, qjl, centered=centered)


@dataclass(frozen=True)
class ChannelSet:
    """One TurboQuant-MSE channel set of a head: `dim` channels coded at `bits` after `rotation` [D, dim];
    `centroids` and `boundaries` in standard-deviation units; `outlier` marks the outlier set."""

    dim: int
    bits: int
    rotation: np.ndarray
    centroids: np.ndarray
    boundaries: np.ndarray
    outlier: bool

    @property
    def padded_dim(self) -> int:
        return int(self.rotation.shape[0])


def mse_sets(rate: float, head_dim: int, seed: int) -> tuple[ChannelSet, ...]:
    """The channel sets of TurboQuant at ``rate`` on ``head_dim`` (seeds as ``quant.turboquant``)."""
    low, n_hi = split_rate(rate, head_dim)
    if not n_hi:
        return (_channel_set(head_dim, low, seed, False),)
    return (_channel_set(n_hi, low + 1, seed, True), _channel_set(head_dim - n_hi, low, seed + 1, False))


def _channel_set(dim: int, bits: int, seed: int, outlier: bool) -> ChannelSet:
    q = TurboQuantMSE(dim, bits, seed)
    cb = q.codebook
    return ChannelSet(dim, bits, q.rotation.matrix(), cb.centroids.astype(np.float32),
                      cb.boundaries.astype(np.float32), outlier)


def qjl_sketch(head_dim: int, bits: int, seed: int) -> np.ndarray:
    """The QJL matrix ``S`` float32 ``[head_dim, head_dim]`` of ``TurboQuantProd(head_dim, bits, seed)``."""
    return TurboQuantProd(head_dim, bits, seed).sketch
