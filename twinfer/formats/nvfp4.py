"""NVFP4: E2M1 values in 16-element blocks with E4M3 block scales and one FP32 tensor scale.

`packed` uint8 [out, in / 2] (even column in the low nibble, ModelOpt's order), `scales` uint8 E4M3
[out, in / 16] row-major, `global_scale` float32: `w[r, c] = e2m1(packed)[r, c] * e4m3(scales[r, c // 16])
* global_scale`; quantization follows ModelOpt (docs/quantization.md, "Layouts")."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from twinfer.formats.bitpack import pack_nibbles, unpack_nibbles
from twinfer.formats.e2m1 import E2M1_MAX, decode_e2m1, encode_e2m1
from twinfer.formats.fp8 import E4M3_MAX, decode_e4m3, encode_e4m3

BLOCK = 16
_E4M3_ONE = 0x38


@dataclass(frozen=True)
class NVFP4Tensor:
    """NVFP4 weight (see the module docstring)."""

    packed: np.ndarray  # uint8 [out, in / 2]
    scales: np.ndarray  # uint8 E4M3 codes [out, in / 16]
    global_scale: np.float32

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 2)

    @property
    def nbytes(self) -> int:
        return int(self.packed.nbytes + self.scales.nbytes) + 4

    def block_scales(self) -> np.ndarray:
        """Decoded per-block multipliers including the global scale, float32 ``[out, in / 16]``."""
        return decode_e4m3(self.scales) * np.float32(self.global_scale)

    def unpack(self) -> np.ndarray:
        out, inp = self.shape
        vals = decode_e2m1(unpack_nibbles(self.packed)).reshape(out, inp // BLOCK, BLOCK)
        return (vals * self.block_scales()[..., None]).reshape(out, inp)


def pack(w: np.ndarray, global_scale: float | None = None) -> NVFP4Tensor:
    """Quantize float32 [out, in] (`in` a multiple of 16) to NVFP4, ModelOpt's recipe; `global_scale`
    defaults to amax(w) / (6 * 448), 1.0 gives block scales alone."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % BLOCK:
        raise ValueError(f"NVFP4 needs a weight [out, in] with in divisible by {BLOCK}, got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("weight has NaN or inf values; NVFP4 packing needs finite weights")
    out, inp = w.shape
    amax = np.float32(np.abs(w).max(initial=0.0))
    if global_scale is None:
        global_scale = float(amax / np.float32(E2M1_MAX * E4M3_MAX)) if amax > 0 else 1.0
    gs = np.float32(global_scale)
    blocks = w.reshape(out, inp // BLOCK, BLOCK)  # [out, blocks, 16]
    block_amax = np.abs(blocks).max(axis=-1)
    raw = block_amax / (np.float32(E2M1_MAX) * gs)
    scales = np.where(raw == 0, _E4M3_ONE, encode_e4m3(raw)).astype(np.uint8)
    denom = decode_e4m3(scales) * gs  # a scale can underflow to 0 for a tiny block: emit zeros
    scaled = np.where(denom[..., None] > 0, blocks / np.where(denom > 0, denom, 1)[..., None], 0)
    codes = encode_e2m1(scaled.astype(np.float32)).reshape(out, inp)
    return NVFP4Tensor(pack_nibbles(codes), scales, gs)


def unpack(p: NVFP4Tensor) -> np.ndarray:
    """Dequantize to float32 ``[out, in]``."""
    return p.unpack()


def matmul(x: np.ndarray, p: NVFP4Tensor) -> np.ndarray:
    """Reference ``x @ W.T`` from the dequantized weight."""
    return np.asarray(x, dtype=np.float32) @ p.unpack().T
