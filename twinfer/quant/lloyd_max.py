"""Lloyd-Max scalar codebooks for one coordinate of a randomly rotated unit vector.
Codebooks are in units of the coordinate's standard deviation (`z = x * sqrt(d)`), so one table serves
every norm; `distortion` is E[(z - Q(z))^2], TurboQuant's D_mse for a unit vector."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

_GRID = 400_001
_TAIL = 12.0  # the Gaussian mass beyond 12 sigma is ~4e-33


@dataclass(frozen=True)
class Codebook:
    """Optimal `2**bits`-level quantizer for the rotated-coordinate law in dimension `dim` (None: the
    Gaussian limit), in standard-deviation units."""

    bits: int
    dim: int | None
    centroids: np.ndarray  # float64 [2**bits], ascending
    boundaries: np.ndarray  # float64 [2**bits - 1], midpoints between centroids
    distortion: float

    def encode(self, z: np.ndarray) -> np.ndarray:
        """Nearest-centroid codes (uint8) for standardized coordinates ``z``."""
        return np.searchsorted(self.boundaries, z).astype(np.uint8)

    def decode(self, codes: np.ndarray) -> np.ndarray:
        return self.centroids.astype(np.float32)[codes]


def _density(dim: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Grid and unnormalized density of ``z = x sqrt(dim)``."""
    if dim is None:
        z = np.linspace(-_TAIL, _TAIL, _GRID)
        return z, np.exp(-0.5 * z * z)
    if dim < 4:
        raise ValueError(f"the rotated-coordinate law needs dim >= 4, got {dim}")
    half = min(np.sqrt(dim), _TAIL)
    z = np.linspace(-half, half, _GRID)
    return z, np.power(np.clip(1.0 - z * z / dim, 0.0, None), (dim - 3) / 2.0)


def _cumulative(z: np.ndarray, f: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Trapezoid cumulative integrals of f, z f, z^2 f, normalized so the first is a CDF."""
    dz = z[1] - z[0]

    def cum(g: np.ndarray) -> np.ndarray:
        return np.concatenate([[0.0], np.cumsum((g[1:] + g[:-1]) * (0.5 * dz))])

    m0, m1, m2 = cum(f), cum(z * f), cum(z * z * f)
    return m0 / m0[-1], m1 / m0[-1], m2 / m0[-1]


@cache
def lloyd_max(bits: int, dim: int | None = None, tol: float = 1e-12, max_iter: int = 20_000) -> Codebook:
    """Compute the Lloyd-Max codebook for ``bits`` bits and dimension ``dim`` (``None``: Gaussian)."""
    if not 1 <= bits <= 8:
        raise ValueError(f"codebook bits must be in 1..8, got {bits}")
    z, f = _density(dim)
    m0, m1, m2 = _cumulative(z, f)
    levels = 1 << bits
    c = np.linspace(-2.5, 2.5, levels) * (1.0 if levels > 2 else 0.5)
    for _ in range(max_iter):
        edges = np.concatenate([[z[0]], (c[1:] + c[:-1]) / 2, [z[-1]]])
        mass = np.diff(np.interp(edges, z, m0))
        first = np.diff(np.interp(edges, z, m1))
        new = np.where(mass > 0, first / np.maximum(mass, 1e-300), c)
        done = np.max(np.abs(new - c)) < tol
        c = new
        if done:
            break
    edges = np.concatenate([[z[0]], (c[1:] + c[:-1]) / 2, [z[-1]]])
    mass = np.diff(np.interp(edges, z, m0))
    first = np.diff(np.interp(edges, z, m1))
    second = np.diff(np.interp(edges, z, m2))
    distortion = float(np.sum(second - 2 * c * first + c * c * mass))
    return Codebook(bits, dim, c, (c[1:] + c[:-1]) / 2, distortion)
