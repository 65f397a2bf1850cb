"""RMSNorm, optionally fused with the residual add: one read of x (and the residual), one write of each output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_residual(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, C, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < C
    h = tl.load(x_ptr + row * C + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        h = h + tl.load(r_ptr + row * C + cols, mask=mask, other=0.0)
        tl.store(h_ptr + row * C + cols, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / C + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * C + cols, (hf * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_residual(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * w, x + residual) for x, residual [T, C]; see reference.py."""
    T, C = x.shape
    x, residual = x.contiguous(), residual.contiguous()
    y, h = torch.empty_like(x), torch.empty_like(x)
    if T:
        _rms_norm_residual[(T,)](x, residual, w.contiguous(), y, h, C, eps, HAS_RESIDUAL=True,
                                 BLOCK=triton.next_power_of_2(C))
    return y, h


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x) * w over the last axis of x [..., C] (per-head norms pass [T, H, D])."""
    C = x.shape[-1]
    rows = x.reshape(-1, C).contiguous()  # [N, C]
    y = torch.empty_like(rows)
    if rows.shape[0]:
        _rms_norm_residual[(rows.shape[0],)](rows, rows, w.contiguous(), y, y, C, eps, HAS_RESIDUAL=False,
                                             BLOCK=triton.next_power_of_2(C))
    return y.view(x.shape)
