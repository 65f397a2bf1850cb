"""MXFP4 (OCP Microscaling Formats spec v1.0): E2M1 values in 32-element blocks, E8M0 block scales.
`blocks` uint8 [out, in / 32, 16] (even element in the low nibble, gpt-oss's layout), `scales` uint8
[out, in / 32]: `w[r, 32*b + i] = e2m1(blocks[r, b])[i] * 2**(scales[r, b] - 127)`; quantization is the
spec's reference recipe (docs/quantization.md, "Layouts")."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from twinfer.formats.bitpack import pack_nibbles, unpack_nibbles
from twinfer.formats.e2m1 import decode_e2m1, encode_e2m1
from twinfer.formats.e8m0 import E8M0_BIAS, E8M0_NAN, decode_e8m0

__all__ = ["BLOCK", "E8M0_BIAS", "E8M0_NAN", "MXFP4Tensor", "decode_e8m0", "load_mxfp4_tensor", "matmul", "pack",
           "unpack"]
BLOCK = 32
_E2M1_EMAX = 2


@dataclass(frozen=True)
class MXFP4Tensor:
    """MXFP4 weight in gpt-oss layout (see the module docstring)."""

    blocks: np.ndarray  # uint8 [out, in / 32, 16]
    scales: np.ndarray  # uint8 E8M0 [out, in / 32]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.blocks.shape[0], self.blocks.shape[1] * BLOCK)

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes + self.scales.nbytes)

    def unpack(self) -> np.ndarray:
        return load_mxfp4_tensor(self.blocks, self.scales)


def load_mxfp4_tensor(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Dequantize gpt-oss MXFP4 `blocks` uint8 [..., G, 16] and `scales` uint8 [..., G] to float32
    [..., G * 32] (an expert tensor comes out [experts, out, in])."""
    blocks = np.asarray(blocks, dtype=np.uint8)
    scales = np.asarray(scales, dtype=np.uint8)
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks must be [..., G, 16] with scales [..., G]; got {blocks.shape} and {scales.shape}"
        )
    vals = decode_e2m1(unpack_nibbles(blocks))  # [..., G, 32]
    out = vals * decode_e8m0(scales)[..., None]
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK)


def pack(w: np.ndarray) -> MXFP4Tensor:
    """Quantize float32 ``[out, in]`` (``in`` a multiple of 32) with the OCP reference recipe."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % BLOCK:
        raise ValueError(f"MXFP4 needs a weight [out, in] with in divisible by {BLOCK}, got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("weight has NaN or inf values; MXFP4 packing needs finite weights")
    out, inp = w.shape
    g = w.reshape(out, inp // BLOCK, BLOCK)  # [out, blocks, 32]
    amax = np.abs(g).max(axis=-1)
    _, e = np.frexp(np.where(amax > 0, amax, 1.0))  # amax = m * 2**e, m in [0.5, 1)
    shared = np.where(amax > 0, e - 1 - _E2M1_EMAX, -E8M0_BIAS)
    shared = np.clip(shared, -E8M0_BIAS, E8M0_BIAS)
    scaled = np.ldexp(g, -shared[..., None].astype(np.int32)).astype(np.float32)
    codes = encode_e2m1(scaled).reshape(out, inp // BLOCK, BLOCK)
    return MXFP4Tensor(pack_nibbles(codes), (shared + E8M0_BIAS).astype(np.uint8))


def unpack(p: MXFP4Tensor) -> np.ndarray:
    """Dequantize to float32 ``[out, in]``."""
    return p.unpack()


def matmul(x: np.ndarray, p: MXFP4Tensor) -> np.ndarray:
    """Reference ``x @ W.T`` from the dequantized weight."""
    return np.asarray(x, dtype=np.float32) @ p.unpack().T
