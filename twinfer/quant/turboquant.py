"""TurboQuant (Zandieh, Daliri, Hadian, Mirrokni, arXiv 2504.19874): rotate, then scalar-quantize.
Each vector is its norm plus, per rotated coordinate, a Lloyd-Max code; fractional rates split channels
into an outlier set at `floor(rate) + 1` bits and the rest at `floor(rate)`. Per channel set: `codes`
uint8 [n, D * bits / 8] (little-endian), `norms` float16 [n]; decode `R^T (centroids[codes] * norm /
sqrt(D))` (docs/quantization.md, "Layouts")."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from twinfer.formats.bitpack import pack_bits, unpack_bits
from twinfer.quant.hadamard import HadamardRotation
from twinfer.quant.lloyd_max import Codebook, lloyd_max

FP16_MAX = 65504.0


def paper_mse_bound(bits: int) -> float:
    """The paper's upper bound on D_mse for a unit vector: ``sqrt(3) * pi / 2 * 4**-bits``."""
    return math.sqrt(3) * math.pi / 2 * 4.0**-bits


@dataclass(frozen=True)
class TQCodes:
    """TurboQuant-MSE codes for ``n`` vectors of one channel set (see the module docstring)."""

    codes: np.ndarray  # uint8 [n, D * bits / 8]
    norms: np.ndarray  # float16 [n]
    dim: int
    bits: int

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes + self.norms.nbytes)


class TurboQuantMSE:
    """TurboQuant-MSE at an integer bit width for vectors ``[n, dim]``."""

    def __init__(self, dim: int, bits: int, seed: int = 0, rounds: int = 3) -> None:
        self.dim = int(dim)
        self.bits = int(bits)
        self.rotation = HadamardRotation(dim, seed, rounds)
        self.padded_dim = self.rotation.padded_dim
        if self.padded_dim < 8:
            raise ValueError(f"TurboQuant needs vectors of at least 5 channels, got {dim}")
        self.codebook: Codebook = lloyd_max(self.bits, self.padded_dim)

    def rotate(self, x: np.ndarray) -> np.ndarray:
        """Rotate ``[..., dim]`` into the coded domain ``[..., D]`` (for queries and activations)."""
        return self.rotation.forward(x)

    def quantize(self, x: np.ndarray) -> TQCodes:
        x = np.asarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"expected vectors [n, {self.dim}], got shape {x.shape}")
        if not np.isfinite(x).all():
            raise ValueError("cannot quantize NaN or inf values")
        norms = np.linalg.norm(x.astype(np.float64), axis=1)
        if norms.max(initial=0.0) > FP16_MAX:
            raise ValueError(
                f"a vector norm of {norms.max():.3g} exceeds float16's range; scale the tensor down first"
            )
        unit = x / np.where(norms > 0, norms, 1.0)[:, None].astype(np.float32)
        z = self.rotation.forward(unit) * np.float32(math.sqrt(self.padded_dim))
        codes = self.codebook.encode(z)
        return TQCodes(pack_bits(codes, self.bits), norms.astype(np.float16), self.dim, self.bits)

    def codes(self, q: TQCodes) -> np.ndarray:
        """Unpacked codes, uint8 ``[n, D]``."""
        return unpack_bits(q.codes, q.bits, self.padded_dim)

    def dequantize_rotated(self, q: TQCodes) -> np.ndarray:
        """The reconstruction in the rotated domain, float32 ``[n, D]``."""
        scale = q.norms.astype(np.float32) / np.float32(math.sqrt(self.padded_dim))
        return self.codebook.decode(self.codes(q)) * scale[:, None]

    def dequantize(self, q: TQCodes) -> np.ndarray:
        """The reconstruction, float32 ``[n, dim]``."""
        return self.rotation.inverse(self.dequantize_rotated(q))


def split_rate(rate: float, dim: int) -> tuple[int, int]:
    """``(low_bits, n_outliers)`` for a rate: ``n_outliers`` channels get ``low_bits + 1`` bits."""
    low = math.floor(rate)
    n_hi = round((rate - low) * dim)
    if low < 1 or not math.isclose(low + n_hi / dim, rate, abs_tol=1e-9):
        raise ValueError(
            f"rate {rate} is not reachable on {dim} channels as a mix of {low} and {low + 1} bits"
        )
    return low, n_hi


def choose_outliers(calibration: np.ndarray, n_outliers: int) -> np.ndarray:
    """Per group, the `n_outliers` channels with the largest RMS over `calibration` [n, G, dim] (or
    [n, dim]): int64 [G, n_outliers], ascending."""
    c = np.asarray(calibration, dtype=np.float32)
    if c.ndim == 2:
        c = c[:, None, :]
    rms = np.sqrt(np.mean(c.astype(np.float64) ** 2, axis=0))  # [G, dim]
    top = np.argsort(-rms, axis=-1, kind="stable")[:, :n_outliers]
    return np.sort(top, axis=-1)


