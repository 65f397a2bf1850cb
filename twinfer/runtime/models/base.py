"""The base of every architecture: a decoder-only transformer over the Ops interface. A model file
overrides only the blocks that differ; `weight_shapes` lists every weight the loaders check."""

from __future__ import annotations

from typing import Any

from twinfer.runtime.ops import Array, Ops, StepContext
from twinfer.runtime.spec import ModelSpec

Weights = dict[str, Any]
Shapes = dict[str, tuple[int, ...]]


class Model:
    """Llama-style decoder: pre-norm attention and MLP blocks with residuals, final norm, lm_head."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec

    def weight_shapes(self) -> Shapes:
        """Every canonical weight this model reads, with its shape, in load order."""
        s = self.spec
        out: Shapes = {"embed": (s.vocab_size, s.hidden_size), "norm": (s.hidden_size,)}
        if not s.tie_word_embeddings:
            out["lm_head"] = (s.vocab_size, s.hidden_size)
        for i in range(s.num_layers):
            p = f"layers.{i}."
            out |= self.attention_shapes(p)
            out |= self.layer_norm_shapes(p)
            out |= self.feed_forward_shapes(p, i)
        return out

    def attention_shapes(self, p: str) -> Shapes:
        s = self.spec
        C, Q, KV = s.hidden_size, s.q_size, s.kv_size
        out: Shapes = {p + "q": (Q, C), p + "k": (KV, C), p + "v": (KV, C), p + "o": (C, Q)}
        if s.attention_bias:
            out |= {p + "q_bias": (Q,), p + "k_bias": (KV,), p + "v_bias": (KV,)}
        if s.qk_norm:
            out |= {p + "q_norm": (s.head_dim,), p + "k_norm": (s.head_dim,)}
        return out

    def layer_norm_shapes(self, p: str) -> Shapes:
        C = self.spec.hidden_size
        return {p + "attn_norm": (C,), p + "mlp_norm": (C,)}

    def feed_forward_shapes(self, p: str, layer: int) -> Shapes:
        s = self.spec
        C = s.hidden_size
        if s.moe is not None and s.is_moe_layer(layer):
            E, Ie = s.moe.num_experts, s.moe.expert_intermediate_size
            return {p + "router": (E, C), p + "experts.gate": (E, Ie, C), p + "experts.up": (E, Ie, C),
                    p + "experts.down": (E, C, Ie)}
        FF = s.intermediate_size
        return {p + "gate": (FF, C), p + "up": (FF, C), p + "down": (C, FF)}

    def forward(self, ops: Ops, w: Weights, ctx: StepContext) -> Array:
        """Token ids of the step -> final hidden states [T, C] (after the final norm)."""
        x = self.embed(ops, w, ctx)
        for layer in range(self.spec.num_layers):
            x = self.block(ops, w, f"layers.{layer}.", layer, x, ctx)
        return ops.rms_norm(x, w["norm"], self.spec.rms_norm_eps)

    def logits(self, ops: Ops, w: Weights, h: Array) -> Array:
        """[R, C] hidden rows -> [R, V] logits (tied to the embedding when lm_head is absent)."""
        out = ops.linear(h, w.get("lm_head", w["embed"]))
        cap = self.spec.final_logit_softcap
        if cap:
            out = ops.softcap(out, cap)
        return out

    def embed(self, ops: Ops, w: Weights, ctx: StepContext) -> Array:
        x = ops.embedding(w["embed"], ctx.tokens)
        x = x * (self.spec.hidden_size**0.5) if self.spec.embed_scale else x
        for row, features in ctx.images:  # image features replace their placeholders' rows, unscaled
            x[row : row + features.shape[0]] = features
        return x

    def block(self, ops: Ops, w: Weights, p: str, layer: int, x: Array, ctx: StepContext) -> Array:
        eps = self.spec.rms_norm_eps
        a = self.attention(ops, w, p, layer, ops.rms_norm(x, w[p + "attn_norm"], eps), ctx)
        x, h = ops.add_rms_norm(x, a, w[p + "mlp_norm"], eps)
        return x + self.feed_forward(ops, w, p, layer, h)

    def attention(self, ops: Ops, w: Weights, p: str, layer: int, h: Array, ctx: StepContext) -> Array:
        s = self.spec
        T = h.shape[0]
        q = ops.linear(h, w[p + "q"], w.get(p + "q_bias")).reshape(T, s.num_heads, s.head_dim)
        k = ops.linear(h, w[p + "k"], w.get(p + "k_bias")).reshape(T, s.num_kv_heads, s.head_dim)
        v = ops.linear(h, w[p + "v"], w.get(p + "v_bias")).reshape(T, s.num_kv_heads, s.head_dim)
        if s.qk_norm:  # per-head RMSNorm over D before rope (Qwen3, Gemma 3)
            q = ops.rms_norm(q, w[p + "q_norm"], s.rms_norm_eps)
            k = ops.rms_norm(k, w[p + "k_norm"], s.rms_norm_eps)
        q, k = ops.rope(q, ctx, layer), ops.rope(k, ctx, layer)
        if s.attention_sinks:  # gpt-oss: a learned logit per head joins every softmax
            o = ops.attention(q, k, v, ctx, layer, w[p + "sinks"])
        else:
            o = ops.attention(q, k, v, ctx, layer)  # [T, H, D]
        return ops.linear(o.reshape(T, s.q_size), w[p + "o"], w.get(p + "o_bias"))

    def feed_forward(self, ops: Ops, w: Weights, p: str, layer: int, h: Array) -> Array:
        if self.spec.is_moe_layer(layer):
            assert self.spec.moe is not None
            return ops.moe(
                h, w[p + "router"], w[p + "experts.gate"], w[p + "experts.up"], w[p + "experts.down"],
                self.spec.moe, self.spec.hidden_act,
            )
        return self.mlp(ops, w, p, h)

    def mlp(self, ops: Ops, w: Weights, p: str, h: Array) -> Array:
        """The dense gated MLP of weights `p + gate/up/down`."""
        gate = ops.act(ops.linear(h, w[p + "gate"]), self.spec.hidden_act)
        return ops.linear(gate * ops.linear(h, w[p + "up"]), w[p + "down"])
