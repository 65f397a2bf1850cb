"""Kimi K2.5's host-side image work in numpy: sizing, resize, normalized patches, and the per-patch
position and rope tables. Patches come in merge-block order (each 2 x 2 block consecutive), so the
permutation-equivariant tower's output is already grouped as the patch merger pools it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ImageSettings:
    """The image processor's settings (transformers' `Kimi_K25ImageProcessor` defaults)."""

    patch: int = 14
    merge: int = 2  # patches a side of one merged token
    max_side: int = 512  # patches a side at most (`size.max_height`)
    max_patches: int = 16384
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale: float = 1 / 255

    def __post_init__(self) -> None:
        if self.patch < 1 or self.merge < 1 or self.max_side < self.merge or self.max_patches < 1:
            raise ValueError(f"image settings out of range: {self}")

    def sizes(self, height: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """((resized h, w), (padded h, w)) as transformers' `navit_resize`: shrink to the budgets, pad."""
        p = self.patch
        count = max(1.0, height // p) * max(1.0, width // p)
        side = self.max_side * p
        scale = min(1.0, math.sqrt(self.max_patches / count), side / height, side / width)
        h = min(max(1, int(height * scale)), side)
        w = min(max(1, int(width * scale)), side)
        f = self.merge * p
        return (h, w), ((f - h % f) % f + h, (f - w % f) % f + w)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """Patches a side (rows, columns) of an image of this size."""
        _, (ph, pw) = self.sizes(height, width)
        return ph // self.patch, pw // self.patch

    def tokens(self, height: int, width: int) -> int:
        """Placeholder tokens (merged patches) of an image of this size."""
        gh, gw = self.grid(height, width)
        return (gh // self.merge) * (gw // self.merge)


def patches(settings: ImageSettings, pixels: np.ndarray) -> tuple[np.ndarray, tuple[int, int]]:
    """uint8 [H, W, 3] -> (float32 [N, 3 * p * p] rows as channel, y, x, (grid rows, columns))."""
    (h, w), (ph, pw) = settings.sizes(pixels.shape[0], pixels.shape[1])
    if (h, w) != pixels.shape[:2]:
        pixels = resize_bicubic(pixels, h, w)
    padded = np.zeros((ph, pw, 3), np.uint8)  # transformers pads with 0 before normalizing
    padded[:h, :w] = pixels
    scale = np.float32(1 / settings.rescale)
    mean = np.asarray(settings.mean, np.float32) * scale
    std = np.asarray(settings.std, np.float32) * scale
    x = (padded.astype(np.float32) - mean) / std
    p, m = settings.patch, settings.merge
    gh, gw = ph // p, pw // p
    x = x.reshape(gh // m, m, p, gw // m, m, p, 3)  # [bh, ih, py, bw, iw, px, c]
    x = x.transpose(0, 3, 1, 4, 6, 2, 5)  # [bh, bw, ih, iw, c, py, px]
    return np.ascontiguousarray(x.reshape(gh * gw, 3 * p * p)), (gh, gw)


def block_positions(gh: int, gw: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of each patch in merge-block order."""
    bh, bw, ih, iw = np.meshgrid(np.arange(gh // merge), np.arange(gw // merge), np.arange(merge),
                                 np.arange(merge), indexing="ij")
    return (bh * merge + ih).reshape(-1), (bw * merge + iw).reshape(-1)


def position_embedding(table: np.ndarray, gh: int, gw: int, merge: int) -> np.ndarray:
    """The learned [side, side, C] grid resampled to gh x gw as `F.interpolate(mode="bicubic")` -> [N, C]."""
    side = table.shape[0]
    flat = table.reshape(-1, table.shape[-1]).astype(np.float32)
    rows, cols = block_positions(gh, gw, merge)
    h_taps, h_w = _bicubic_taps(rows, gh, side)
    w_taps, w_w = _bicubic_taps(cols, gw, side)
    out = np.zeros((rows.size, flat.shape[1]), np.float32)
    for a in range(4):
        for b in range(4):
            out += (h_w[:, a] * w_w[:, b])[:, None] * flat[h_taps[:, a] * side + w_taps[:, b]]
    return out


def _bicubic_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Four source taps and their Keys-kernel weights for each target index on an axis of `size`."""
    f = np.float32
    src = (index.astype(f) + f(0.5)) * f(side) / f(size) - f(0.5)
    floor = np.floor(src)
    offsets = np.arange(-1, 3)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    d = np.abs(src[:, None] - floor[:, None] - offsets.astype(np.float32))
    a = np.float32(-0.75)
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return taps, np.where(d <= 1, near, far).astype(np.float32)


def rope_tables(gh: int, gw: int, merge: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [N, 1, D] of MoonViT's axial rope: pair i turns by the column (i even) or row (i odd)
    times theta^(-4 * (i // 2) / D); both halves of the head share the angles."""
    quarter = np.arange(0, head_dim // 2, 2, dtype=np.float32) / np.float32(head_dim // 2)
    inv_freq = (np.float32(1.0) / np.float32(theta) ** quarter).astype(np.float32)
    rows, cols = block_positions(gh, gw, merge)
    angles = np.stack([cols[:, None] * inv_freq, rows[:, None] * inv_freq], axis=-1)  # [N, D/4, (w, h)]
    angles = angles.reshape(rows.size, head_dim // 2).astype(np.float32)
    angles = np.concatenate([angles, angles], axis=-1)[:, None, :]
    return np.cos(angles), np.sin(angles)


def rotate_half_matrix(head_dim: int) -> np.ndarray:
    """R [D, D] with x @ R.T == concat(-x[D/2:], x[:D/2]) exactly (one signed 1 a row)."""
    half = head_dim // 2
    r = np.zeros((head_dim, head_dim), np.float32)
    r[np.arange(half), np.arange(half) + half] = -1.0
    r[np.arange(half) + half, np.arange(half)] = 1.0
    return r


def resize_bicubic(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """torch's uint8 antialiased bicubic `interpolate` (torchvision's resize) bit for bit: PIL's filter
    (a = -0.5) in int16 fixed point, columns then rows, rounding to uint8 after each pass."""
    wide = _resample_axis(pixels, width, axis=1)
    return _resample_axis(wide, height, axis=0)


def _resample_axis(x: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    in_size = x.shape[axis]
    if in_size == out_size:
        return x
    m = _aa_matrix(in_size, out_size)  # [out, in] float64
    bits = 0  # the most fraction bits that keep the largest weight within int16
    while bits < 22 and int(0.5 + m.max() * (1 << (bits + 1))) < (1 << 15):
        bits += 1
    v = m * (1 << bits)
    k = np.where(v < 0, np.trunc(v - 0.5), np.trunc(v + 0.5)).astype(np.int64)
    moved = np.moveaxis(x.astype(np.int64), axis, 0)
    acc = np.tensordot(k, moved, axes=(1, 0)) + (1 << (bits - 1))
    return np.moveaxis(np.clip(acc >> bits, 0, 255).astype(np.uint8), 0, axis)


def _aa_matrix(in_size: int, out_size: int) -> np.ndarray:
    """Normalized cubic weights (a = -0.5), the support widened by the downscale factor."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    inv = 1.0 / scale if scale >= 1.0 else 1.0
    m = np.zeros((out_size, in_size))
    for i in range(out_size):
        center = scale * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), in_size)
        d = np.abs((np.arange(lo, hi) - center + 0.5) * inv)
        a = -0.5
        w = np.where(d < 1, ((a + 2) * d - (a + 3)) * d * d + 1,
                     np.where(d < 2, ((a * d - 5 * a) * d + 8 * a) * d - 4 * a, 0.0))
        m[i, lo:hi] = w / w.sum() if w.sum() != 0 else w
    return m
