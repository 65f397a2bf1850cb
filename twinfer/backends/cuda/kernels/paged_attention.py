"""Decode attention over a paged KV cache: one program per (sequence, query head).

Each program walks its sequence's block table BLOCK_N positions at a time, loads those keys and
values by slot, and keeps an online softmax (running max and sum), so context length is bounded
only by the block table. The table width is a runtime argument, so a growing context does not
recompile the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, scale, window, max_blocks,
                  H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // (H // HKV)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (b * H + h) * D + d).to(tl.float32)
    n = tl.load(lens_ptr + b)
    lo = tl.maximum(n - window, 0)
    m_i = tl.full((), float("-inf"), tl.float32)
    l_i = tl.zeros((), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    for start in range(lo // BLOCK_N * BLOCK_N, n, BLOCK_N):  # skip blocks wholly outside the window
        pos = start + tl.arange(0, BLOCK_N)
        valid = (pos < n) & (pos >= lo)
        block = tl.load(tables_ptr + b * max_blocks + pos // BLOCK_SIZE, mask=pos < n, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        offs = (slot[:, None] * HKV + kvh) * D + d[None, :]
        k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    tl.store(out_ptr + (b * H + h) * D + d, (acc / l_i).to(out_ptr.dtype.element_ty))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                           scale: float, window: int | None = None, block_n: int = 32) -> torch.Tensor:
    """q [B, H, D] against k/v_cache [slots, Hkv, D] through block_tables [B, max_blocks] -> [B, H, D]."""
    B, H, D = q.shape
    Hkv = k_cache.shape[1]
    out = torch.empty_like(q)
    tables = block_tables.to(torch.int32).contiguous()
    _paged_decode[(B, H)](
        q.contiguous(), k_cache, v_cache, tables, context_lens.to(torch.int32).contiguous(), out, scale,
        window if window is not None else 1 << 30, tables.shape[1], H=H, HKV=Hkv, D=D, BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
    )
    return out
