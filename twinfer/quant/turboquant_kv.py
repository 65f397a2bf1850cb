"""TurboQuant for the KV cache: quantize blocks [tokens, heads, head_dim], each head's vector alone.
One rotation and codebook per channel set; outlier channels per head at fractional rates
(`TurboQuantKV.calibrate`). Scores stay rotated: `q . k = (R q) . (R k)`. `inner_product=True` codes
keys by TurboQuant-prod (unbiased `q . k`, more variance)."""

from __future__ import annotations

import numpy as np

from twinfer.quant.qjl import TQProdCodes, TurboQuantProd
from twinfer.quant.turboquant import TQTensor, TurboQuant, choose_outliers, split_rate


class TurboQuantKV:
    """Quantizer for ``[tokens, heads, head_dim]`` KV blocks at ``rate`` bits per element."""

    def __init__(
        self,
        head_dim: int,
        n_heads: int,
        rate: float,
        seed: int = 0,
        outliers: np.ndarray | None = None,
        inner_product: bool = False,
    ) -> None:
        self.head_dim = int(head_dim)
        self.n_heads = int(n_heads)
        self.rate = float(rate)
        self.inner_product = inner_product
        if inner_product:
            if rate != int(rate) or rate < 1:
                raise ValueError(f"the inner-product (QJL) variant needs an integer rate >= 1, got {rate}")
            self.prod: TurboQuantProd | None = TurboQuantProd(head_dim, int(rate), seed)
            self.mse: TurboQuant | None = None
        else:
            self.prod = None
            self.mse = TurboQuant(head_dim, rate, seed, outliers)
            if self.mse.groups not in (None, n_heads):
                raise ValueError(f"outliers cover {self.mse.groups} heads, the cache has {n_heads}")

    @classmethod
    def calibrate(
        cls, sample: np.ndarray, rate: float, seed: int = 0, inner_product: bool = False
    ) -> TurboQuantKV:
        """Build a quantizer whose outlier channels (fractional rates) come from ``sample`` ``[T, H, Dh]``."""
        sample = np.asarray(sample, dtype=np.float32)
        _, heads, head_dim = sample.shape
        _, n_hi = split_rate(rate, head_dim)
        outliers = choose_outliers(sample, n_hi) if n_hi else None
        return cls(head_dim, heads, rate, seed, outliers, inner_product)

    def _check(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        if x.ndim != 3 or x.shape[1:] != (self.n_heads, self.head_dim):
            raise ValueError(
                f"expected a block [tokens, {self.n_heads}, {self.head_dim}], got shape {x.shape}"
            )
        return x

    def quantize(self, block: np.ndarray) -> TQTensor | TQProdCodes:
        """Quantize ``[T, H, Dh]``; rows of the result are ordered ``t * H + h``."""
        block = self._check(block)
        if self.prod is not None:
            return self.prod.quantize(block.reshape(-1, self.head_dim))
        return self.mse.quantize(block)  # type: ignore[union-attr]

    def dequantize(self, q: TQTensor | TQProdCodes) -> np.ndarray:
        """Reconstruct ``[T, H, Dh]`` float32."""
        if isinstance(q, TQProdCodes):
            return self.prod.dequantize(q).reshape(-1, self.n_heads, self.head_dim)  # type: ignore[union-attr]
        return self.mse.dequantize(q)  # type: ignore[union-attr]

    def scores(self, queries: np.ndarray, keys: TQTensor | TQProdCodes) -> np.ndarray:
        """Reference attention logits ``q . k`` (unscaled): ``[Tq, H, Dh]`` x keys ``[T, H, Dh]`` -> ``[H, Tq, T]``."""
        queries = self._check(queries)
        if isinstance(keys, TQProdCodes):
            tq = queries.shape[0]
            t = keys.signs.shape[0] // self.n_heads
            est = self.prod.inner_products(queries.reshape(-1, self.head_dim), keys)  # type: ignore[union-attr]
            est = est.reshape(tq, self.n_heads, t, self.n_heads)  # [Tq, H_q, T, H_k]
            return np.einsum("ahbh->hab", est)
        rq = self.mse.rotate(queries)  # type: ignore[union-attr]
        rk = self.mse.dequantize_rotated(keys)  # type: ignore[union-attr]
        return sum(np.einsum("ahd,bhd->hab", a, b) for a, b in zip(rq, rk, strict=True))  # type: ignore[return-value]

    def bits_per_element(self) -> float:
        """Stored bits per cached element, norms included."""
        if self.prod is not None:
            mse = self.prod.mse
            mse_bits = mse.padded_dim * mse.bits + 16 if mse else 0
            return (mse_bits + self.head_dim + 16) / self.head_dim
        return self.mse.bits_per_element()  # type: ignore[union-attr]
