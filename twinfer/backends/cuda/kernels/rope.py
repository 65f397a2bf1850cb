"""Rotary position embedding in one launch: x [T, H, D] rotated by a step's cos/sin table [T, 1, R].
One program per token; dims past R pass through; float32 arithmetic in x's dtype, as the torch form."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope(x_ptr, cos_ptr, sin_ptr, out_ptr, H, stride_t, stride_h, D: tl.constexpr, R: tl.constexpr,
          H_PAD: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, H_PAD)
    i = tl.arange(0, HALF)
    hm = h[:, None] < H
    src = x_ptr + t * stride_t + h[:, None] * stride_h
    dst = out_ptr + (t * H + h[:, None]) * D
    x1 = tl.load(src + i[None, :], mask=hm, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + i[None, :], mask=hm, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * R + i)[None, :]  # the table holds each frequency twice (cat(freqs, freqs)):
    s = tl.load(sin_ptr + t * R + i)[None, :]  # its first half serves both halves of x
    tl.store(dst + i[None, :], (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=hm)
    tl.store(dst + HALF + i[None, :], (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=hm)
    if PASS > 0:  # partial rotary: the dims past R pass through
        j = R + tl.arange(0, PASS)
        m = hm & (j[None, :] < D)
        tl.store(dst + j[None, :], tl.load(src + j[None, :], mask=m, other=0.0), mask=m)


def rope_applies(x: torch.Tensor, rotary_dim: int) -> bool:
    """Whether the kernel tiles this call: [T, H, D] with a power-of-two half rotary width."""
    half = rotary_dim // 2
    return x.dim() == 3 and rotary_dim % 2 == 0 and half >= 1 and half & (half - 1) == 0 and x.stride(-1) == 1


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated over its first R dims by cos/sin [T, 1, R] (float32, each frequency twice as
    `TorchOps._rope_table` builds them: the kernel reads the first half) -> a new [T, H, D]."""
    T, H, D = x.shape
    R = cos.shape[-1]
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T:
        _rope[(T,)](x, cos.contiguous(), sin.contiguous(), out, H, x.stride(0), x.stride(1), D=D, R=R,
                    H_PAD=triton.next_power_of_2(H), HALF=R // 2,
                    PASS=triton.next_power_of_2(D - R) if D > R else 0)
    return out
