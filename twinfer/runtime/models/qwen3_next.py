"""Qwen3-Next: a hybrid of Gated DeltaNet (linear attention) and gated full attention, with MoE.
Layers follow `layer_types`; the checkpoint's grouped projections are split at load
(docs/models.md, "Qwen3-Next")."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from twinfer.runtime.errors import UnsupportedArchitecture
from twinfer.runtime.loaders.names import NameTable, rule
from twinfer.runtime.loaders.weights import Transform, elementwise
from twinfer.runtime.models.arch import Architecture, Fields
from twinfer.runtime.models.base import Model as _Decoder
from twinfer.runtime.models.base import Shapes, Weights
from twinfer.runtime.models.common import GGUF_MOE, HF_FUSED_EXPERTS, HF_STACKED_EXPERTS, L
from twinfer.runtime.ops import Array, Ops, StepContext
from twinfer.runtime.spec import FULL, LINEAR, LinearAttnSpec, ModelSpec, MoESpec

if TYPE_CHECKING:
    from twinfer.runtime.loaders.gguf_file import GGUFKeys

FULL_ATTENTION_INTERVAL = 4  # transformers' default: every 4th layer is full attention


class Model(_Decoder):
    def weight_shapes(self) -> Shapes:
        s = self.spec
        out: Shapes = {"embed": (s.vocab_size, s.hidden_size), "norm": (s.hidden_size,)}
        if not s.tie_word_embeddings:
            out["lm_head"] = (s.vocab_size, s.hidden_size)
        for i, kind in enumerate(s.attention_types):
            p = f"layers.{i}."
            out |= self.linear_shapes(p) if kind == LINEAR else self.attention_shapes(p)
            out |= self.layer_norm_shapes(p)
            out |= self.feed_forward_shapes(p, i)
        return out

    def attention_shapes(self, p: str) -> Shapes:
        s = self.spec
        return super().attention_shapes(p) | {p + "q_gate": (s.q_size, s.hidden_size)}

    def linear_shapes(self, p: str) -> Shapes:
        la, C = self.spec.linear_attn, self.spec.hidden_size
        assert la is not None
        Hv = la.num_v_heads
        return {p + "lin.qkv": (la.conv_dim, C), p + "lin.z": (la.value_dim, C), p + "lin.b": (Hv, C),
                p + "lin.a": (Hv, C), p + "lin.conv": (la.conv_dim, la.conv_kernel), p + "lin.dt_bias": (Hv,),
                p + "lin.decay": (Hv,), p + "lin.norm": (la.head_v_dim,), p + "lin.out": (C, la.value_dim)}

    def feed_forward_shapes(self, p: str, layer: int) -> Shapes:
        out = super().feed_forward_shapes(p, layer)
        moe, C = self.spec.moe, self.spec.hidden_size
        if moe is not None and moe.num_shared_experts:
            S = moe.shared_intermediate_size
            out |= {p + "shared.gate": (S, C), p + "shared.up": (S, C), p + "shared.down": (C, S),
                    p + "shared_gate": (1, C)}
        return out

    def block(self, ops: Ops, w: Weights, p: str, layer: int, x: Array, ctx: StepContext) -> Array:
        eps = self.spec.rms_norm_eps
        h = ops.rms_norm(x, w[p + "attn_norm"], eps)
        if self.spec.attention_types[layer] == LINEAR:
            a = self.linear_attention(ops, w, p, layer, h, ctx)
        else:
            a = self.attention(ops, w, p, layer, h, ctx)
        x, h = ops.add_rms_norm(x, a, w[p + "mlp_norm"], eps)
        return x + self.feed_forward(ops, w, p, layer, h)

    def attention(self, ops: Ops, w: Weights, p: str, layer: int, h: Array, ctx: StepContext) -> Array:
        s = self.spec
        T = h.shape[0]
        q = ops.linear(h, w[p + "q"]).reshape(T, s.num_heads, s.head_dim)
        k = ops.linear(h, w[p + "k"]).reshape(T, s.num_kv_heads, s.head_dim)
        v = ops.linear(h, w[p + "v"]).reshape(T, s.num_kv_heads, s.head_dim)
        q = ops.rope(ops.rms_norm(q, w[p + "q_norm"], s.rms_norm_eps), ctx, layer)
        k = ops.rope(ops.rms_norm(k, w[p + "k_norm"], s.rms_norm_eps), ctx, layer)
        o = ops.attention(q, k, v, ctx, layer).reshape(T, s.q_size)  # [T, H * D]
        o = o * ops.act(ops.linear(h, w[p + "q_gate"]), "sigmoid")
        return ops.linear(o, w[p + "o"])

    def linear_attention(self, ops: Ops, w: Weights, p: str, layer: int, h: Array, ctx: StepContext) -> Array:
        la = self.spec.linear_attn
        assert la is not None
        T, Kd = h.shape[0], la.key_dim
        qkv = ops.act(ops.causal_conv1d(ops.linear(h, w[p + "lin.qkv"]), w[p + "lin.conv"], ctx, layer), "silu")
        q = qkv[:, :Kd].reshape(T, la.num_k_heads, la.head_k_dim)
        k = qkv[:, Kd : 2 * Kd].reshape(T, la.num_k_heads, la.head_k_dim)
        v = qkv[:, 2 * Kd :].reshape(T, la.num_v_heads, la.head_v_dim)
        a, b = ops.linear(h, w[p + "lin.a"]), ops.linear(h, w[p + "lin.b"])  # [T, Hv]
        o = ops.gated_delta(q, k, v, a, b, w[p + "lin.decay"], w[p + "lin.dt_bias"], ctx, layer)  # [T, Hv, Dv]
        z = ops.linear(h, w[p + "lin.z"]).reshape(T, la.num_v_heads, la.head_v_dim)
        o = ops.rms_norm(o, w[p + "lin.norm"], self.spec.rms_norm_eps) * ops.act(z, "silu")
        return ops.linear(o.reshape(T, la.value_dim), w[p + "lin.out"])

    def feed_forward(self, ops: Ops, w: Weights, p: str, layer: int, h: Array) -> Array:
        out = super().feed_forward(ops, w, p, layer, h)
        moe = self.spec.moe
        if moe is not None and moe.num_shared_experts:
            gate = ops.act(ops.linear(h, w[p + "shared_gate"]), "sigmoid")  # [T, 1]
            out = out + gate * self.mlp(ops, w, p + "shared.", h)
        return out


def _la(spec: ModelSpec) -> LinearAttnSpec:
    assert spec.linear_attn is not None
    return spec.linear_attn


def _gated_q(part: int) -> Transform:
    """q_proj holds [q; gate] per head ([H, 2D, C]): part 0 the queries, part 1 the output gate."""
    def apply(a: list[np.ndarray], spec: ModelSpec) -> np.ndarray:
        H, D = spec.num_heads, spec.head_dim
        return a[0].reshape(H, 2, D, -1)[:, part].reshape(H * D, -1)

    return Transform(apply, lambda s, spec: (s[0][0] // 2, *s[0][1:]), split=2)


def _qkvz(part: str) -> Transform:
    """in_proj_qkvz rows grouped per key head: [q (Dk), k (Dk), v (r Dv), z (r Dv)] x Hk, with r = Hv / Hk.
    "qkv": q, k, v of all heads side by side (the conv's channel order); "z": z in value-head order."""
    def apply(a: list[np.ndarray], spec: ModelSpec) -> np.ndarray:
        la = _la(spec)
        Hk, Dk, rDv = la.num_k_heads, la.head_k_dim, la.value_dim // la.num_k_heads
        g = a[0].reshape(Hk, 2 * Dk + 2 * rDv, -1)
        if part == "z":
            return g[:, 2 * Dk + rDv :].reshape(la.value_dim, -1)
        q, k, v = g[:, :Dk], g[:, Dk : 2 * Dk], g[:, 2 * Dk : 2 * Dk + rDv]
        return np.concatenate([t.reshape(-1, t.shape[-1]) for t in (q, k, v)])

    def shape(s: list[tuple[int, ...]], spec: ModelSpec) -> tuple[int, ...]:
        la = _la(spec)
        return (la.value_dim if part == "z" else la.conv_dim, s[0][1])

    return Transform(apply, shape)


def _ba(part: int) -> Transform:
    """in_proj_ba rows grouped per key head: [b (r), a (r)] x Hk; part 0 gives b, 1 gives a ([Hv, C])."""
    def apply(a: list[np.ndarray], spec: ModelSpec) -> np.ndarray:
        la = _la(spec)
        return a[0].reshape(la.num_k_heads, 2, -1, a[0].shape[-1])[:, part].reshape(la.num_v_heads, -1)

    return Transform(apply, lambda s, spec: (s[0][0] // 2, s[0][1]), split=2)


PLUS1 = "norm_plus_one"
TRANSFORMS: tuple[tuple[str, Transform], ...] = (
    (PLUS1, elementwise(lambda a: a + np.float32(1.0))),
    ("neg_exp", elementwise(lambda a: -np.exp(a))),  # A_log -> the decay rate -exp(A_log)
    ("conv_rows", Transform(lambda a, spec: a[0].reshape(a[0].shape[0], -1),
                            lambda s, spec: (s[0][0], s[0][-1]))),  # conv1d [Ch, 1, K] -> [Ch, K]
    ("q_of_gated", _gated_q(0)), ("gate_of_gated", _gated_q(1)),
    ("qkvz_qkv", _qkvz("qkv")), ("qkvz_z", _qkvz("z")), ("ba_b", _ba(0)), ("ba_a", _ba(1)),
)
LIN = L + "linear_attn."
HF_RULES = (
    rule("model.embed_tokens.weight", "embed"),
    rule("model.norm.weight", "norm", PLUS1),
    rule("lm_head.weight", "lm_head"),
    rule(L + "input_layernorm.weight", "layers.{i}.attn_norm", PLUS1),
    rule(L + "post_attention_layernorm.weight", "layers.{i}.mlp_norm", PLUS1),
    rule(L + "self_attn.q_proj.weight", "layers.{i}.q", "q_of_gated"),
    rule(L + "self_attn.q_proj.weight", "layers.{i}.q_gate", "gate_of_gated"),
    *(rule(L + f"self_attn.{p}_proj.weight", "layers.{i}." + p) for p in "kvo"),
    rule(L + "self_attn.q_norm.weight", "layers.{i}.q_norm", PLUS1),
    rule(L + "self_attn.k_norm.weight", "layers.{i}.k_norm", PLUS1),
    rule(LIN + "conv1d.weight", "layers.{i}.lin.conv", "conv_rows"),
    rule(LIN + "dt_bias", "layers.{i}.lin.dt_bias"),
    rule(LIN + "A_log", "layers.{i}.lin.decay", "neg_exp"),
    rule(LIN + "norm.weight", "layers.{i}.lin.norm"),
    rule(LIN + "out_proj.weight", "layers.{i}.lin.out"),
    *(rule(L + f"mlp.{p}_proj.weight", "layers.{i}." + p) for p in ("gate", "up", "down")),
    *HF_FUSED_EXPERTS, *HF_STACKED_EXPERTS,
    *(rule(L + f"mlp.shared_expert.{p}_proj.weight", f"layers.{{i}}.shared.{p}") for p in ("gate", "up", "down")),
    rule(L + "mlp.shared_expert_gate.weight", "layers.{i}.shared_gate"),
)
HF_NAMES = NameTable("qwen3_next", HF_RULES + (
    rule(LIN + "in_proj_qkvz.weight", "layers.{i}.lin.qkv", "qkvz_qkv"),
    rule(LIN + "in_proj_qkvz.weight", "layers.{i}.lin.z", "qkvz_z"),
    rule(LIN + "in_proj_ba.weight", "layers.{i}.lin.b", "ba_b"),
    rule(LIN + "in_proj_ba.weight", "layers.{i}.lin.a", "ba_a"),
), transforms=TRANSFORMS)


def hf_spec(c: dict[str, Any], fields: Fields) -> Fields:
    n = fields["num_layers"]
    types = c.get("layer_types") or [
        FULL if (i + 1) % int(c.get("full_attention_interval") or FULL_ATTENTION_INTERVAL) == 0 else LINEAR
        for i in range(n)]
    if set(types) - {FULL, LINEAR}:
        raise UnsupportedArchitecture(f"{c.get('model_type')}: layer types {sorted(set(types))} are not "
                                      "full_attention / linear_attention")
    if c.get("mlp_only_layers") or int(c.get("decoder_sparse_step") or 1) != 1:
        raise UnsupportedArchitecture(f"{c.get('model_type')} configs with dense layers among the MoE ones "
                                      "(mlp_only_layers / decoder_sparse_step) are not supported")
    if fields["attention_bias"]:
        raise UnsupportedArchitecture(f"{c.get('model_type')} with attention_bias is not supported")
    la = LinearAttnSpec(num_k_heads=int(c["linear_num_key_heads"]), num_v_heads=int(c["linear_num_value_heads"]),
                        head_k_dim=int(c["linear_key_head_dim"]), head_v_dim=int(c["linear_value_head_dim"]),
                        conv_kernel=int(c["linear_conv_kernel_dim"]))
    moe = None
    if int(c.get("num_experts") or 0):
        shared = int(c.get("shared_expert_intermediate_size") or 0)
        moe = MoESpec(num_experts=int(c["num_experts"]), top_k=int(c["num_experts_per_tok"]),
                      expert_intermediate_size=int(c["moe_intermediate_size"]),
                      norm_topk_prob=bool(c.get("norm_topk_prob", True)),
                      num_shared_experts=int(shared > 0), shared_intermediate_size=shared)
    return fields | dict(layer_types=tuple(types), linear_attn=la, qk_norm=True, moe=moe)


def hf_skip(c: dict[str, Any]) -> tuple[str, ...]:
    return ("mtp.",)  # the multi-token-prediction head twinfer does not run


HF_DEFAULTS = {
    "vocab_size": 151936, "max_position_embeddings": 32768, "head_dim": 256, "partial_rotary_factor": 0.25,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "norm_topk_prob": True,
}  # fmt: skip

# llama.cpp's names (convert_hf_to_gguf.py, qwen3next): norms already 1 + w, A_log already -exp(A_log),
# in_proj_qkvz split into attn_qkv (q, k, v side by side) and attn_gate (z); in_proj_ba kept grouped
BLK = "blk.{i}."
GGUF_RULES = (
    rule("token_embd.weight", "embed"),
    rule("output_norm.weight", "norm"),
    rule("output.weight", "lm_head"),
    rule(BLK + "attn_norm.weight", "layers.{i}.attn_norm"),
    rule(BLK + "post_attention_norm.weight", "layers.{i}.mlp_norm"),
    rule(BLK + "attn_q.weight", "layers.{i}.q", "q_of_gated"),
    rule(BLK + "attn_q.weight", "layers.{i}.q_gate", "gate_of_gated"),
    rule(BLK + "attn_k.weight", "layers.{i}.k"),
    rule(BLK + "attn_v.weight", "layers.{i}.v"),
    rule(BLK + "attn_output.weight", "layers.{i}.o"),
    rule(BLK + "attn_q_norm.weight", "layers.{i}.q_norm"),
    rule(BLK + "attn_k_norm.weight", "layers.{i}.k_norm"),
    rule(BLK + "ssm_norm.weight", "layers.{i}.lin.norm"),
    *(rule(BLK + f"ffn_{p}.weight", "layers.{i}." + p) for p in ("gate", "up", "down")),
    *GGUF_MOE,
    *(rule(BLK + f"ffn_{p}_shexp.weight", f"layers.{{i}}.shared.{p}") for p in ("gate", "up", "down")),
    rule(BLK + "ffn_gate_inp_shexp.weight", "layers.{i}.shared_gate"),
)
GGUF_NAMES = NameTable("qwen3next GGUF", GGUF_RULES + (
    rule(BLK + "attn_qkv.weight", "layers.{i}.lin.qkv"),
    rule(BLK + "attn_gate.weight", "layers.{i}.lin.z"),
    rule(BLK + "ssm_ba.weight", "layers.{i}.lin.b", "ba_b"),
    rule(BLK + "ssm_ba.weight", "layers.{i}.lin.a", "ba_a"),
    rule(BLK + "ssm_conv1d.weight", "layers.{i}.lin.conv"),
    rule(BLK + "ssm_dt.bias", "layers.{i}.lin.dt_bias"),
    rule(BLK + "ssm_a", "layers.{i}.lin.decay"),
    rule(BLK + "ssm_out.weight", "layers.{i}.lin.out"),
), transforms=TRANSFORMS)


def gguf_spec(k: GGUFKeys, fields: Fields) -> Fields:
    """Layer types from `attention.recurrent_layers` (else `full_attention_interval`), the delta-net shape from
    the `ssm.*` keys, the rotated share of each head from `rope.dimension_count`, the shared expert."""
    n, head_dim = fields["num_layers"], fields["head_dim"]
    recurrent = k.meta.get(f"{k.arch}.attention.recurrent_layers")
    if isinstance(recurrent, list) and len(recurrent) == n:
        types = tuple(LINEAR if r else FULL for r in recurrent)
    else:
        interval = k.int("full_attention_interval", FULL_ATTENTION_INTERVAL)
        types = tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(n))
    hv = k.int("ssm.time_step_rank")
    la = LinearAttnSpec(num_k_heads=k.int("ssm.group_count"), num_v_heads=hv, head_k_dim=k.int("ssm.state_size"),
                        head_v_dim=k.int("ssm.inner_size") // hv, conv_kernel=k.int("ssm.conv_kernel"))
    moe, shared = fields["moe"], k.int("expert_shared_feed_forward_length", 0)
    if moe is not None and shared:
        moe = replace(moe, num_shared_experts=1, shared_intermediate_size=shared)
    out = fields | dict(layer_types=types, linear_attn=la, moe=moe, qk_norm=True,
                        partial_rotary_factor=k.int("rope.dimension_count", head_dim) / head_dim)
    if not out["intermediate_size"] and moe is not None:  # no dense MLP (qwen35moe): the shared expert's width
        out["intermediate_size"] = moe.shared_intermediate_size
    return out


ARCH = Architecture(
    name="qwen3_next",
    model=Model,
    hf_names=HF_NAMES,
    gguf_names=GGUF_NAMES,
    hf_defaults=HF_DEFAULTS,
    hf_spec=hf_spec,
    gguf_spec=gguf_spec,
    hf_skip=hf_skip,
)
