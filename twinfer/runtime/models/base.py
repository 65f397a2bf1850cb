"""The base of every architecture: a decoder-only transformer over the Ops interface.

A model file subclasses `Model` and overrides only the blocks that differ (Gemma's extra norms,
Qwen's biases, an MoE feed-forward). Weights are a dict of canonical names (see loaders/names.py).
"""

from __future__ import annotations

from typing import Any

from twinfer.runtime.ops import Array, Ops, StepContext
from twinfer.runtime.spec import ModelSpec

Weights = dict[str, Any]


class Model:
    """Llama-style decoder: pre-norm attention and MLP blocks with residuals, final norm, lm_head."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec

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
        return ops.embedding(w["embed"], ctx.tokens)

    def block(self, ops: Ops, w: Weights, p: str, layer: int, x: Array, ctx: StepContext) -> Array:
        eps = self.spec.rms_norm_eps
        a = self.attention(ops, w, p, layer, ops.rms_norm(x, w[p + "attn_norm"], eps), ctx)
        x, h = add_rms_norm(ops, x, a, w[p + "mlp_norm"], eps)
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
        o = ops.attention(q, k, v, ctx, layer)  # [T, H, D]
        return ops.linear(o.reshape(T, s.q_size), w[p + "o"])

    def feed_forward(self, ops: Ops, w: Weights, p: str, layer: int, h: Array) -> Array:
        if self.spec.is_moe_layer(layer):
            assert self.spec.moe is not None
            return ops.moe(
                h, w[p + "router"], w[p + "experts.gate"], w[p + "experts.up"], w[p + "experts.down"],
                self.spec.moe, self.spec.hidden_act,
            )
        gate = ops.act(ops.linear(h, w[p + "gate"]), self.spec.hidden_act)
        return ops.linear(gate * ops.linear(h, w[p + "up"]), w[p + "down"])


def add_rms_norm(ops: Ops, x: Array, delta: Array, w: Array, eps: float) -> tuple[Array, Array]:
    """(x + delta, rms_norm(x + delta) * w). A backend with a fused residual-add + norm kernel provides it
    as `ops.add_rms_norm` (an optional op: backends without one get the two plain calls)."""
    fused = getattr(ops, "add_rms_norm", None)
    if fused is not None:
        out: tuple[Array, Array] = fused(x, delta, w, eps)
        return out
    x = x + delta
    return x, ops.rms_norm(x, w, eps)
