"""FP8 E4M3 weights (OCP 8-bit floating point, the "fn" variant): per-tensor and 128x128 block scales.
Encoding rounds to nearest even and saturates at +-448 (bit-identical to torch's float8_e4m3fn cast);
`saturate=False` gives NaN instead. `FP8Tensor`: `w = decode(codes) * scale` (scalar or per channel);
`FP8BlockTensor`: `scale_inv` per 128x128 tile (docs/quantization.md, "Layouts")."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

E4M3_MAX = 448.0
E4M3_NAN = 0x7F
_ONE = 0x38  # code of 1.0


def _decode_table() -> np.ndarray:
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 0x7
    mag = np.where(exp == 0, man * 2.0**-9, (1.0 + man / 8.0) * 2.0 ** (exp - 7))
    vals = sign * mag
    vals = np.where((exp == 15) & (man == 7), np.copysign(np.nan, sign), vals)
    return vals.astype(np.float32)


E4M3_TABLE = _decode_table()
_POSITIVE = E4M3_TABLE[:127]  # codes 0..126: every finite non-negative value, ascending


def decode_e4m3(codes: np.ndarray) -> np.ndarray:
    """uint8 codes -> float32."""
    return E4M3_TABLE[np.asarray(codes, dtype=np.uint8)]


def round_e4m3(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest E4M3 magnitude grid (RNE), without range handling; float64 out."""
    a = np.abs(np.asarray(x, dtype=np.float64))
    _, e = np.frexp(a)  # a = m * 2**e, m in [0.5, 1)
    quantum = np.ldexp(1.0, np.maximum(e - 1, -6) - 3)  # 3 mantissa bits; subnormal spacing below 2**-6
    return np.rint(a / quantum) * quantum  # exact: dividing by a power of two, rint is half-to-even


def encode_e4m3(x: np.ndarray, saturate: bool = True) -> np.ndarray:
    """float32 -> uint8 E4M3 codes. ``saturate`` clamps to +-448; otherwise overflow and inf -> NaN."""
    x = np.asarray(x, dtype=np.float32)
    mag = round_e4m3(np.where(np.isfinite(x), x, E4M3_MAX))
    over = (mag > E4M3_MAX) | np.isinf(x)
    mag = np.minimum(mag, E4M3_MAX)
    # mag is on the grid, so searchsorted finds it exactly
    code = np.searchsorted(_POSITIVE, mag.astype(np.float32)).astype(np.uint8)
    if not saturate:
        code = np.where(over, E4M3_NAN, code).astype(np.uint8)
    code = np.where(np.isnan(x), E4M3_NAN, code).astype(np.uint8)
    return code | (np.signbit(x).astype(np.uint8) << 7)


@dataclass(frozen=True)
class FP8Tensor:
    """E4M3 weight with one float32 scale for the tensor or per output channel (see the module docstring)."""

    codes: np.ndarray  # uint8 [out, in]
    scale: np.float32 | np.ndarray  # scalar, or float32 [out, 1]

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes) + int(np.asarray(self.scale, dtype=np.float32).nbytes)

    def unpack(self) -> np.ndarray:
        return decode_e4m3(self.codes) * np.asarray(self.scale, dtype=np.float32)


@dataclass(frozen=True)
class FP8BlockTensor:
    """E4M3 weight with one float32 ``scale_inv`` per ``block x block`` tile (see the module docstring)."""

    codes: np.ndarray  # uint8 [out, in]
    scale_inv: np.ndarray  # float32 [ceil(out/block), ceil(in/block)]
    block: int = 128

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes + self.scale_inv.nbytes)

    def unpack(self) -> np.ndarray:
        out, inp = self.codes.shape
        s = np.repeat(np.repeat(self.scale_inv, self.block, axis=0), self.block, axis=1)[:out, :inp]
        return decode_e4m3(self.codes) * s


def _scale_for(amax: np.ndarray) -> np.ndarray:
    amax = np.asarray(amax, dtype=np.float32)
    return np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)


def pack(w: np.ndarray) -> FP8Tensor:
    """Per-tensor FP8: ``scale = max|w| / 448``."""
    w = _check(w)
    scale = _scale_for(np.abs(w).max(initial=0.0))
    return FP8Tensor(encode_e4m3(w / scale), np.float32(scale))


def pack_block(w: np.ndarray, block: int = 128) -> FP8BlockTensor:
    """Block FP8: one ``scale_inv = max|tile| / 448`` per ``block x block`` tile (edge tiles may be partial)."""
    w = _check(w)
    out, inp = w.shape
    bo, bi = -(-out // block), -(-inp // block)
    padded = np.zeros((bo * block, bi * block), dtype=np.float32)
    padded[:out, :inp] = w
    tiles = np.abs(padded).reshape(bo, block, bi, block)  # [bo, block, bi, block]
    scale_inv = _scale_for(tiles.max(axis=(1, 3)))
    s = np.repeat(np.repeat(scale_inv, block, axis=0), block, axis=1)[:out, :inp]
    return FP8BlockTensor(encode_e4m3(w / s), scale_inv, block)


def unpack(p: FP8Tensor | FP8BlockTensor) -> np.ndarray:
    """Dequantize to float32 ``[out, in]``."""
    return p.unpack()


def matmul(x: np.ndarray, p: FP8Tensor | FP8BlockTensor) -> np.ndarray:
    """Reference ``x @ W.T`` from the dequantized weight."""
    return np.asarray(x, dtype=np.float32) @ p.unpack().T


def _check(w: np.ndarray) -> np.ndarray:
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight [out, in], got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("weight has NaN or inf values; FP8 packing needs finite weights")
    return w
