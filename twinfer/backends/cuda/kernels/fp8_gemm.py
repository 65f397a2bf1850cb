"""FP8-weight products for the few rows of a decode step: y = x @ (codes * scale).T, split over K.

Each program widens a tile of E4M3 codes to the activations' dtype in registers (activations stay in 16
bits) and applies the per-channel scale at the end; K splits write float32 partial sums that one
reduction adds, so the result is order-independent (docs/benchmarks.md, "GPU: one H200")."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from twinfer.backends.cuda.kernels import sm_count

MAX_ROWS = 64  # the most rows one tile holds; `takes` says which row counts this path is used for
# max_rows 64, tiles and launch shape: the winners of bench/gpu_tune.py on an H200, which sweeps them on
# any GPU (figures: docs/benchmarks.md, "GPU: one H200")
CONFIG = {"block_n": 64, "block_k": 256, "num_warps": 8, "num_stages": 4, "programs_per_sm": 2, "max_rows": 64}


def takes(rows: int) -> bool:
    """Whether a product of this many rows goes to this kernel (decode batches up to CONFIG["max_rows"])."""
    return 0 < rows <= min(CONFIG["max_rows"], MAX_ROWS)


@triton.jit
def _fp8_weight_gemm(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, k_per_split, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    k_lo = split * k_per_split
    for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, K), BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * K + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K),
                    other=0.0)  # [BLOCK_K, BLOCK_N] codes
        acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT:  # float32 partial sums [splits, M, N], added by the caller
        tl.store(out_ptr + (split * M + rm[:, None]) * N + rn[None, :], acc, mask=mask)
    else:
        scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0)
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], (acc * scale[None, :]).to(out_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _sum_splits(part_ptr, s_ptr, out_ptr, MN, N, SPLITS, BLOCK: tl.constexpr):
    """out = sum over splits of part [SPLITS, M, N], times the channel scale, in out's dtype: one launch."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < MN
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in range(0, SPLITS):
        acc += tl.load(part_ptr + s * MN + i, mask=m, other=0.0)
    scale = tl.load(s_ptr + i % N, mask=m, other=0.0)
    tl.store(out_ptr + i, (acc * scale).to(out_ptr.dtype.element_ty), mask=m)


def k_splits(n_blocks: int, k: int, block_k: int, device: torch.device, programs_per_sm: int = 2) -> int:
    """Splits of K that give about `programs_per_sm` programs per SM, each split at least four BLOCK_K runs."""
    sms = sm_count(device)
    return max(1, min(-(-programs_per_sm * sms // n_blocks), k // (4 * block_k)))


def fp8_weight_gemm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, block_n: int | None = None,
                    block_k: int | None = None, splits: int | None = None) -> torch.Tensor:
    """x [M, K] (M <= 64) @ (codes [N, K] float8_e4m3fn * scale [N, 1]).T -> [M, N] in x's dtype."""
    M, K = x.shape
    N = codes.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"fp8_weight_gemm takes at most {MAX_ROWS} rows, got {M}")
    bn, bk = block_n or CONFIG["block_n"], block_k or CONFIG["block_k"]
    x = x.contiguous()
    n_blocks = triton.cdiv(N, bn)
    S = splits or k_splits(n_blocks, K, bk, x.device, CONFIG["programs_per_sm"])
    per = triton.cdiv(triton.cdiv(K, S), bk) * bk
    S = triton.cdiv(K, per)  # no empty split
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    block_m = max(16, triton.next_power_of_2(M))
    stages = CONFIG["num_stages"] if block_m <= 16 else min(3, CONFIG["num_stages"])  # taller x tiles: less smem
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    part = torch.empty((S, M, N), dtype=torch.float32, device=x.device) if S > 1 else out
    _fp8_weight_gemm[(n_blocks, S)](x, codes, scale, part, M, N, K, per, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk,
                                    SPLIT=S > 1, PRECISION=precision, num_warps=CONFIG["num_warps"],
                                    num_stages=stages)
    if S > 1:
        _sum_splits[(triton.cdiv(M * N, 1024),)](part, scale, out, M * N, N, S, BLOCK=1024)
    return out
