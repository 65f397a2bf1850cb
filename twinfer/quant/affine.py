"""Affine (asymmetric, grouped) integer weights in MLX's exact layout, bit-identical to `mx.quantize`.
For `w` float32 [out, in], bits in {2, 4, 8}, group_size g in {32, 64, 128}: `wq` uint32
[out, in * bits / 32] (lowest bits first), `scales`, `biases` float32 [out, in / g], and
`w[r, c] ~= scales[r, c // g] * q[r, c] + biases[r, c // g]` (docs/quantization.md, "Layouts")."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GROUP_SIZES = (32, 64, 128)
BITS = (2, 4, 8)


@dataclass(frozen=True)
class AffineTensor:
    """Grouped affine integer weight in MLX layout (see the module docstring)."""

    wq: np.ndarray  # uint32 [out, in * bits / 32]
    scales: np.ndarray  # float32 [out, in / group_size]
    biases: np.ndarray  # float32 [out, in / group_size]
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.wq.shape[0], self.wq.shape[1] * 32 // self.bits)

    @property
    def nbytes(self) -> int:
        return int(self.wq.nbytes + self.scales.nbytes + self.biases.nbytes)

    def codes(self) -> np.ndarray:
        """The unpacked integer codes, uint8 ``[out, in]``."""
        per = 32 // self.bits
        shifts = (np.arange(per, dtype=np.uint32) * self.bits).astype(np.uint32)
        q = (self.wq[..., None] >> shifts) & np.uint32((1 << self.bits) - 1)  # [out, words, per]
        return q.reshape(self.wq.shape[0], -1).astype(np.uint8)

    def unpack(self) -> np.ndarray:
        out, inp = self.shape
        q = self.codes().reshape(out, inp // self.group_size, self.group_size).astype(np.float32)
        w = self.scales[..., None] * q + self.biases[..., None]
        return w.reshape(out, inp)


def pack(w: np.ndarray, bits: int = 4, group_size: int = 64) -> AffineTensor:
    """Quantize float32 ``[out, in]`` exactly as ``mx.quantize(w, group_size, bits)`` does."""
    w = np.asarray(w, dtype=np.float32)
    if bits not in BITS:
        raise ValueError(f"affine bits must be one of {BITS}, got {bits}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"affine group_size must be one of {GROUP_SIZES}, got {group_size}")
    if w.ndim != 2 or w.shape[1] % group_size:
        raise ValueError(f"expected [out, in] with in divisible by {group_size}, got shape {w.shape}")
    out, inp = w.shape
    g = w.reshape(out, inp // group_size, group_size)  # [out, groups, group_size]
    n_bins = np.float32((1 << bits) - 1)
    w_max, w_min = g.max(axis=-1), g.min(axis=-1)
    low_edge = np.abs(w_min) > np.abs(w_max)
    scale = np.maximum((w_max - w_min) / n_bins, np.float32(1e-7))
    scale = np.where(low_edge, scale, -scale)
    edge = np.where(low_edge, w_min, w_max)
    q0 = np.rint(edge / scale)
    has_q0 = q0 != 0
    scales = np.where(has_q0, edge / np.where(has_q0, q0, 1), scale).astype(np.float32)
    biases = np.where(has_q0, edge, 0).astype(np.float32)
    q = np.rint((g - biases[..., None]) / scales[..., None])
    q = np.clip(q, 0, n_bins).astype(np.uint32).reshape(out, -1, 32 // bits)  # [out, words, per word]
    shifts = (np.arange(32 // bits, dtype=np.uint32) * bits).astype(np.uint32)
    wq = np.bitwise_or.reduce(q << shifts, axis=-1).astype(np.uint32)
    return AffineTensor(wq, scales, biases, bits, group_size)


def unpack(p: AffineTensor) -> np.ndarray:
    """Dequantize to float32 ``[out, in]``."""
    return p.unpack()


def matmul(x: np.ndarray, p: AffineTensor) -> np.ndarray:
    """Reference ``x @ W.T`` from the dequantized weight (what ``mx.quantized_matmul`` computes)."""
    return np.asarray(x, dtype=np.float32) @ p.unpack().T