@dataclass(frozen=True)
class TQTensor:
    """Vectors [n, G, dim] under `TurboQuant`: one `TQCodes` per channel set (all channels, or outliers at
    low+1 bits then the rest), row i * G + g."""

    parts: tuple[TQCodes, ...]
    shape: tuple[int, int, int]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


class TurboQuant:
    """TurboQuant-MSE at an integer or fractional rate over vectors [n, G, dim]; `G` groups share rotations
    and codebooks, each with its own `outliers` [G, n_outliers] at a fractional rate."""

    def __init__(
        self, dim: int, rate: float, seed: int = 0, outliers: np.ndarray | None = None, rounds: int = 3
    ) -> None:
        self.dim = int(dim)
        self.rate = float(rate)
        low, n_hi = split_rate(rate, dim)
        if n_hi == 0:
            self.outliers: np.ndarray | None = None
            self.rest: np.ndarray | None = None
            self.quantizers: tuple[TurboQuantMSE, ...] = (TurboQuantMSE(dim, low, seed, rounds),)
            return
        if outliers is None:
            raise ValueError(
                f"rate {rate} splits {n_hi} outlier channels from the rest; pick them with choose_outliers()"
            )
        outliers = np.atleast_2d(np.asarray(outliers, dtype=np.int64))
        if outliers.shape[1] != n_hi or outliers.min() < 0 or outliers.max() >= dim:
            raise ValueError(
                f"outliers must be [G, {n_hi}] channel indices below {dim}, got {outliers.shape}"
            )
        mask = np.zeros((outliers.shape[0], dim), dtype=bool)
        np.put_along_axis(mask, outliers, True, axis=1)
        if (mask.sum(axis=1) != n_hi).any():
            raise ValueError("outlier channel indices repeat within a group")
        self.outliers = np.sort(outliers, axis=1)
        self.rest = np.stack([np.flatnonzero(~m) for m in mask])  # [G, dim - n_hi]
        self.quantizers = (
            TurboQuantMSE(n_hi, low + 1, seed, rounds),
            TurboQuantMSE(dim - n_hi, low, seed + 1, rounds),
        )

    @property
    def groups(self) -> int | None:
        """Groups fixed by the outlier table, or None (any number) at an integer rate."""
        return None if self.outliers is None else self.outliers.shape[0]

    def _split(self, x: np.ndarray) -> list[np.ndarray]:
        """``[n, G, dim]`` -> one ``[n, G, dim_part]`` array per channel set."""
        if self.outliers is None or self.rest is None:
            return [x]
        return [np.take_along_axis(x, idx[None], axis=2) for idx in (self.outliers, self.rest)]

    def _check(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        if x.ndim != 3 or x.shape[2] != self.dim:
            raise ValueError(f"expected vectors [n, G, {self.dim}], got shape {x.shape}")
        if self.groups is not None and x.shape[1] != self.groups:
            raise ValueError(f"outliers were chosen for {self.groups} groups, got {x.shape[1]}")
        return x

    def quantize(self, x: np.ndarray) -> TQTensor:
        x = self._check(x)
        n, g, _ = x.shape
        parts = tuple(
            q.quantize(p.reshape(n * g, -1)) for q, p in zip(self.quantizers, self._split(x), strict=True)
        )
        return TQTensor(parts, (n, g, self.dim))

    def dequantize(self, t: TQTensor) -> np.ndarray:
        """Reconstruct float32 ``[n, G, dim]``."""
        n, g, d = t.shape
        pieces = [q.dequantize(p).reshape(n, g, -1) for q, p in zip(self.quantizers, t.parts, strict=True)]
        if self.outliers is None or self.rest is None:
            return pieces[0]
        out = np.empty((n, g, d), dtype=np.float32)
        for idx, piece in zip((self.outliers, self.rest), pieces, strict=True):
            np.put_along_axis(out, np.broadcast_to(idx[None], piece.shape), piece, axis=2)
        return out

    def rotate(self, x: np.ndarray) -> list[np.ndarray]:
        """Queries/activations ``[m, G, dim]`` into each set's coded domain: ``[m, G, D_part]`` each."""
        x = self._check(x)
        return [q.rotate(p) for q, p in zip(self.quantizers, self._split(x), strict=True)]

    def dequantize_rotated(self, t: TQTensor) -> list[np.ndarray]:
        """Reconstructions in each set's coded domain: ``[n, G, D_part]`` each."""
        n, g, _ = t.shape
        return [
            q.dequantize_rotated(p).reshape(n, g, -1) for q, p in zip(self.quantizers, t.parts, strict=True)
        ]

    def bits_per_element(self) -> float:
        """Stored bits per original element, float16 norms included."""
        total = sum(q.padded_dim * q.bits + 16 for q in self.quantizers)
        return total / self.dim
