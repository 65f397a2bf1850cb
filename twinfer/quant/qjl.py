"""TurboQuant-prod: an unbiased inner-product quantizer (arXiv 2504.19874, Algorithm 2).
`b - 1` bits of TurboQuant-MSE plus a 1-bit QJL sketch of the residual: `signs` uint8 [n, ceil(dim/8)]
(bit j, little-endian, is `S r >= 0`) and `res_norms` float16 [n]; the estimate
`<y, x_mse> + ||r|| sqrt(pi/2) / dim <S y, signs>` is unbiased (docs/quantization.md, "Layouts")."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from twinfer.quant.turboquant import TQCodes, TurboQuantMSE

QJL_STREAM = 0x51A1


def paper_prod_bound(bits: int, dim: int) -> float:
    """The paper's bound on the inner-product variance for unit x, y: ``sqrt(3) pi^2 / d * 4**-b``."""
    return math.sqrt(3) * math.pi**2 / dim * 4.0**-bits


@dataclass(frozen=True)
class TQProdCodes:
    """TurboQuant-prod codes for ``n`` vectors (see the module docstring)."""

    mse: TQCodes | None
    signs: np.ndarray  # uint8 [n, ceil(dim / 8)]
    res_norms: np.ndarray  # float16 [n]
    dim: int
    bits: int

    @property
    def nbytes(self) -> int:
        return int((self.mse.nbytes if self.mse else 0) + self.signs.nbytes + self.res_norms.nbytes)


class TurboQuantProd:
    """``bits``-bit unbiased inner-product quantizer for vectors ``[n, dim]``."""

    def __init__(self, dim: int, bits: int, seed: int = 0, rounds: int = 3) -> None:
        if bits < 1:
            raise ValueError(f"TurboQuant-prod needs at least 1 bit, got {bits}")
        self.dim = int(dim)
        self.bits = int(bits)
        self.mse = TurboQuantMSE(dim, bits - 1, seed, rounds) if bits > 1 else None
        rng = np.random.default_rng([int(seed), QJL_STREAM])
        self.sketch = rng.standard_normal((dim, dim)).astype(np.float32)  # S: [sketch rows, dim]

    def quantize(self, x: np.ndarray) -> TQProdCodes:
        x = np.asarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"expected vectors [n, {self.dim}], got shape {x.shape}")
        mse = self.mse.quantize(x) if self.mse else None
        residual = x - self.mse.dequantize(mse) if self.mse and mse else x
        signs = np.packbits((residual @ self.sketch.T) >= 0, axis=1, bitorder="little")
        res_norms = np.linalg.norm(residual, axis=1).astype(np.float16)
        return TQProdCodes(mse, signs, res_norms, self.dim, self.bits)

    def _signs(self, c: TQProdCodes) -> np.ndarray:
        bits = np.unpackbits(c.signs, axis=1, count=self.dim, bitorder="little")
        return bits.astype(np.float32) * 2 - 1  # [n, dim] of +-1

    def _qjl_scale(self, c: TQProdCodes) -> np.ndarray:
        return c.res_norms.astype(np.float32) * np.float32(math.sqrt(math.pi / 2) / self.dim)

    def dequantize(self, c: TQProdCodes) -> np.ndarray:
        """Unbiased reconstruction ``x_mse + ||r|| sqrt(pi/2)/d S^T signs`` (noisy; for inner products)."""
        qjl = (self._signs(c) @ self.sketch) * self._qjl_scale(c)[:, None]
        return qjl if c.mse is None else self.mse.dequantize(c.mse) + qjl  # type: ignore[union-attr]

    def inner_products(self, y: np.ndarray, c: TQProdCodes) -> np.ndarray:
        """Unbiased estimates of ``y @ x.T``: queries ``[m, dim]`` x codes of ``n`` -> ``[m, n]``."""
        y = np.asarray(y, dtype=np.float32)
        est = (y @ self.sketch.T) @ self._signs(c).T * self._qjl_scale(c)[None, :]
        if c.mse is not None:
            est = est + y @ self.mse.dequantize(c.mse).T  # type: ignore[union-attr]
        return est
