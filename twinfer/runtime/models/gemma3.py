"""Gemma 3 (text): interleaved sliding-window and global attention, QK-norm, sandwich norms.

Differences from the Llama decoder: embeddings scaled by sqrt(C); each block normalizes both the
input and the output of attention and of the MLP (four norms); GELU(tanh)-gated MLP; the local
layers use their own rope base; attention scale is query_pre_attn_scalar ** -0.5; tied lm_head.
Norm weights are the effective multipliers (HF's `1 + w` is folded in by the loader).
"""

from twinfer.runtime.models.base import Model as _Decoder
from twinfer.runtime.models.base import Weights, add_rms_norm
from twinfer.runtime.ops import Array, Ops, StepContext


class Model(_Decoder):
    def embed(self, ops: Ops, w: Weights, ctx: StepContext) -> Array:
        return ops.embedding(w["embed"], ctx.tokens) * (self.spec.hidden_size**0.5)

    def block(self, ops: Ops, w: Weights, p: str, layer: int, x: Array, ctx: StepContext) -> Array:
        eps = self.spec.rms_norm_eps
        h = self.attention(ops, w, p, layer, ops.rms_norm(x, w[p + "attn_norm"], eps), ctx)
        x, h = add_rms_norm(ops, x, ops.rms_norm(h, w[p + "post_attn_norm"], eps), w[p + "mlp_norm"], eps)
        h = self.feed_forward(ops, w, p, layer, h)
        return x + ops.rms_norm(h, w[p + "post_mlp_norm"], eps)
