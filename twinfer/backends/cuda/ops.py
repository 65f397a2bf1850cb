"""Ops over torch: runs every architecture on any torch device (CUDA on servers, CPU in tests).

KV cache: one flat tensor per layer of `num_blocks * block_size` slots, [slots, Hkv, D]. A step
writes its new keys and values at the slots the block tables give, then gathers each sequence's
slots into a padded [B, L] view and runs one masked scaled-dot-product attention for the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from twinfer.runtime.batch import StepBatch
from twinfer.runtime.rope import inv_freq
from twinfer.runtime.spec import ModelSpec, MoESpec


@dataclass
class TorchStep:
    """Device-side view of one StepBatch (see Ops.begin_step)."""

    tokens: torch.Tensor  # [T] token ids
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] KV slot of each new token
    q_index: torch.Tensor  # [B, Tq] index into T of each sequence's tokens (padded)
    q_valid: torch.Tensor  # [B, Tq] which entries of q_index are real
    q_pos: torch.Tensor  # [B, Tq] positions of the queries (0 where padded)
    kv_slots: torch.Tensor  # [B, L] KV slot of each context position (0 where padded)
    rows: torch.Tensor  # [R] index into T of the rows that need logits
    cache: dict[Any, torch.Tensor] = field(default_factory=dict)  # masks and rope tables, per step


class TorchOps:
    """The torch implementation of `twinfer.runtime.ops.Ops`."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        num_blocks: int,
        block_size: int,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        self.spec = spec
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = block_size
        slots = num_blocks * block_size
        shape = (slots, spec.num_kv_heads, spec.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(spec.num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(spec.num_layers)]
        self._inv_freq = [torch.from_numpy(inv_freq(spec, i)).to(self.device) for i in range(spec.num_layers)]

    # -- step setup ----------------------------------------------------------------------------
    def begin_step(self, batch: StepBatch) -> TorchStep:
        chunks = batch.chunks
        B = len(chunks)
        Tq = max(len(c.tokens) for c in chunks)
        L = max(c.end for c in chunks)
        q_index = np.zeros((B, Tq), dtype=np.int64)
        q_valid = np.zeros((B, Tq), dtype=bool)
        q_pos = np.zeros((B, Tq), dtype=np.int64)
        kv_slots = np.zeros((B, L), dtype=np.int64)
        offset = 0
        bs = self.block_size
        for b, c in enumerate(chunks):
            n = len(c.tokens)
            q_index[b, :n] = np.arange(offset, offset + n)
            q_valid[b, :n] = True
            q_pos[b, :n] = np.arange(c.start, c.end)
            pos = np.arange(c.end)
            table = np.asarray(c.block_table, dtype=np.int64)
            kv_slots[b, : c.end] = table[pos // bs] * bs + pos % bs
            offset += n
        dev = self.device

        def up(a: Any) -> torch.Tensor:
            return torch.as_tensor(np.asarray(a)).to(dev, non_blocking=True)

        return TorchStep(
            tokens=up(np.asarray(batch.token_ids(), dtype=np.int64)),
            positions=up(np.asarray(batch.positions(), dtype=np.int64)),
            slots=up(np.asarray(batch.slot_mapping(bs), dtype=np.int64)),
            q_index=up(q_index),
            q_valid=up(q_valid),
            q_pos=up(q_pos),
            kv_slots=up(kv_slots),
            rows=up(np.asarray(batch.logit_token_index(), dtype=np.int64)),
        )

    def weight(self, name: str, value: Any) -> torch.Tensor:
        return torch.as_tensor(np.ascontiguousarray(value)).to(self.device, self.dtype)

    # -- elementwise and dense -----------------------------------------------------------------
    def embedding(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, table)

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, w, bias)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (xf * w.float()).to(x.dtype)

    def act(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        if kind == "silu":
            return F.silu(x)
        if kind == "gelu_tanh":
            return F.gelu(x, approximate="tanh")
        raise ValueError(f"unknown activation {kind!r}")

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        return torch.tanh(x / cap) * cap

    def rope(self, x: torch.Tensor, ctx: TorchStep, layer: int) -> torch.Tensor:
        cos, sin = self._rope_table(ctx, layer)  # [T, 1, D]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos + rotated * sin).to(x.dtype)

    def _rope_table(self, ctx: TorchStep, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self._inv_freq[layer]
        key = ("rope", self.spec.rope_base(layer), self.spec.rope_scaling_for(layer) is not None)
        if key not in ctx.cache:
            freqs = ctx.positions.float()[:, None] * inv[None, :]  # [T, D/2]
            emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
            ctx.cache[key] = torch.stack((emb.cos(), emb.sin()))
        table = ctx.cache[key]
        return table[0], table[1]

    # -- attention -----------------------------------------------------------------------------
    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: TorchStep, layer: int
    ) -> torch.Tensor:
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        k_cache.index_copy_(0, ctx.slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, ctx.slots, v.to(v_cache.dtype))
        Q = q[ctx.q_index].transpose(1, 2)  # [B, H, Tq, D]
        K = k_cache[ctx.kv_slots].transpose(1, 2)  # [B, Hkv, L, D]
        V = v_cache[ctx.kv_slots].transpose(1, 2)
        mask = self._mask(ctx, self.spec.window(layer))  # [B, 1, Tq, L]
        out = F.scaled_dot_product_attention(
            Q, K, V, attn_mask=mask, scale=self.spec.attention_scale, enable_gqa=True
        )  # [B, H, Tq, D]
        return out.transpose(1, 2)[ctx.q_valid]  # [T, H, D]

    def _mask(self, ctx: TorchStep, window: int | None) -> torch.Tensor:
        key = ("mask", window)
        if key not in ctx.cache:
            L = ctx.kv_slots.shape[1]
            kpos = torch.arange(L, device=self.device)[None, None, :]  # [1, 1, L]
            qpos = ctx.q_pos[:, :, None]  # [B, Tq, 1]
            mask = kpos <= qpos
            if window is not None:
                mask &= kpos > qpos - window
            ctx.cache[key] = mask[:, None]
        return ctx.cache[key]

    # -- mixture of experts --------------------------------------------------------------------
    def moe(
        self,
        x: torch.Tensor,
        router: torch.Tensor,
        gate: torch.Tensor,
        up: torch.Tensor,
        down: torch.Tensor,
        moe: MoESpec,
        act: str,
    ) -> torch.Tensor:
        probs = F.softmax(F.linear(x, router).float(), dim=-1)  # [T, E]
        weights, experts = probs.topk(moe.top_k, dim=-1)  # [T, k]
        if moe.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=gate.shape[0]).tolist()  # routing is data-dependent
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            picks = order[start : start + n]
            start += n
            tok = picks // moe.top_k
            h = x[tok]
            y = F.linear(self.act(F.linear(h, gate[e]), act) * F.linear(h, up[e]), down[e])
            out.index_add_(0, tok, y * weights.flatten()[picks, None])
        return out

    # -- output --------------------------------------------------------------------------------
    def select_rows(self, x: torch.Tensor, ctx: TorchStep) -> torch.Tensor:
        return x[ctx.rows]

    def to_host(self, x: torch.Tensor) -> np.ndarray:
        return x.float().cpu().numpy()
