"""Plain-torch references for the triton kernels: the definitions the kernels are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_residual_ref(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual; returns (rms_norm(h) * w, h), the norm computed in float32."""
    h = x + residual
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * w.float()
    return y.to(x.dtype), h


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                               scale: float, window: int | None = None) -> torch.Tensor:
    """One query per sequence over its paged KV: q [B, H, D]; k/v_cache [slots, Hkv, D]; block_tables
    [B, max_blocks]; context_lens [B] (query at len - 1) -> [B, H, D]."""
    B, H, D = q.shape
    Hkv = k_cache.shape[1]
    out = torch.empty_like(q)
    for b in range(B):
        n = int(context_lens[b])
        pos = torch.arange(n, device=q.device)
        slots = block_tables[b, pos // block_size].long() * block_size + pos % block_size
        k = k_cache[slots].float().repeat_interleave(H // Hkv, dim=1)  # [n, H, D]
        v = v_cache[slots].float().repeat_interleave(H // Hkv, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale  # [H, n]
        if window is not None:
            s[:, pos <= n - 1 - window] = float("-inf")
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), v).to(q.dtype)
    return out


def fused_moe_ref(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                  topk_ids: torch.Tensor, topk_weights: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """sum_k w[t, k] * down[e] @ (act(gate[e] @ x[t]) * (up[e] @ x[t])), e = topk_ids[t, k].
    x [T, C]; gate/up [E, I, C]; down [E, C, I]; topk_ids/topk_weights [T, k] -> [T, C]."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = x.float()
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            g = F.linear(xf[t], gate[e].float())
            g = F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")
            h = g * F.linear(xf[t], up[e].float())
            out[t] += topk_weights[t, j].float() * F.linear(h, down[e].float())
    return out.to(x.dtype)
