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

from twinfer.quant.linear import QuantizedExperts, QuantizedWeight
from twinfer.runtime.batch import StepBatch
from twinfer.runtime.ops import ExpertExtras, selected
from twinfer.runtime.rope import attention_factor, inv_freq
from twinfer.runtime.spec import LINEAR, SIGMOID, ModelSpec, MoESpec
from twinfer.runtime.vision.rows import bidirectional_spans, feature_rows


@dataclass(frozen=True)
class ExpertStack:
    """The routed experts held here, stacked: gate/up [E, I, C], down [E, C, I]; local expert e is the
    model's expert `first + e` (expert parallelism holds a contiguous slice)."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    first: int = 0


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
    # pure decode steps on the triton path (one token per sequence): the paged-attention kernel's inputs
    block_tables: torch.Tensor | None = None  # [B, W] int32 KV block ids, 0 where padded
    context_lens: torch.Tensor | None = None  # [B] int32 positions each query attends to (its own included)
    state: Any = None  # the recurrent-state slots of the batch (recurrent.StateStep), for LINEAR layers
    images: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (first row, features [n, C])
    image_spans: tuple[torch.Tensor, torch.Tensor] | None = None  # [B, Tq] key positions [lo, hi) seen both ways


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
        layers: range | None = None,
        kv_format: str | None = None,
        kernels: str | None = None,
        packed_weights: bool = False,
    ):
        """`layers`: the layers whose KV this process stores (a pipeline stage's); default all.
        `kernels`: "auto" (triton on CUDA), "triton" or "torch" (kernels/__init__.py).
        `packed_weights`: keep published fp8/nvfp4/mxfp4 weights in their bytes (the datacenter target)."""
        self.packed_weights = packed_weights
        from twinfer.backends.cuda.kernels import load_kernels, select_kernels

        self.spec = spec
        self.device = torch.device(device)
        self.kernels = select_kernels(kernels, self.device.type)
        self._k = load_kernels() if self.kernels == "triton" else None
        self.dtype = dtype
        self.block_size = block_size
        slots = num_blocks * block_size
        mine = set(range(spec.num_layers) if layers is None else layers) - {
            i for i, t in enumerate(spec.attention_types) if t == LINEAR}  # recurrent layers keep no KV

        def cache(heads: int | None, dim: int | None) -> list[torch.Tensor]:
            """None: each layer's own (kv_heads_for, head_dim_for); a layer reading another's KV holds none."""
            return [torch.zeros((slots if i in mine and spec.owns_kv(i) else 0,
                                 spec.kv_heads_for(i) if heads is None else heads,
                                 spec.head_dim_for(i) if dim is None else dim), dtype=dtype, device=self.device)
                    for i in range(spec.num_layers)]

        # a TurboQuant KV format ("tq4", "tq2.5", "tq3-qjl") codes K/V per head (backends/cuda/quant.py)
        self.kv_quant = _tq_kv_caches(spec, kv_format, slots, self.device, dtype)
        if self.kv_quant:
            mine = set()
        if spec.mla is not None:  # one latent per token, shared by the heads; no separate values
            self.k_cache, self.v_cache = cache(1, spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim), cache(1, 0)
            if spec.dsa is not None:  # sparse attention: the indexer's key per token, in the values' place
                dsa = spec.dsa
                self.v_cache = [c.new_zeros((c.shape[0], 1, dsa.head_dim)) if dsa.has_indexer(i) else c
                                for i, c in enumerate(self.v_cache)]
        else:
            self.k_cache, self.v_cache = cache(None, None), cache(None, None)
        self._inv_freq = [torch.from_numpy(inv_freq(spec, i)).to(self.device) for i in range(spec.num_layers)]
        self._rope_factor = [attention_factor(spec, i) for i in range(spec.num_layers)]
        self.states = None
        if spec.recurrent:
            from twinfer.backends.cuda.recurrent import TorchStates

            self.states = TorchStates(spec, self.device, dtype)

    @property
    def kv_bytes(self) -> int:
        """Bytes of the KV caches this process holds: dense K/V, or TurboQuant's packed codes and norms."""
        return sum(t.nbytes for t in (*self.k_cache, *self.v_cache)) + sum(c.nbytes for c in self.kv_quant)

    # -- step setup ----------------------------------------------------------------------------
    def begin_step(self, batch: StepBatch, table_width: int | None = None) -> TorchStep:
        """`table_width`: pad decode block tables to this many blocks (fixed shapes for CUDA graphs)."""
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

        tables = lens = None
        spans = bidirectional_spans(batch, Tq)
        if self._decode_kernel_applies(batch):
            block_tables, context_lens = self._paged_inputs(batch, table_width)
            tables, lens = up(block_tables), up(context_lens)
        return TorchStep(
            state=self.states.bind(batch) if self.states is not None else None,
            block_tables=tables,
            context_lens=lens,
            tokens=up(np.asarray(batch.token_ids(), dtype=np.int64)),
            positions=up(np.asarray(batch.positions(), dtype=np.int64)),
            slots=up(np.asarray(batch.slot_mapping(bs), dtype=np.int64)),
            q_index=up(q_index),
            q_valid=up(q_valid),
            q_pos=up(q_pos),
            kv_slots=up(kv_slots),
            rows=up(np.asarray(batch.logit_token_index(), dtype=np.int64)),
            images=feature_rows(batch),
            image_spans=None if spans is None else (up(spans[0]), up(spans[1])),
        )

    def decode_inputs(self, batch: StepBatch, table_width: int) -> dict[str, np.ndarray]:
        """What a CUDA-graph replay of a pure decode step reads (graphs.STATIC_INPUTS), built on the host.

        The replay copies these into the graph's own tensors; the gather indices and masks that an
        eager step also builds ([B, L] KV slots for a 1,024-token context at batch 64: 0.5 MB) are not
        read by the paged-attention kernel, so they are neither built nor uploaded.
        """
        tables, lens = self._paged_inputs(batch, table_width)
        return {"tokens": np.asarray(batch.token_ids(), dtype=np.int64),
                "positions": np.asarray(batch.positions(), dtype=np.int64),
                "slots": np.asarray(batch.slot_mapping(self.block_size), dtype=np.int64),
                "block_tables": tables, "context_lens": lens}

    def _paged_inputs(self, batch: StepBatch, table_width: int | None) -> tuple[np.ndarray, np.ndarray]:
        """The paged-attention kernel's block tables [B, width] (int32, 0 where padded; width: the widest
        sequence's blocks unless given) and context lengths [B] (int32)."""
        chunks, bs = batch.chunks, self.block_size
        width = table_width or max(-(-c.end // bs) for c in chunks)
        tables = np.zeros((len(chunks), width), dtype=np.int32)
        for b, c in enumerate(chunks):
            n = -(-c.end // bs)
            tables[b, :n] = c.block_table[:n]
        return tables, np.asarray([c.end for c in chunks], dtype=np.int32)

    def _decode_kernel_applies(self, batch: StepBatch) -> bool:
        """Pure decode on the triton path, with a head dim the kernel tiles (a power of two)."""
        dims = {self.spec.head_dim_for(i) for i in range(self.spec.num_layers)}
        plain = self.spec.mla is None and not self.spec.attention_sinks
        return (self._k is not None and plain and not self.kv_quant and all(D & (D - 1) == 0 for D in dims)
                and all(len(c.tokens) == 1 for c in batch.chunks))

    def weight(self, name: str, value: Any) -> Any:
        if isinstance(value, (QuantizedWeight, QuantizedExperts)):
            from twinfer.backends.cuda.quant import torch_weight

            return torch_weight(value, self.device, self.dtype, packed=self.packed_weights)
        return torch.as_tensor(np.ascontiguousarray(value)).to(self.device, self.dtype)

    # -- elementwise and dense -----------------------------------------------------------------
    def embedding(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, table)

    def linear(self, x: torch.Tensor, w: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(w, torch.Tensor):  # a quantized weight (backends/cuda/quant.py) runs itself
            out: torch.Tensor = w(x, bias)
            return out
        return F.linear(x, w, bias)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        if self._k is not None:
            y: torch.Tensor = self._k.rms_norm(x, w, eps)
            return y
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (xf * w.float()).to(x.dtype)

    def layer_norm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
        return F.layer_norm(x.float(), x.shape[-1:], w.float(), b.float(), eps).to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, w: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, rms_norm(x + delta) * w): the residual add fused into the norm on the triton path."""
        if self._k is not None and x.dim() == 2:
            y, h = self._k.rms_norm_residual(x, delta, w, eps)
            return h, y
        h = x + delta
        return h, self.rms_norm(h, w, eps)

    def act(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        if kind == "silu":
            return F.silu(x)
        if kind == "gelu_tanh":
            return F.gelu(x, approximate="tanh")
        if kind == "gelu":
            return F.gelu(x)
        if kind == "sigmoid":
            return torch.sigmoid(x)
        raise ValueError(f"unknown activation {kind!r}")

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        return torch.tanh(x / cap) * cap

    def rope(self, x: torch.Tensor, ctx: TorchStep, layer: int) -> torch.Tensor:
        cos, sin = self._rope_table(ctx, layer)  # [T, 1, R]
        R = cos.shape[-1]
        if self._k is not None and self._k.rope_applies(x, R):
            return self._k.rope(x, cos, sin)  # type: ignore[no-any-return]
        if x.shape[-1] > R:  # partial rotary: the dims past R pass through
            return torch.cat((self._rotate(x[..., :R], cos, sin), x[..., R:]), dim=-1)
        return self._rotate(x, cos, sin)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos + rotated * sin).to(x.dtype)

    def _rope_table(self, ctx: TorchStep, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self._inv_freq[layer]
        key = ("rope", self.spec.rope_base(layer), self.spec.rope_scaling_for(layer) is not None)
        if key not in ctx.cache:
            freqs = ctx.positions.float()[:, None] * inv[None, :]  # [T, R/2]
            emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, R]
            f = self._rope_factor[layer]
            ctx.cache[key] = torch.stack((emb.cos() * f, emb.sin() * f)) if f != 1.0 else torch.stack((emb.cos(), emb.sin()))
        table = ctx.cache[key]
        return table[0], table[1]

    def head_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.einsum("thi,hoi->tho", x, w)

    # -- attention -----------------------------------------------------------------------------
    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: TorchStep, layer: int,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if sinks is not None:
            return self._sink_attention(q, k, v, ctx, layer, sinks)
        if self.kv_quant:
            mask = self._mask(ctx, self.spec.window(layer))
            return self.kv_quant[layer].attention(q, k, v, ctx, mask, self.spec.attention_scale)
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        if k is not None:  # None: the layer reads an earlier layer's KV (ModelSpec.kv_source)
            k_cache.index_copy_(0, ctx.slots, k.to(k_cache.dtype))
            v_cache.index_copy_(0, ctx.slots, v.to(v_cache.dtype))
        if ctx.block_tables is not None and self._k is not None:  # decode: one query per sequence, T == B
            out: torch.Tensor = self._k.paged_decode_attention(
                q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, self.block_size,
                self.spec.attention_scale, self.spec.window(layer))
            return out  # [T, H, D]
        Q = q[ctx.q_index].transpose(1, 2)  # [B, H, Tq, D]
        K = k_cache[ctx.kv_slots].transpose(1, 2)  # [B, Hkv, L, D]
        V = v_cache[ctx.kv_slots].transpose(1, 2)
        mask = self._mask(ctx, self.spec.window(layer))  # [B, 1, Tq, L]
        out = F.scaled_dot_product_attention(
            Q, K, V, attn_mask=mask, scale=self.spec.attention_scale, enable_gqa=True
        )  # [B, H, Tq, D]
        return out.transpose(1, 2)[ctx.q_valid]  # [T, H, D]

    def encoder_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        Q, K, V = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, H, T, D]
        return F.scaled_dot_product_attention(Q, K, V, scale=scale)[0].transpose(0, 1)  # [T, H, D]

    def _sink_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: TorchStep, layer: int,
                        sinks: torch.Tensor) -> torch.Tensor:
        """Attention whose softmax also counts one learned logit per head (`sinks` [H]) that attends to nothing."""
        if self.kv_quant:
            raise ValueError("attention sinks do not run on a TurboQuant KV cache; use a dense KV format")
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        k_cache.index_copy_(0, ctx.slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, ctx.slots, v.to(v_cache.dtype))
        H, Hkv = q.shape[1], k.shape[1]
        Q = q[ctx.q_index].transpose(1, 2)  # [B, H, Tq, D]
        K = k_cache[ctx.kv_slots].transpose(1, 2).repeat_interleave(H // Hkv, dim=1)  # [B, H, L, D]
        V = v_cache[ctx.kv_slots].transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
        scores = (Q @ K.transpose(-1, -2)) * self.spec.attention_scale  # [B, H, Tq, L]
        scores = scores.masked_fill(~self._mask(ctx, self.spec.window(layer)), float("-inf"))
        sink = sinks.reshape(1, H, 1, 1).to(scores.dtype).expand(*scores.shape[:-1], 1)
        probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
        return (probs @ V).transpose(1, 2)[ctx.q_valid]  # [T, H, D]

    def latent_attention(self, q: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                         ctx: TorchStep, layer: int, selection: int | None = None) -> torch.Tensor:
        assert self.spec.mla is not None
        if self.kv_quant:
            raise ValueError("latent attention does not run on a TurboQuant KV cache; use a dense KV format")
        cache = self.k_cache[layer]  # [slots, 1, R + P]
        cache.index_copy_(0, ctx.slots, torch.cat((latent, k_rope), dim=-1)[:, None].to(cache.dtype))
        Q = torch.cat((q, q_rope), dim=-1)[ctx.q_index].transpose(1, 2)  # [B, H, Tq, R + P]
        K = cache[ctx.kv_slots].transpose(1, 2)  # [B, 1, L, R + P]
        V = K[..., : self.spec.mla.kv_lora_rank]  # [B, 1, L, R]
        mask = self._mask(ctx, self.spec.window(layer))
        if selection is not None:  # sparse attention: only the tokens the indexer chose
            mask = mask & selected(ctx.cache, layer, selection)
        B, H, Tq, _ = Q.shape
        if Tq == 1:  # decode: every head attends to the one latent head, so fold the heads into query rows
            # (SDPA's enable_gqa would expand K/V to all H heads: 128 copies of the latent cache at batch 64)
            out = F.scaled_dot_product_attention(
                Q.reshape(B, 1, H, -1), K, V, attn_mask=mask, scale=self.spec.attention_scale
            ).reshape(B, H, 1, -1)  # [B, H, 1, R]; mask [B, 1, 1, L] broadcasts over the folded rows
        else:
            out = F.scaled_dot_product_attention(
                Q, K, V, attn_mask=mask, scale=self.spec.attention_scale, enable_gqa=True
            )  # [B, H, Tq, R]
        return out.transpose(1, 2)[ctx.q_valid]  # [T, H, R]

    def indexer_topk(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, ctx: TorchStep, layer: int,
                     top_k: int) -> None:
        cache = self.v_cache[layer]  # [slots, 1, D]: the indexer's keys, on the latents' slots
        cache.index_copy_(0, ctx.slots, k[:, None].to(cache.dtype))
        K = cache[ctx.kv_slots][:, :, 0].float()  # [B, L, D]
        scores = torch.einsum("bthd,bld->bthl", q[ctx.q_index].float(), K).relu()  # [B, Tq, Hi, L]
        index = torch.einsum("bth,bthl->btl", weights[ctx.q_index].float(), scores)  # [B, Tq, L]
        causal = self._mask(ctx, None)[:, 0]  # [B, Tq, L]
        index = index.masked_fill(~causal, float("-inf"))
        top = index.topk(min(top_k, index.shape[-1]), dim=-1).indices  # [B, Tq, k]
        chosen = torch.zeros_like(causal).scatter_(-1, top, True) & causal  # fewer than k visible: all of them
        ctx.cache[("selection", layer)] = chosen[:, None]  # [B, 1, Tq, L], like the causal mask

    def _mask(self, ctx: TorchStep, window: int | None) -> torch.Tensor:
        key = ("mask", window)
        if key not in ctx.cache:
            L = ctx.kv_slots.shape[1]
            kpos = torch.arange(L, device=self.device)[None, None, :]  # [1, 1, L]
            qpos = ctx.q_pos[:, :, None]  # [B, Tq, 1]
            mask = kpos <= qpos
            if ctx.image_spans is not None:  # a bidirectional image's positions also see the ones after them
                lo, hi = ctx.image_spans
                mask |= (kpos >= lo[:, :, None]) & (kpos < hi[:, :, None])
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
        extras: ExpertExtras | None = None,
    ) -> torch.Tensor:
        weights, experts = self.route(x, router, moe, extras)
        return self.experts(x, weights, experts, ExpertStack(gate, up, down), act, moe=moe, extras=extras)

    def route(self, x: torch.Tensor, router: torch.Tensor, moe: MoESpec, extras: ExpertExtras | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k expert ids [T, k] and their weights [T, k] (x's dtype)."""
        scored = x if extras is None or extras.router_input is None else extras.router_input
        logits = F.linear(scored, router, extras.router_bias if extras else None).float()  # [T, E]
        if moe.scoring == SIGMOID:
            weights, experts = _sigmoid_route(logits, moe, extras.score_bias if extras else None)
        else:
            probs = F.softmax(logits, dim=-1)
            weights, experts = probs.topk(moe.top_k, dim=-1)  # [T, k]
            if moe.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
        if moe.routed_scaling_factor != 1.0:
            weights = weights * moe.routed_scaling_factor
        if extras is not None and extras.expert_scale is not None:
            weights = weights * extras.expert_scale.float()[experts]
        return weights.to(x.dtype), experts

    def experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, stack: ExpertStack, act: str,
                moe: MoESpec | None = None, extras: ExpertExtras | None = None) -> torch.Tensor:
        """Sum of the routed experts held here (`stack`: ids first .. first + len(gate)) over x [T, C];
        weights/experts [T, k] are the routing.

        Dispatch: sort the (token, slot) pairs by expert; combine: index_add the weighted outputs.
        On the triton path one fused grouped GEMM does both, without waiting for the device.
        `moe`/`extras` carry the expert biases and gpt-oss's clamped SwiGLU, which only the loop runs.
        """
        gate, up, down, first = stack.gate, stack.up, stack.down, stack.first
        plain = (moe is None or moe.swiglu_limit is None) and (extras is None or extras.gate_bias is None)
        if plain and self._k is not None and all(isinstance(t, torch.Tensor) for t in (gate, up, down)):
            fused: torch.Tensor = self._k.fused_moe(x, gate, up, down, experts, weights, act, first=first)
            return fused
        out = torch.zeros_like(x)
        k = experts.shape[1]
        flat = experts.flatten() - first  # local expert ids; other ranks' experts fall outside
        order = flat.argsort(stable=True)
        held = (flat >= 0) & (flat < gate.shape[0])
        counts = torch.bincount(flat[held], minlength=gate.shape[0]).tolist()  # routing is data-dependent
        start = int((flat < 0).sum()) if first else 0  # sorted ids below ours come first
        for e, n in enumerate(counts):
            if n == 0:
                continue
            picks = order[start : start + n]
            start += n
            tok = picks // k
            y = self._expert(x[tok], e, stack, act, moe, extras)
            out.index_add_(0, tok, y * weights.flatten()[picks, None])
        return out

    def _expert(self, h: torch.Tensor, e: int, stack: ExpertStack, act: str, moe: MoESpec | None,
                extras: ExpertExtras | None) -> torch.Tensor:
        """Local expert `e` of `stack` over its tokens' rows h [n, C] -> [n, C]."""
        def bias(b: torch.Tensor | None) -> torch.Tensor | None:
            return None if b is None else b[e]  # biases are held like the experts: local ids

        xb = extras or ExpertExtras()
        g = F.linear(h, stack.gate[e], bias(xb.gate_bias))
        u = F.linear(h, stack.up[e], bias(xb.up_bias))
        if moe is not None and moe.swiglu_limit is not None:  # gpt-oss
            limit = moe.swiglu_limit
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            a = g * torch.sigmoid(g * moe.swiglu_alpha) * (u + 1)
        else:
            a = self.act(g, act) * u
        return F.linear(a, stack.down[e], bias(xb.down_bias))

    # -- linear attention (recurrent.py) ------------------------------------------------------------
    def causal_conv1d(self, x: torch.Tensor, w: torch.Tensor, ctx: TorchStep, layer: int) -> torch.Tensor:
        assert self.states is not None
        return self.states.causal_conv1d(x, w, ctx, layer)

    def gated_delta(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    decay: torch.Tensor, dt_bias: torch.Tensor, ctx: TorchStep, layer: int) -> torch.Tensor:
        assert self.states is not None
        return self.states.gated_delta(q, k, v, a, b, decay, dt_bias, ctx, layer)

    def release_state(self, seq_id: int) -> None:
        if self.states is not None:
            self.states.release(seq_id)

    # -- output --------------------------------------------------------------------------------
    def select_rows(self, x: torch.Tensor, ctx: TorchStep) -> torch.Tensor:
        return x[ctx.rows]

    def to_host(self, x: torch.Tensor) -> np.ndarray:
        return x.float().cpu().numpy()


def _sigmoid_route(logits: torch.Tensor, moe: MoESpec, score_bias: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / GLM-4.5 routing: sigmoid scores, best groups, top-k by score + bias (see MoESpec)."""
    T, E = logits.shape
    scores = logits.sigmoid()  # [T, E]
    choice = scores if score_bias is None else scores + score_bias.float()
    groups = choice.reshape(T, moe.n_group, E // moe.n_group)  # [T, G, E/G]
    group_scores = groups.topk(2, dim=-1)[0].sum(-1)  # [T, G]
    best = group_scores.topk(moe.topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    choice = choice.masked_fill(~keep.repeat_interleave(E // moe.n_group, dim=1), 0.0)
    experts = choice.topk(moe.top_k, dim=-1, sorted=False)[1]  # [T, k]
    weights = scores.gather(1, experts)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights, experts


def _tq_kv_caches(
    spec: ModelSpec, kv_format: str | None, slots: int, device: torch.device, dtype: torch.dtype
) -> list[Any]:
    """One coded KV cache per layer for a TurboQuant `kv_format` ("tq4", "tq2.5", "tq3-qjl"), else []."""
    from twinfer.quant.kv_format import parse_kv_format

    fmt = parse_kv_format(kv_format)
    if fmt is None:
        return []
    from twinfer.backends.cuda.quant import TorchTQKV

    if spec.kv_shared_layers:
        raise ValueError(f"KV format {kv_format!r} does not run layers that share KV; use a dense KV format")
    return [TorchTQKV(fmt, i, slots, spec.kv_heads_for(i), spec.head_dim_for(i), device, dtype)
            for i in range(spec.num_layers)]
