"""Seeded random rotation as fast Walsh-Hadamard transforms with random sign flips.
`R = H S_k ... H S_1`, `H` the orthonormal Sylvester Hadamard matrix of size D (a power of two; other
sizes are zero-padded), `S_i = diag(signs[i])`. Three rounds by default: one round maps a one-hot vector
far from TurboQuant's assumed law (docs/quantization.md, "Layouts"). Backends rebuild it from `signs`."""

from __future__ import annotations

import numpy as np

SIGN_STREAM = 0x4D5E  # keeps the sign draws apart from other users of the same seed


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def fwht(x: np.ndarray) -> np.ndarray:
    """Orthonormal Walsh-Hadamard transform over the last axis (length a power of two)."""
    x = np.asarray(x)
    x = x.astype(np.result_type(x.dtype, np.float32), copy=True)
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"fwht needs a power-of-two length, got {n}")
    lead = x.shape[:-1]
    h = 1
    while h < n:
        pairs = x.reshape(*lead, n // (2 * h), 2, h)  # butterflies pair i with i + h
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = np.stack((a + b, a - b), axis=-2).reshape(*lead, n)
        h *= 2
    return x * x.dtype.type(1.0 / np.sqrt(n))


class HadamardRotation:
    """A fixed orthogonal map ``R^dim -> R^D`` (``D = next_pow2(dim)``), determined by ``seed``."""

    def __init__(self, dim: int, seed: int = 0, rounds: int = 3) -> None:
        if dim < 1 or rounds < 1:
            raise ValueError(f"rotation needs dim >= 1 and rounds >= 1, got dim={dim}, rounds={rounds}")
        self.dim = int(dim)
        self.seed = int(seed)
        self.rounds = int(rounds)
        self.padded_dim = next_pow2(dim)
        rng = np.random.default_rng([self.seed, SIGN_STREAM])
        self.signs = (rng.integers(0, 2, size=(rounds, self.padded_dim)) * 2 - 1).astype(np.float32)

    def forward(self, x: np.ndarray) -> np.ndarray:
        """Rotate ``[..., dim]`` -> ``[..., D]``; norms and inner products are preserved."""
        x = np.asarray(x, dtype=np.float32)
        if x.shape[-1] != self.dim:
            raise ValueError(f"rotation expects last dimension {self.dim}, got {x.shape[-1]}")
        if self.padded_dim != self.dim:
            x = np.concatenate(
                [x, np.zeros((*x.shape[:-1], self.padded_dim - self.dim), np.float32)], axis=-1
            )
        for s in self.signs:
            x = fwht(x * s)
        return x

    def inverse(self, y: np.ndarray) -> np.ndarray:
        """Map ``[..., D]`` back to ``[..., dim]`` (``R^T``, then drop the padding)."""
        y = np.asarray(y, dtype=np.float32)
        for s in self.signs[::-1]:
            y = fwht(y) * s
        return y[..., : self.dim]

    def matrix(self) -> np.ndarray:
        """The rotation as a dense ``[D, dim]`` matrix (for tests and small references)."""
        return self.forward(np.eye(self.dim, dtype=np.float32)).T
