"""TurboQuant for weights: rotate input channels, quantize rows, rotate activations at run time.
`W [out, in]` is cut into input blocks (the largest power of two dividing `in`, up to 128); each
(row, block) is one TurboQuant vector. `y = sum_g (R x_g) . (R W_g)`: `matmul` is the reference a
backend fuses into its GEMM."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from twinfer.quant.turboquant import TQTensor, TurboQuant, choose_outliers, split_rate

MAX_BLOCK = 128


def default_block(in_features: int) -> int:
    """Largest power of two dividing ``in_features``, capped at 128; the whole row if that is < 16."""
    b = in_features & -in_features
    b = min(b, MAX_BLOCK)
    return b if b >= 16 else in_features


@dataclass(frozen=True)
class TQWeight:
    """A TurboQuant weight: codes plus the quantizer that owns rotations, codebooks, outliers."""

    q: TQTensor  # vectors [out, G, block]
    quantizer: TurboQuant
    shape: tuple[int, int]
    block: int

    @property
    def nbytes(self) -> int:
        """Codes and norms; the rotation signs and codebooks are a few KiB shared by every tensor."""
        return self.q.nbytes

    def unpack(self) -> np.ndarray:
        return self.quantizer.dequantize(self.q).reshape(self.shape)


def turboquant_weight(
    w: np.ndarray, bits: float, seed: int = 0, block: int | None = None, calibration: np.ndarray | None = None
) -> TQWeight:
    """Quantize ``w`` float32 ``[out, in]`` at ``bits`` (2, 2.5, 3, 3.5, 4, ...) bits per weight of codes."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight [out, in], got shape {w.shape}")
    out, inp = w.shape
    block = block or default_block(inp)
    if inp % block:
        raise ValueError(f"block {block} does not divide the {inp} input channels")
    vecs = w.reshape(out, inp // block, block)  # [out, G, block]
    _, n_hi = split_rate(bits, block)
    outliers = None
    if n_hi:
        source = (
            vecs
            if calibration is None
            else np.asarray(calibration, np.float32).reshape(-1, inp // block, block)
        )
        outliers = choose_outliers(source, n_hi)
    quantizer = TurboQuant(block, bits, seed, outliers)
    return TQWeight(quantizer.quantize(vecs), quantizer, (out, inp), block)


def unpack(qw: TQWeight) -> np.ndarray:
    """Dequantize to float32 ``[out, in]``."""
    return qw.unpack()


def matmul(x: np.ndarray, qw: TQWeight) -> np.ndarray:
    """Reference ``x @ W.T``: rotate activation blocks, multiply by the codebook-decoded rotated weight."""
    x = np.asarray(x, dtype=np.float32)
    lead = x.shape[:-1]
    out, inp = qw.shape
    if x.shape[-1] != inp:
        raise ValueError(f"activation has {x.shape[-1]} features, the weight expects {inp}")
    xb = x.reshape(-1, inp // qw.block, qw.block)  # [m, G, block]
    y = sum(
        np.einsum("mgd,ogd->mo", xr, wr)
        for xr, wr in zip(qw.quantizer.rotate(xb), qw.quantizer.dequantize_rotated(qw.q), strict=True)
    )
    return np.asarray(y, dtype=np.float32).reshape(*lead, out)
