"""Ops over MLX: runs every architecture on Apple silicon (Metal) and, through mlx[cpu], on any CPU.

KV cache: the torch backend's layout ([slots, Hkv, D] per layer, gathered into a padded [B, L] view).
MLX is lazy: a cache write makes a new array, and `to_host` evaluates the logits and every cache in one
`mx.eval`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from twinfer.quant.linear import QuantizedExperts, QuantizedWeight
from twinfer.runtime.batch import StepBatch
from twinfer.runtime.ops import ExpertExtras, selected
from twinfer.runtime.rope import attention_factor, inv_freq
from twinfer.runtime.spec import LINEAR, SIGMOID, ModelSpec, MoESpec
from twinfer.runtime.vision.rows import bidirectional_spans, feature_rows

DTYPES: dict[str, mx.Dtype] = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}

# Below this many (token, expert) pairs gather_mm is run unsorted; above it, sorting the pairs by
# expert lets each expert's weights be read once (the same threshold as mlx-lm's SwitchGLU).
_SORT_MOE_PAIRS = 64
_GELU_BETA = math.sqrt(2.0 / math.pi)


def mlx_dtype(dtype: str | mx.Dtype) -> mx.Dtype:
    """ "float32" / "bfloat16" / "float16" (or an mx.Dtype) -> mx.Dtype."""
    if isinstance(dtype, mx.Dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported MLX dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


@dataclass
class MlxStep:
    """Device-side view of one StepBatch (see Ops.begin_step)."""

    tokens: mx.array  # [T] token ids
    positions: mx.array  # [T]
    slots: mx.array  # [T] KV slot of each new token
    q_index: mx.array  # [B, Tq] index into T of each sequence's tokens (padded with 0)
    q_pos: mx.array  # [B, Tq] positions of the queries (0 where padded)
    q_flat: mx.array  # [T] index into the flattened [B * Tq] padded view of each real token
    kv_slots: mx.array  # [B, L] KV slot of each context position (0 where padded)
    rows: mx.array  # [R] index into T of the rows that need logits
    cache: dict[Any, mx.array] = field(default_factory=dict)  # masks and rope tables, per step
    state: Any = None  # the recurrent-state slots of the batch (recurrent.MlxStateStep), for LINEAR layers
    images: list[tuple[int, mx.array]] = field(default_factory=list)  # (first row, features [n, C])
    image_spans: tuple[mx.array, mx.array] | None = None  # [B, Tq] key positions [lo, hi) seen both ways


class MlxOps:
    """The MLX implementation of `twinfer.runtime.ops.Ops`."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        num_blocks: int,
        block_size: int,
        dtype: str | mx.Dtype = "float32",
        kv_format: str | None = None,
    ):
        self.spec = spec
        self.dtype = mlx_dtype(dtype)
        self.block_size = block_size
        slots = num_blocks * block_size
        shape = (slots, spec.num_kv_heads, spec.head_dim)
        v_shape = shape
        if spec.mla is not None:  # one latent per token, shared by the heads; no separate values
            shape, v_shape = (slots, 1, spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim), (0, 1, 0)
        # a TurboQuant KV format ("tq4", "tq2.5", "tq3-qjl") codes K/V per head (backends/metal/quant.py)
        self.kv_quant = _tq_kv_caches(spec, kv_format, slots, self.dtype)
        dense = [] if self.kv_quant else spec.attention_types
        none = (0, *shape[1:])  # recurrent layers keep no KV
        self.k_cache = [mx.zeros(shape if t != LINEAR else none, dtype=self.dtype) for t in dense]
        self.v_cache = [mx.zeros(v_shape if t != LINEAR else none, dtype=self.dtype) for t in dense]
        self.states = None
        if spec.recurrent:
            from twinfer.backends.metal.recurrent import MlxStates

            self.states = MlxStates(spec, self.dtype)
        if spec.dsa is not None and self.v_cache:  # sparse attention: the indexer's key per token, in the values' place
            dsa = spec.dsa
            self.v_cache = [mx.zeros((slots, 1, dsa.head_dim), dtype=self.dtype) if dsa.has_indexer(i) else c
                            for i, c in enumerate(self.v_cache)]
        if spec.mla is None and self.k_cache:  # each layer's own shape; a layer reading another's KV holds none
            self.k_cache = [mx.zeros(_kv_shape(spec, i, c.shape[0]), dtype=self.dtype) for i, c in enumerate(self.k_cache)]
            self.v_cache = [mx.zeros(_kv_shape(spec, i, c.shape[0]), dtype=self.dtype) for i, c in enumerate(self.v_cache)]
        self._inv_freq = [mx.array(inv_freq(spec, i)) for i in range(spec.num_layers)]
        self._rope_factor = [attention_factor(spec, i) for i in range(spec.num_layers)]
        self._gather_mm_f32 = mx.default_device().type == mx.cpu
        mx.eval(self.k_cache, self.v_cache)

    @property
    def kv_bytes(self) -> int:
        """Bytes of the KV caches this process holds: dense K/V, or TurboQuant's packed codes and norms."""
        return sum(a.nbytes for a in (*self.k_cache, *self.v_cache)) + sum(c.nbytes for c in self.kv_quant)

    # -- step setup ----------------------------------------------------------------------------
    def begin_step(self, batch: StepBatch) -> MlxStep:
        chunks = batch.chunks
        B = len(chunks)
        Tq = max(len(c.tokens) for c in chunks)
        L = max(c.end for c in chunks)
        q_index = np.zeros((B, Tq), dtype=np.int32)
        q_pos = np.zeros((B, Tq), dtype=np.int32)
        q_flat = np.zeros(batch.num_tokens, dtype=np.int32)
        kv_slots = np.zeros((B, L), dtype=np.int32)
        offset = 0
        bs = self.block_size
        for b, c in enumerate(chunks):
            n = len(c.tokens)
            q_index[b, :n] = np.arange(offset, offset + n)
            q_pos[b, :n] = np.arange(c.start, c.end)
            q_flat[offset : offset + n] = np.arange(b * Tq, b * Tq + n)
            pos = np.arange(c.end)
            table = np.asarray(c.block_table, dtype=np.int32)
            kv_slots[b, : c.end] = table[pos // bs] * bs + pos % bs
            offset += n

        def up(values: Any) -> mx.array:
            return mx.array(np.asarray(values, dtype=np.int32))

        spans = bidirectional_spans(batch, Tq)
        return MlxStep(
            images=feature_rows(batch),
            image_spans=None if spans is None else (up(spans[0]), up(spans[1])),
            tokens=up(batch.token_ids()),
            positions=up(batch.positions()),
            slots=up(batch.slot_mapping(bs)),  # also checks that the block tables are long enough
            q_index=up(q_index),
            q_pos=up(q_pos),
            q_flat=up(q_flat),
            kv_slots=up(kv_slots),
            rows=up(batch.logit_token_index()),
            state=self.states.bind(batch) if self.states is not None else None,
        )

    def weight(self, name: str, value: Any) -> Any:
        if isinstance(value, (QuantizedWeight, QuantizedExperts)):
            from twinfer.backends.metal.quant import mlx_weight

            return mlx_weight(value, self.dtype)
        return mx.array(np.ascontiguousarray(value), dtype=self.dtype)

    # -- elementwise and dense -----------------------------------------------------------------
    def embedding(self, table: mx.array, ids: mx.array) -> mx.array:
        return mx.take(table, ids, axis=0)

    def linear(self, x: mx.array, w: Any, bias: mx.array | None = None) -> mx.array:
        if not isinstance(w, mx.array):  # a quantized weight (backends/metal/quant.py) runs itself
            out: mx.array = w(x, bias)
            return out
        if bias is None:
            return x @ w.T
        return mx.addmm(bias, x, w.T)

    def rms_norm(self, x: mx.array, w: mx.array, eps: float) -> mx.array:
        if x.dtype == mx.float32:
            # the fused kernel equals `rms_norm_reference` in float32 (tests/test_backends_logits.py)
            return mx.fast.rms_norm(x, w, eps)
        # half inputs: the fused kernel rounds before the weight multiply; the contract does not
        return rms_norm_reference(x, w, eps)

    def layer_norm(self, x: mx.array, w: mx.array, b: mx.array, eps: float) -> mx.array:
        f32 = mx.float32
        return mx.fast.layer_norm(x.astype(f32), w.astype(f32), b.astype(f32), eps).astype(x.dtype)

    def add_rms_norm(self, x: mx.array, delta: mx.array, w: mx.array, eps: float) -> tuple[mx.array, mx.array]:
        h = x + delta
        return h, self.rms_norm(h, w, eps)

    def act(self, x: mx.array, kind: str) -> mx.array:
        if kind == "silu":
            return x * mx.sigmoid(x)
        if kind == "gelu_tanh":  # torch's F.gelu(approximate="tanh"), term for term
            return 0.5 * x * (1.0 + mx.tanh(_GELU_BETA * (x + 0.044715 * (x * x * x))))
        if kind == "gelu":
            return 0.5 * x * (1.0 + mx.erf(x * (1.0 / math.sqrt(2.0))))
        if kind == "sigmoid":
            return mx.sigmoid(x)
        raise ValueError(f"unknown activation {kind!r}")

    def softcap(self, x: mx.array, cap: float) -> mx.array:
        return mx.tanh(x / cap) * cap

    def rope(self, x: mx.array, ctx: MlxStep, layer: int) -> mx.array:
        cos, sin = self._rope_table(ctx, layer)  # [T, 1, R] each
        R = cos.shape[-1]
        if x.shape[-1] > R:  # partial rotary: the dims past R pass through
            return mx.concatenate([self._rotate(x[..., :R], cos, sin), x[..., R:]], axis=-1)
        return self._rotate(x, cos, sin)

    @staticmethod
    def _rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        half = x.shape[-1] // 2
        rotated = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return (x * cos + rotated * sin).astype(x.dtype)

    def _rope_table(self, ctx: MlxStep, layer: int) -> tuple[mx.array, mx.array]:
        key = ("rope", self.spec.rope_base(layer), self.spec.rope_scaling_for(layer) is not None)
        if key not in ctx.cache:
            freqs = ctx.positions.astype(mx.float32)[:, None] * self._inv_freq[layer][None, :]  # [T, R/2]
            emb = mx.concatenate([freqs, freqs], axis=-1)[:, None, :]  # [T, 1, R]
            f = self._rope_factor[layer]
            cos, sin = mx.cos(emb), mx.sin(emb)
            ctx.cache[key] = mx.stack([cos * f, sin * f] if f != 1.0 else [cos, sin])
        table = ctx.cache[key]
        return table[0], table[1]

    def head_linear(self, x: mx.array, w: mx.array) -> mx.array:
        # [H, T, in] @ [H, in, out] -> [H, T, out]
        return (x.transpose(1, 0, 2) @ w.swapaxes(-1, -2)).transpose(1, 0, 2)

    # -- attention -----------------------------------------------------------------------------
    def attention(self, q: mx.array, k: mx.array, v: mx.array, ctx: MlxStep, layer: int,
                  sinks: mx.array | None = None) -> mx.array:
        if sinks is not None:
            return self._sink_attention(q, k, v, ctx, layer, sinks)
        if self.kv_quant:
            mask = self._mask(ctx, self.spec.window(layer))
            return self.kv_quant[layer].attention(q, k, v, ctx, mask, self.spec.attention_scale)
        T, H, D = q.shape
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        if k is not None:  # None: the layer reads an earlier layer's KV (ModelSpec.kv_source)
            k_cache[ctx.slots] = k.astype(k_cache.dtype)  # a scatter: builds the next cache array
            v_cache[ctx.slots] = v.astype(v_cache.dtype)
            self.k_cache[layer], self.v_cache[layer] = k_cache, v_cache
        B, Tq = ctx.q_index.shape
        Q = mx.take(q, ctx.q_index, axis=0).transpose(0, 2, 1, 3)  # [B, H, Tq, D]
        K = mx.take(k_cache, ctx.kv_slots, axis=0).transpose(0, 2, 1, 3)  # [B, Hkv, L, D]
        V = mx.take(v_cache, ctx.kv_slots, axis=0).transpose(0, 2, 1, 3)
        mask = self._mask(ctx, self.spec.window(layer))  # [B, 1, Tq, L]
        out = mx.fast.scaled_dot_product_attention(Q, K, V, scale=self.spec.attention_scale, mask=mask)
        out = out.transpose(0, 2, 1, 3).reshape(B * Tq, H, D)  # [B * Tq, H, D]
        return mx.take(out, ctx.q_flat, axis=0)  # [T, H, D]

    def encoder_attention(self, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        Q, K, V = (t.transpose(1, 0, 2)[None] for t in (q, k, v))  # [1, H, T, D]
        return mx.fast.scaled_dot_product_attention(Q, K, V, scale=scale)[0].transpose(1, 0, 2)  # [T, H, D]

    def _store(self, layer: int, ctx: MlxStep, k: mx.array, v: mx.array | None) -> tuple[mx.array, mx.array]:
        """Write the step's keys (and values) into layer's cache; the caches after the write."""
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        k_cache[ctx.slots] = k.astype(k_cache.dtype)
        if v is not None:
            v_cache[ctx.slots] = v.astype(v_cache.dtype)
        self.k_cache[layer], self.v_cache[layer] = k_cache, v_cache
        return k_cache, v_cache

    def _sink_attention(self, q: mx.array, k: mx.array, v: mx.array, ctx: MlxStep, layer: int,
                        sinks: mx.array) -> mx.array:
        """Attention whose softmax also counts one learned logit per head (`sinks` [H]) that attends to nothing."""
        if self.kv_quant:
            raise ValueError("attention sinks do not run on a TurboQuant KV cache; use a dense KV format")
        T, H, D = q.shape
        k_cache, v_cache = self._store(layer, ctx, k, v)
        rep = H // k.shape[1]
        B, Tq = ctx.q_index.shape
        Q = mx.take(q, ctx.q_index, axis=0).transpose(0, 2, 1, 3)  # [B, H, Tq, D]
        K = mx.repeat(mx.take(k_cache, ctx.kv_slots, axis=0).transpose(0, 2, 1, 3), rep, axis=1)  # [B, H, L, D]
        V = mx.repeat(mx.take(v_cache, ctx.kv_slots, axis=0).transpose(0, 2, 1, 3), rep, axis=1)
        scores = (Q @ K.swapaxes(-1, -2)) * self.spec.attention_scale  # [B, H, Tq, L]
        scores = mx.where(self._mask(ctx, self.spec.window(layer)), scores, -mx.inf)
        sink = mx.broadcast_to(sinks.astype(scores.dtype).reshape(1, H, 1, 1), (*scores.shape[:-1], 1))
        probs = mx.softmax(mx.concatenate([scores, sink], axis=-1), axis=-1, precise=True)[..., :-1]
        out = (probs @ V).transpose(0, 2, 1, 3).reshape(B * Tq, H, D)
        return mx.take(out, ctx.q_flat, axis=0)  # [T, H, D]

    def latent_attention(self, q: mx.array, q_rope: mx.array, latent: mx.array, k_rope: mx.array, ctx: MlxStep,
                         layer: int, selection: int | None = None) -> mx.array:
        assert self.spec.mla is not None
        if self.kv_quant:
            raise ValueError("latent attention does not run on a TurboQuant KV cache; use a dense KV format")
        T, H, R = q.shape
        cache, _ = self._store(layer, ctx, mx.concatenate([latent, k_rope], axis=-1)[:, None], None)  # [slots, 1, R+P]
        B, Tq = ctx.q_index.shape
        Qc = mx.concatenate([q, q_rope], axis=-1)
        Q = mx.take(Qc, ctx.q_index, axis=0).transpose(0, 2, 1, 3)  # [B, H, Tq, R + P]
        K = mx.take(cache, ctx.kv_slots, axis=0).transpose(0, 2, 1, 3)  # [B, 1, L, R + P]
        scores = (Q @ K.swapaxes(-1, -2)) * self.spec.attention_scale  # [B, H, Tq, L]
        mask = self._mask(ctx, self.spec.window(layer))
        if selection is not None:  # sparse attention: only the tokens the indexer chose
            mask = mask & selected(ctx.cache, layer, selection)
        scores = mx.where(mask, scores, -mx.inf)
        out = mx.softmax(scores, axis=-1, precise=True) @ K[..., :R]  # [B, H, Tq, R]
        out = out.transpose(0, 2, 1, 3).reshape(B * Tq, H, R)
        return mx.take(out, ctx.q_flat, axis=0)  # [T, H, R]

    def indexer_topk(self, q: mx.array, k: mx.array, weights: mx.array, ctx: MlxStep, layer: int,
                     top_k: int) -> None:
        cache = self.v_cache[layer]  # [slots, 1, D]: the indexer's keys, on the latents' slots
        cache[ctx.slots] = k[:, None].astype(cache.dtype)  # a scatter: builds the next cache array
        self.v_cache[layer] = cache
        f32 = mx.float32
        K = mx.take(cache, ctx.kv_slots, axis=0)[:, None, :, 0].astype(f32)  # [B, 1, L, D]
        Q = mx.take(q, ctx.q_index, axis=0).astype(f32)  # [B, Tq, Hi, D]
        scores = mx.maximum(Q @ K.swapaxes(-1, -2), 0)  # [B, Tq, Hi, L]
        W = mx.take(weights, ctx.q_index, axis=0).astype(f32)[:, :, None]  # [B, Tq, 1, Hi]
        causal = self._mask(ctx, None)[:, 0]  # [B, Tq, L]
        index = mx.where(causal, (W @ scores)[:, :, 0], -mx.inf)  # [B, Tq, L]
        n = min(top_k, index.shape[-1])
        top = mx.argpartition(-index, kth=n - 1, axis=-1)[..., :n]  # [B, Tq, n]
        chosen = mx.put_along_axis(mx.zeros(index.shape, dtype=mx.bool_), top, mx.array(True), axis=-1)
        ctx.cache[("selection", layer)] = (chosen & causal)[:, None]  # [B, 1, Tq, L], like the causal mask

    def _mask(self, ctx: MlxStep, window: int | None) -> mx.array:
        key = ("mask", window)
        if key not in ctx.cache:
            L = ctx.kv_slots.shape[1]
            kpos = mx.arange(L, dtype=mx.int32)[None, None, :]  # [1, 1, L]
            qpos = ctx.q_pos[:, :, None]  # [B, Tq, 1]
            mask = kpos <= qpos
            if ctx.image_spans is not None:  # a bidirectional image's positions also see the ones after them
                lo, hi = ctx.image_spans
                mask = mask | ((kpos >= lo[:, :, None]) & (kpos < hi[:, :, None]))
            if window is not None:
                mask = mask & (kpos > qpos - window)
            ctx.cache[key] = mask[:, None]
        return ctx.cache[key]

    # -- mixture of experts --------------------------------------------------------------------
    def moe(
        self,
        x: mx.array,
        router: mx.array,
        gate: mx.array,
        up: mx.array,
        down: mx.array,
        moe: MoESpec,
        act: str,
        extras: ExpertExtras | None = None,
    ) -> mx.array:
        xb = extras or ExpertExtras()
        weights, experts = self._route(x, router, moe, xb)  # [T, k] each
        T, C = x.shape
        k = moe.top_k
        h = x.reshape(T, 1, 1, C)
        order = None
        if T * k >= _SORT_MOE_PAIRS:
            order = mx.argsort(experts.flatten())  # group the (token, expert) pairs by expert
            h = mx.take(h.reshape(T, 1, C), order // k, axis=0)  # [T*k, 1, C]
            idx = mx.take(experts.flatten(), order)
        else:
            idx = experts
        srt = order is not None

        def bias(y: mx.array, b: mx.array | None) -> mx.array:
            return y if b is None else y + mx.take(b, idx, axis=0)[..., None, :]

        g = bias(self._gather_mm(h, gate.swapaxes(-1, -2), idx, srt), xb.gate_bias)  # [T, k, 1, I] or [T*k, 1, I]
        u = bias(self._gather_mm(h, up.swapaxes(-1, -2), idx, srt), xb.up_bias)
        if moe.swiglu_limit is not None:  # gpt-oss
            lim = moe.swiglu_limit
            g, u = mx.minimum(g, lim), mx.clip(u, -lim, lim)
            a = g * mx.sigmoid(g * moe.swiglu_alpha) * (u + 1)
        else:
            a = self.act(g, act) * u
        y = bias(self._gather_mm(a, down.swapaxes(-1, -2), idx, srt), xb.down_bias)  # [.., 1, C]
        if order is not None:
            y = mx.take(y, mx.argsort(order), axis=0)
        y = y.reshape(T, k, C)
        return (y * weights[:, :, None]).sum(axis=1)

    def _gather_mm(self, a: mx.array, b: mx.array, idx: mx.array, srt: bool) -> mx.array:
        if self._gather_mm_f32 and a.dtype != mx.float32:
            # MLX's CPU gather_mm is float32-only; Metal runs half precision natively
            out = mx.gather_mm(
                a.astype(mx.float32), b.astype(mx.float32), rhs_indices=idx, sorted_indices=srt
            )
            return out.astype(a.dtype)
        return mx.gather_mm(a, b, rhs_indices=idx, sorted_indices=srt)

    def _route(self, x: mx.array, router: mx.array, moe: MoESpec, extras: ExpertExtras | None = None
               ) -> tuple[mx.array, mx.array]:
        """Router in float32, top-k (unordered): softmax renormalized when the spec says so, or sigmoid."""
        xb = extras or ExpertExtras()
        scored = x if xb.router_input is None else xb.router_input
        logits = self.linear(scored, router, xb.router_bias).astype(mx.float32)  # [T, E]
        k = moe.top_k
        if moe.scoring == SIGMOID:
            weights, experts = _sigmoid_route(logits, moe, xb.score_bias)
        else:
            probs = mx.softmax(logits, axis=-1, precise=True)  # [T, E]
            experts = mx.argpartition(-probs, kth=k - 1, axis=-1)[:, :k]  # [T, k]
            weights = mx.take_along_axis(probs, experts, axis=-1)
            # softmax over the top-k logits (router_softmax_before_topk=False) is the same renormalization
            if moe.norm_topk_prob or not moe.router_softmax_before_topk:
                weights = weights / weights.sum(axis=-1, keepdims=True)
        if moe.routed_scaling_factor != 1.0:
            weights = weights * moe.routed_scaling_factor
        if xb.expert_scale is not None:
            weights = weights * mx.take(xb.expert_scale.astype(mx.float32), experts)
        return weights.astype(x.dtype), experts

    # -- output --------------------------------------------------------------------------------
    def select_rows(self, x: mx.array, ctx: MlxStep) -> mx.array:
        return mx.take(x, ctx.rows, axis=0)

    # -- linear attention (recurrent.py) ------------------------------------------------------------
    def causal_conv1d(self, x: mx.array, w: mx.array, ctx: MlxStep, layer: int) -> mx.array:
        assert self.states is not None
        return self.states.causal_conv1d(x, w, ctx.state, ctx.q_index, ctx.q_flat, layer)

    def gated_delta(self, q: mx.array, k: mx.array, v: mx.array, a: mx.array, b: mx.array, decay: mx.array,
                    dt_bias: mx.array, ctx: MlxStep, layer: int) -> mx.array:
        assert self.states is not None
        return self.states.gated_delta(q, k, v, a, b, decay, dt_bias, ctx, layer)

    def release_state(self, seq_id: int) -> None:
        if self.states is not None:
            self.states.release(seq_id)

    def to_host(self, x: mx.array) -> np.ndarray:
        out = x.astype(mx.float32)
        coded = [a for c in self.kv_quant for a in c.arrays()]
        states = self.states.arrays() if self.states is not None else []
        mx.eval(out, self.k_cache, self.v_cache, coded, states)  # the step's one wait: logits and KV writes together
        return np.array(out, copy=True)


def _sigmoid_route(logits: mx.array, moe: MoESpec, score_bias: mx.array | None) -> tuple[mx.array, mx.array]:
    """DeepSeek-V3 / GLM-4.5 routing: sigmoid scores, best groups, top-k by score + bias (see MoESpec)."""
    T, E = logits.shape
    per = E // moe.n_group
    scores = mx.sigmoid(logits)  # [T, E]
    choice = scores if score_bias is None else scores + score_bias.astype(mx.float32)
    group_scores = mx.sort(choice.reshape(T, moe.n_group, per), axis=-1)[..., -2:].sum(axis=-1)  # [T, G]
    best = mx.argpartition(-group_scores, kth=moe.topk_group - 1, axis=-1)[:, : moe.topk_group]
    keep = mx.put_along_axis(mx.zeros(group_scores.shape, dtype=mx.bool_), best, mx.array(True), axis=-1)
    choice = mx.where(mx.repeat(keep, per, axis=1), choice, 0.0)
    experts = mx.argpartition(-choice, kth=moe.top_k - 1, axis=-1)[:, : moe.top_k]  # [T, k]
    weights = mx.take_along_axis(scores, experts, axis=-1)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return weights, experts


def rms_norm_reference(x: mx.array, w: mx.array, eps: float) -> mx.array:
    """Plain-ops RMSNorm in float32, the reference `mx.fast.rms_norm` is checked against."""
    xf = x.astype(mx.float32)
    xf = xf * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * w.astype(mx.float32)).astype(x.dtype)


def _tq_kv_caches(spec: ModelSpec, kv_format: str | None, slots: int, dtype: mx.Dtype) -> list[Any]:
    """One coded KV cache per layer for a TurboQuant `kv_format`, else []."""
    from twinfer.quant.kv_format import parse_kv_format

    fmt = parse_kv_format(kv_format)
    if fmt is None:
        return []
    from twinfer.backends.metal.quant import MlxTQKV

    if spec.kv_shared_layers:
        raise ValueError(f"KV format {kv_format!r} does not run layers that share KV; use a dense KV format")
    return [MlxTQKV(fmt, i, slots, spec.kv_heads_for(i), spec.head_dim_for(i), dtype) for i in range(spec.num_layers)]


def _kv_shape(spec: ModelSpec, layer: int, slots: int) -> tuple[int, int, int]:
    """[slots, Hkv, D] of one layer's K or V cache, with no slots where it reads another layer's KV."""
    return (slots if spec.owns_kv(layer) else 0, spec.kv_heads_for(layer), spec.head_dim_for(layer))
