"""Decode attention over a paged KV cache, split over the context (flash-decoding), grouped by KV head.

One program per (sequence, KV head, split) loads each key and value once for its query-head group;
a second kernel merges the splits' online-softmax partials. The split count depends only on the
shapes, never on context lengths, so one captured CUDA graph serves every later step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from twinfer.backends.cuda.kernels import sm_count

MAX_SPLITS = 64
# Tile and launch shape: the winners of bench/gpu_tune.py on an H200 (docs/benchmarks.md, "GPU"); it sweeps
# them on any GPU and can set them for a run.
CONFIG = {"block_n": 64, "num_warps": 4, "programs_per_sm": 4}


@triton.jit
def _paged_decode_split(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, acc_ptr, ml_ptr, scale, window,
                        max_blocks, SPLITS, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, G_PAD: tl.constexpr, DIRECT: tl.constexpr,
                        PRECISION: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    G: tl.constexpr = H // HKV
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    heads = kvh * G + g  # the query heads of this KV head; rows past G are padding
    real = g < G
    q = tl.load(q_ptr + (b * H + heads)[:, None] * D + d[None, :], mask=real[:, None], other=0.0)
    n = tl.load(lens_ptr + b)
    lo = tl.maximum(n - window, 0)
    first = lo // BLOCK_N * BLOCK_N  # blocks wholly outside the window are skipped
    part = tl.cdiv(tl.cdiv(n - first, SPLITS), BLOCK_N) * BLOCK_N  # this sequence's positions per split
    start = first + s * part
    end = tl.minimum(start + part, n)
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D), tl.float32)
    for pos0 in range(start, end, BLOCK_N):
        pos = pos0 + tl.arange(0, BLOCK_N)
        valid = (pos < end) & (pos >= lo)
        block = tl.load(tables_ptr + b * max_blocks + pos // BLOCK_SIZE, mask=pos < end, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        offs = (slot[:, None] * HKV + kvh) * D + d[None, :]
        k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [G_PAD, BLOCK_N]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing valid yet stays empty
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    if DIRECT:  # one split: the output itself
        out = acc / l_i[:, None]
        tl.store(out_ptr + (b * H + heads)[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=real[:, None])
    else:  # partial sums of this split, merged by _merge_splits
        row = (b * H + heads) * SPLITS + s
        tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=real[:, None])
        tl.store(ml_ptr + row * 2, m_i, mask=real)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=real)


@triton.jit
def _merge_splits(acc_ptr, ml_ptr, out_ptr, SPLITS, D: tl.constexpr, S_PAD: tl.constexpr):
    row = tl.program_id(0)  # b * H + h
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D)
    here = s < SPLITS
    m = tl.load(ml_ptr + (row * SPLITS + s) * 2, mask=here, other=float("-inf"))
    l_s = tl.load(ml_ptr + (row * SPLITS + s) * 2 + 1, mask=here, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(l_s > 0, tl.exp(m - m_max), 0.0)  # splits past the context hold l = 0
    acc = tl.load(acc_ptr + (row * SPLITS + s)[:, None] * D + d[None, :], mask=here[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_s * w, axis=0)
    tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty))


def num_splits(batch: int, kv_heads: int, max_tokens: int, block_n: int, device: torch.device) -> int:
    """Splits per sequence: about `programs_per_sm` programs per SM, no more than the table has BLOCK_N runs."""
    sms = sm_count(device)
    want = -(-CONFIG["programs_per_sm"] * sms // (batch * kv_heads))
    return max(1, min(MAX_SPLITS, want, -(-max_tokens // block_n)))


@dataclass(frozen=True)
class DecodeTiles:
    """A decode launch's tiling: `block_n` KV positions per tile (default: `CONFIG`'s) and `splits`, how many
    parts each sequence's context is divided into (default: from the shapes)."""

    block_n: int | None = None
    splits: int | None = None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                           scale: float, window: int | None = None, tiles: DecodeTiles = DecodeTiles()
                           ) -> torch.Tensor:
    """q [B, H, D] against k/v_cache [slots, Hkv, D] through block_tables [B, max_blocks] -> [B, H, D]."""
    B, H, D = q.shape
    Hkv = k_cache.shape[1]
    block_n, splits = tiles.block_n or CONFIG["block_n"], tiles.splits
    if block_n < 16 or D < 16:
        raise ValueError(f"the decode kernel's tiles need block_n and head_dim of at least 16, got {block_n}, {D}")
    tables = block_tables.to(torch.int32).contiguous()
    max_blocks = tables.shape[1]
    S = splits or num_splits(B, Hkv, max_blocks * block_size, block_n, q.device)
    out = torch.empty_like(q)
    acc = torch.empty((B * H * S, D) if S > 1 else (1,), dtype=torch.float32, device=q.device)
    ml = torch.empty((B * H * S, 2) if S > 1 else (1,), dtype=torch.float32, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # float32 caches multiply in float32
    _paged_decode_split[(B, Hkv, S)](
        q.contiguous(), k_cache, v_cache, tables, context_lens.to(torch.int32).contiguous(), out, acc, ml, scale,
        window if window is not None else 1 << 30, max_blocks, S, H=H, HKV=Hkv, D=D, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, G_PAD=max(16, triton.next_power_of_2(H // Hkv)), DIRECT=S == 1, PRECISION=precision,
        num_warps=CONFIG["num_warps"],
    )
    if S > 1:
        _merge_splits[(B * H,)](acc, ml, out, S, D=D, S_PAD=triton.next_power_of_2(S))
    return out
