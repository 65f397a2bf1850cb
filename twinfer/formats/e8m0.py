"""E8M0, the block-scale type of MXFP4 (OCP MX spec v1.0, section 5.4.1): an unsigned power of two.
A code is 8 exponent bits with bias 127: ``scale = 2**(code - 127)``; 255 is NaN. No sign, no mantissa."""

from __future__ import annotations

import numpy as np

E8M0_BIAS = 127
E8M0_NAN = 255


def decode_e8m0(codes: np.ndarray) -> np.ndarray:
    """E8M0 codes -> float32 ``2**(code - 127)`` (255 -> NaN)."""
    codes = np.asarray(codes, dtype=np.uint8)
    exps = np.minimum(codes, E8M0_NAN - 1).astype(np.int32) - E8M0_BIAS
    out = np.ldexp(np.float32(1.0), exps).astype(np.float32)
    return np.where(codes == E8M0_NAN, np.float32(np.nan), out)
