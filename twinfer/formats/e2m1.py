"""FP4 E2M1, the element type of NVFP4 and MXFP4 (OCP MX spec v1.0, section 5.3.3): codes 0..7 are
0, 0.5, 1, 1.5, 2, 3, 4, 6, codes 8..15 their negatives; encoding rounds to nearest even, saturating."""

from __future__ import annotations

import numpy as np

E2M1_MAX = 6.0
# Code -> value; index with the 4-bit code.
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32
)
# Midpoints between consecutive magnitudes; a tie sits exactly on one of these.
_BOUNDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)


def encode_e2m1(x: np.ndarray) -> np.ndarray:
    """float32 -> 4-bit codes (uint8), round-to-nearest-even, saturating at +-6; NaN encodes as 0."""
    x = np.asarray(x, dtype=np.float32)
    mag = np.abs(x)
    lower = np.searchsorted(_BOUNDS, mag, side="left")  # ties land on the lower magnitude
    tie = (lower < len(_BOUNDS)) & (mag == _BOUNDS[np.minimum(lower, len(_BOUNDS) - 1)])
    code = (lower + (tie & (lower % 2 == 1))).astype(np.uint8)  # odd lower code at a tie -> go up to even
    code = np.where(np.isnan(x), 0, code).astype(np.uint8)
    return code | (np.signbit(x).astype(np.uint8) << 3)


def decode_e2m1(codes: np.ndarray) -> np.ndarray:
    """4-bit codes -> float32 values."""
    return E2M1_VALUES[np.asarray(codes, dtype=np.uint8) & 0x0F]
