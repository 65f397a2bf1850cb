"""Fused mixture-of-experts: a grouped GEMM over the tokens routed to each expert.

Dispatch sorts the T*k (token, slot) pairs by expert and pads each expert's run to BLOCK_M, so
every row block of the GEMM belongs to one expert. Three launches of `_grouped_gemm`: gate and up
(the activation applied between launches), then down, which multiplies each row by its router
weight. Combine sums the k rows of each token.

Dispatch never waits for the device: the number of row blocks is an upper bound computed from the
shapes alone (blocks past the last expert's run hold only padding and store nothing), so a decode
step through this path can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _grouped_gemm(a_ptr, b_ptr, out_ptr, pair_ptr, expert_ptr, weight_ptr, N, K, num_pairs, a_row_div,
                  MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PRECISION: tl.constexpr):
    """out[pair, :] = a[pair // a_row_div, :] @ b[expert].T (* weight[pair]) for one expert's row block."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ptr + rows)
    real = pair < num_pairs  # padding rows carry num_pairs
    a_row = tl.where(real, pair // a_row_div, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_row[:, None] * K + ks[None, :], mask=real[:, None] & (ks[None, :] < K), other=0.0)
        b = tl.load(b_ptr + (e * N + cols[None, :]) * K + ks[:, None],
                    mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a, b, input_precision=PRECISION)
    if MUL_WEIGHT:
        acc *= tl.load(weight_ptr + pair, mask=real, other=0.0).to(tl.float32)[:, None]
    mask = real[:, None] & (cols[None, :] < N)
    tl.store(out_ptr + pair.to(tl.int64)[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


# Tiles and warps: the winners of bench/gpu_tune.py on an H200 (docs/benchmarks.md, "GPU"); it sweeps them
# on any GPU and can set them for a run.
CONFIG = {"block_m": 32, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 3}


def max_row_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on sum_e ceil(count_e / block_m) over experts with pairs, from the shapes alone."""
    return -(-num_pairs // block_m) + min(num_experts, num_pairs)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int, first: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair ids sorted by expert, each expert's run padded to block_m with T*k; the expert of each row block.

    Only experts first .. first + num_experts are held here (expert parallelism): pairs routed to
    other experts are left out. Both outputs have a length fixed by the shapes (`max_row_blocks`);
    the row blocks after the last held expert's run are all padding.
    """
    flat = topk_ids.flatten() - first  # [P] local expert ids
    P, E, dev = flat.numel(), num_experts, flat.device
    held = (flat >= 0) & (flat < E)
    key = torch.where(held, flat, E)  # E: held elsewhere, sorts last
    order = key.argsort(stable=True)
    sorted_e = key[order]
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:E] + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded  # [E] first row of each expert's run
    first_pair = torch.cumsum(counts, 0) - counts  # [E + 1] where each expert's pairs start in `order`
    rank_in_expert = torch.arange(P, device=dev) - first_pair[sorted_e]
    blocks = max_row_blocks(P, E, block_m)
    length = blocks * block_m
    dest = torch.where(sorted_e < E, starts[sorted_e.clamp(max=E - 1)] + rank_in_expert, length)
    pairs = torch.full((length + 1,), P, dtype=torch.int64, device=dev)
    pairs[dest] = order  # pairs held elsewhere land in the extra last entry, dropped below
    block_end = torch.cumsum(padded // block_m, 0)  # [E] row blocks up to and including each expert
    experts = torch.searchsorted(block_end, torch.arange(blocks, device=dev), right=True).clamp_(max=E - 1)
    return pairs[:length], experts


def fused_moe(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, act: str = "silu", first: int = 0) -> torch.Tensor:
    """x [T, C]; gate/up [E, I, C]; down [E, C, I]; topk ids/weights [T, k] -> [T, C] (see reference.py).

    With `first`, the weights hold experts first .. first + E and pairs routed elsewhere add nothing.
    The tiles are `CONFIG`'s (bench/gpu_tune.py sets them).
    """
    block_m, block_n, block_k = CONFIG["block_m"], CONFIG["block_n"], CONFIG["block_k"]
    launch = {"num_warps": CONFIG["num_warps"], "num_stages": CONFIG["num_stages"]}
    T, C = x.shape
    E, inter, _ = gate.shape
    k = topk_ids.shape[1]
    P = T * k
    if P == 0:
        return torch.zeros_like(x)
    pairs, experts = align_by_expert(topk_ids, E, block_m, first)
    m_blocks = experts.numel()
    w = topk_weights.flatten().contiguous()
    x = x.contiguous()
    g, u = (torch.empty((P, inter), dtype=x.dtype, device=x.device) for _ in range(2))
    # float32 weights multiply in float32: tl.dot's default on tensor cores is TF32 (10-bit mantissa), which
    # puts float32 runs 1e-3 away from the reference; bf16/f16 inputs are exact products either way
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    for b, out in ((gate, g), (up, u)):
        _grouped_gemm[(m_blocks, triton.cdiv(inter, block_n))](
            x, b.contiguous(), out, pairs, experts, w, inter, C, P, k,
            MUL_WEIGHT=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, **launch)
    a = ((F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")) * u).contiguous()  # [P, I]
    y = torch.zeros((P, C), dtype=x.dtype, device=x.device)  # rows of pairs held elsewhere stay zero
    _grouped_gemm[(m_blocks, triton.cdiv(C, block_n))](
        a, down.contiguous(), y, pairs, experts, w, C, inter, P, 1,
        MUL_WEIGHT=True, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, **launch)
    return y.view(T, k, C).sum(dim=1)
