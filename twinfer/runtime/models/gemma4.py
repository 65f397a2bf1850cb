"""Gemma 4 (text): Gemma 3's sandwich-norm decoder with two kinds of attention layer, per-layer
embeddings, KV shared by the last layers, and an MoE block beside the dense MLP (docs/models.md,
"Gemma 4")."""

from __future__ import annotations

from typing import Any

import numpy as np

from twinfer.runtime.errors import UnsupportedArchitecture
from twinfer.runtime.loaders.names import NameTable, rule
from twinfer.runtime.loaders.weights import Transform, elementwise
from twinfer.runtime.models.arch import Architecture, Fields
from twinfer.runtime.models.base import Model as _Decoder
from twinfer.runtime.models.base import Shapes, Weights
from twinfer.runtime.models.common import L
from twinfer.runtime.ops import Array, ExpertExtras, Ops, StepContext
from twinfer.runtime.spec import FULL, SLIDING, ModelSpec, MoESpec

SWA_PATTERN = 6  # transformers' default layer pattern: every 6th layer is global


class Model(_Decoder):
    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        extra = dict(spec.extra)
        self.ple_dim = int(extra.get("per_layer_dim", 0))  # P: the per-layer embedding's width (0: none)
        self.ple_vocab = int(extra.get("per_layer_vocab", spec.vocab_size))
        self.k_eq_v = bool(extra.get("k_eq_v", False))
        self.double_wide = bool(extra.get("double_wide_mlp", False))

    def weight_shapes(self) -> Shapes:
        s = self.spec
        C, N, P = s.hidden_size, s.num_layers, self.ple_dim
        out: Shapes = {"embed": (s.vocab_size, C), "norm": (C,)}
        if not s.tie_word_embeddings:
            out["lm_head"] = (s.vocab_size, C)
        if P:
            out |= {"per_layer.embed": (N, self.ple_vocab, P), "per_layer.proj": (N, P, C), "per_layer.norm": (P,)}
        for i in range(N):
            p = f"layers.{i}."
            out |= self._attention_shapes(p, i) | self.layer_norm_shapes(p) | self.feed_forward_shapes(p, i)
            if P:
                out |= {p + "per_layer_gate": (P, C), p + "per_layer_out": (C, P), p + "per_layer_norm": (C,)}
        return out

    def _attention_shapes(self, p: str, layer: int) -> Shapes:
        s = self.spec
        C, H, D, Hkv = s.hidden_size, s.num_heads, s.head_dim_for(layer), s.kv_heads_for(layer)
        out: Shapes = {p + "q": (H * D, C), p + "o": (C, H * D), p + "q_norm": (D,)}
        if s.owns_kv(layer):
            out |= {p + "k": (Hkv * D, C), p + "k_norm": (D,), p + "v_norm": (D,)}
            if not self._values_are_keys(layer):
                out[p + "v"] = (Hkv * D, C)
        return out

    def layer_norm_shapes(self, p: str) -> Shapes:
        C = self.spec.hidden_size
        out: Shapes = {p + n: (C,) for n in ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm")}
        return out | {p + "layer_scalar": (1,)}

    def feed_forward_shapes(self, p: str, layer: int) -> Shapes:
        s = self.spec
        C, FF = s.hidden_size, self._mlp_size(layer)
        out: Shapes = {p + "gate": (FF, C), p + "up": (FF, C), p + "down": (C, FF)}
        if s.moe is not None:
            E, Ie = s.moe.num_experts, s.moe.expert_intermediate_size
            out |= {p + "router": (E, C), p + "router_norm": (C,), p + "expert_scale": (E,),
                    p + "experts.gate": (E, Ie, C), p + "experts.up": (E, Ie, C), p + "experts.down": (E, C, Ie)}
            out |= {p + n: (C,) for n in ("post_mlp_norm_1", "mlp_norm_2", "post_mlp_norm_2")}
        return out

    def _values_are_keys(self, layer: int) -> bool:
        return self.k_eq_v and self.spec.attention_types[layer] == FULL

    def _mlp_size(self, layer: int) -> int:
        # use_double_wide_mlp: the layers that share KV have an MLP twice as wide
        wide = self.double_wide and not self.spec.owns_kv(layer)
        return self.spec.intermediate_size * (2 if wide else 1)

    def block(self, ops: Ops, w: Weights, p: str, layer: int, x: Array, ctx: StepContext) -> Array:
        eps = self.spec.rms_norm_eps
        h = self.attention(ops, w, p, layer, ops.rms_norm(x, w[p + "attn_norm"], eps), ctx)
        x = x + ops.rms_norm(h, w[p + "post_attn_norm"], eps)
        x = x + ops.rms_norm(self._feed_forward(ops, w, p, layer, x), w[p + "post_mlp_norm"], eps)
        if self.ple_dim:
            x = x + self._per_layer(ops, w, p, layer, x, ctx)
        return x * w[p + "layer_scalar"]

    def attention(self, ops: Ops, w: Weights, p: str, layer: int, h: Array, ctx: StepContext) -> Array:
        s = self.spec
        T, H, D, Hkv, eps = h.shape[0], s.num_heads, s.head_dim_for(layer), s.kv_heads_for(layer), s.rms_norm_eps
        q = ops.linear(h, w[p + "q"]).reshape(T, H, D)
        q = ops.rope(ops.rms_norm(q, w[p + "q_norm"], eps), ctx, layer)
        source = s.kv_source(layer)
        if source != layer:  # the cache an earlier layer of the same type stored in this step
            o = ops.attention(q, None, None, ctx, source)
        else:
            k = ops.linear(h, w[p + "k"]).reshape(T, Hkv, D)
            v = k if self._values_are_keys(layer) else ops.linear(h, w[p + "v"]).reshape(T, Hkv, D)
            k = ops.rope(ops.rms_norm(k, w[p + "k_norm"], eps), ctx, layer)
            o = ops.attention(q, k, ops.rms_norm(v, w[p + "v_norm"], eps), ctx, layer)  # [T, H, D]
        return ops.linear(o.reshape(T, H * D), w[p + "o"])

    def _feed_forward(self, ops: Ops, w: Weights, p: str, layer: int, x: Array) -> Array:
        """The dense MLP on the residual x, plus (MoE configs) the routed experts beside it."""
        s, eps = self.spec, self.spec.rms_norm_eps
        h = self.mlp(ops, w, p, ops.rms_norm(x, w[p + "mlp_norm"], eps))
        if s.moe is None:
            return h
        # the router scores the residual normed by its own scale (x C^-0.5, folded in at load)
        extras = ExpertExtras(router_input=ops.rms_norm(x, w[p + "router_norm"], eps), expert_scale=w[p + "expert_scale"])
        experts = ops.moe(ops.rms_norm(x, w[p + "mlp_norm_2"], eps), w[p + "router"], w[p + "experts.gate"],
                          w[p + "experts.up"], w[p + "experts.down"], s.moe, s.hidden_act, extras)
        return ops.rms_norm(h, w[p + "post_mlp_norm_1"], eps) + ops.rms_norm(experts, w[p + "post_mlp_norm_2"], eps)

    def _per_layer(self, ops: Ops, w: Weights, p: str, layer: int, x: Array, ctx: StepContext) -> Array:
        """The block's per-layer-embedding residual: its input [T, P] gates a projection of x."""
        eps = self.spec.rms_norm_eps
        gate = ops.act(ops.linear(x, w[p + "per_layer_gate"]), self.spec.hidden_act)
        out = ops.linear(gate * self._per_layer_input(ops, w, layer, ctx), w[p + "per_layer_out"])
        return ops.rms_norm(out, w[p + "per_layer_norm"], eps)

    def _per_layer_input(self, ops: Ops, w: Weights, layer: int, ctx: StepContext) -> Array:
        """Layer's slice of the PLE input [T, P]: (norm(embedding @ proj * C^-0.5) + table[token] * P^0.5) / sqrt 2.

        Computed per layer from the step's tokens (a [T, C] and a [T, P] gather), so a block needs
        nothing but its own inputs (pipeline stages, pruning and drafts call blocks one by one)."""
        s, P = self.spec, self.ple_dim
        token = ops.embedding(w["per_layer.embed"][layer], ctx.tokens) * (P**0.5)
        mixed = ops.linear(self.embed(ops, w, ctx), w["per_layer.proj"][layer]) * (s.hidden_size**-0.5)
        return (ops.rms_norm(mixed, w["per_layer.norm"], s.rms_norm_eps) + token) * (2.0**-0.5)


def _per_layer_table(a: list[np.ndarray], spec: ModelSpec) -> np.ndarray:
    """[V, N*P] (all layers' vectors side by side) -> [N, V, P]: one contiguous table per layer."""
    V, NP = a[0].shape
    return np.ascontiguousarray(a[0].reshape(V, spec.num_layers, NP // spec.num_layers).transpose(1, 0, 2))


def _per_layer_proj(a: list[np.ndarray], spec: ModelSpec) -> np.ndarray:
    NP, C = a[0].shape  # [N*P, C] -> [N, P, C]
    return a[0].reshape(spec.num_layers, NP // spec.num_layers, C)


_TRANSFORMS = (
    ("ple_table", Transform(_per_layer_table, lambda s, spec: (spec.num_layers, s[0][0], s[0][1] // spec.num_layers))),
    ("ple_proj", Transform(_per_layer_proj, lambda s, spec: (spec.num_layers, s[0][0] // spec.num_layers, s[0][1]))),
    ("unit", elementwise(np.ones_like)),  # the value norm has no scale: a weight of ones
    ("root_scale", elementwise(lambda a: a * np.float32(a.shape[-1] ** -0.5))),  # the router's C^-0.5
)
HF_NAMES = NameTable(
    "gemma4",
    (
        rule("model.embed_tokens.weight", "embed"),
        rule("model.norm.weight", "norm"),
        rule("lm_head.weight", "lm_head"),
        rule("model.embed_tokens_per_layer.weight", "per_layer.embed", "ple_table"),
        rule("model.per_layer_model_projection.weight", "per_layer.proj", "ple_proj"),
        rule("model.per_layer_projection_norm.weight", "per_layer.norm"),
        rule(L + "input_layernorm.weight", "layers.{i}.attn_norm"),
        rule(L + "post_attention_layernorm.weight", "layers.{i}.post_attn_norm"),
        rule(L + "pre_feedforward_layernorm.weight", "layers.{i}.mlp_norm"),
        rule(L + "post_feedforward_layernorm.weight", "layers.{i}.post_mlp_norm"),
        rule(L + "layer_scalar", "layers.{i}.layer_scalar"),
        *(rule(L + f"self_attn.{p}_proj.weight", "layers.{i}." + p) for p in "qkvo"),
        rule(L + "self_attn.q_norm.weight", "layers.{i}.q_norm"),
        rule(L + "self_attn.k_norm.weight", "layers.{i}.k_norm"),
        rule(L + "self_attn.k_norm.weight", "layers.{i}.v_norm", "unit"),
        *(rule(L + f"mlp.{p}_proj.weight", "layers.{i}." + p) for p in ("gate", "up", "down")),
        rule(L + "per_layer_input_gate.weight", "layers.{i}.per_layer_gate"),
        rule(L + "per_layer_projection.weight", "layers.{i}.per_layer_out"),
        rule(L + "post_per_layer_input_norm.weight", "layers.{i}.per_layer_norm"),
        rule(L + "router.proj.weight", "layers.{i}.router"),
        rule(L + "router.scale", "layers.{i}.router_norm", "root_scale"),
        rule(L + "router.per_expert_scale", "layers.{i}.expert_scale"),
        rule(L + "experts.gate_up_proj", "layers.{i}.experts.gate", "gate_half"),
        rule(L + "experts.gate_up_proj", "layers.{i}.experts.up", "up_half"),
        rule(L + "experts.down_proj", "layers.{i}.experts.down"),
        rule(L + "post_feedforward_layernorm_1.weight", "layers.{i}.post_mlp_norm_1"),
        rule(L + "pre_feedforward_layernorm_2.weight", "layers.{i}.mlp_norm_2"),
        rule(L + "post_feedforward_layernorm_2.weight", "layers.{i}.post_mlp_norm_2"),
        # Gemma4ForConditionalGeneration checkpoints: the image and audio sides are not part of a text model.
        *(rule(f"model.{tower}.{{*}}", None) for tower in ("vision_tower", "audio_tower", "embed_vision", "embed_audio")),
    ),
    aliases=(("model.language_model.", "model."),),
    transforms=_TRANSFORMS,
)


def hf_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's keys: a multimodal config nests them in `text_config`."""
    text = config.get("text_config") if config.get("model_type") == "gemma4" else None
    c = dict(text or config)
    if "hidden_activation" in c:  # Gemma's name for hidden_act
        c["hidden_act"] = c["hidden_activation"]
    return c


def hf_spec(c: dict[str, Any], fields: Fields) -> Fields:
    _refuse(c)
    n = fields["num_layers"]
    types = fields["layer_types"] or _default_layer_types(c, n)
    head_dim, kv_heads = _global_attention(c, types)
    moe = None
    if c.get("enable_moe_block"):
        # the dense MLP beside the experts runs for every token: to the planner, one shared expert
        moe = MoESpec(num_experts=int(c["num_experts"]), top_k=int(c["top_k_experts"]),
                      expert_intermediate_size=int(c["moe_intermediate_size"]), num_shared_experts=1,
                      shared_intermediate_size=fields["intermediate_size"])
    extra = (("per_layer_dim", int(c.get("hidden_size_per_layer_input") or 0)),
             ("per_layer_vocab", int(c.get("vocab_size_per_layer_input") or fields["vocab_size"])),
             ("k_eq_v", bool(c.get("attention_k_eq_v"))), ("double_wide_mlp", bool(c.get("use_double_wide_mlp"))))
    return fields | dict(
        layer_types=types, global_head_dim=head_dim, global_kv_heads=kv_heads, moe=moe, extra=extra,
        kv_shared_layers=int(c.get("num_kv_shared_layers") or 0), qk_norm=True, embed_scale=True, softmax_scale=1.0,
        **_rope_fields(c),
    )


def _refuse(c: dict[str, Any]) -> None:
    """Config fields twinfer does not run, by name."""
    if c.get("use_bidirectional_attention") == "all":
        raise UnsupportedArchitecture("gemma4 use_bidirectional_attention='all' is not supported (causal text only)")
    if c.get("attention_bias"):
        raise UnsupportedArchitecture("gemma4 attention_bias=true is not supported")


def _default_layer_types(c: dict[str, Any], n: int) -> tuple[str, ...]:
    """transformers' default when a config lists none: every 6th layer global, and the last one always."""
    if c.get("layer_types"):  # listed, all global (common_fields keeps only patterns with sliding layers)
        return ()
    types = [FULL if (i + 1) % SWA_PATTERN == 0 else SLIDING for i in range(n)]
    types[-1] = FULL
    return tuple(types) if SLIDING in types else ()


def _global_attention(c: dict[str, Any], types: tuple[str, ...]) -> tuple[int | None, int | None]:
    """(head size, KV heads) of the global layers, from a published config's `global_head_dim` /
    `num_global_key_value_heads` or from the `per_layer_config` transformers writes."""
    per_layer = c.get("per_layer_config")
    if per_layer is None:
        # transformers applies num_global_key_value_heads only where attention_k_eq_v (its own rule)
        heads = c.get("num_global_key_value_heads") if c.get("attention_k_eq_v", True) else None
        return int(c.get("global_head_dim") or 512), int(heads) if heads else None
    kinds = types or (FULL,) * int(c["num_hidden_layers"])
    overrides = {kinds[int(i)]: tuple(sorted(v.items())) for i, v in per_layer.items()}
    full = {tuple(sorted(v.items())) for i, v in per_layer.items() if kinds[int(i)] == FULL}
    if SLIDING in overrides or len(full) > 1 or set(dict(next(iter(full), ())).keys()) - {"head_dim", "num_key_value_heads"}:
        raise UnsupportedArchitecture(f"gemma4 per_layer_config {per_layer} is not one override of the global layers")
    got = dict(next(iter(full), ()))
    return (int(got["head_dim"]) if "head_dim" in got else None,
            int(got["num_key_value_heads"]) if "num_key_value_heads" in got else None)


def _rope_fields(c: dict[str, Any]) -> Fields:
    """Sliding layers: plain rope over head_dim. Global layers: "proportional" rope over their own head
    size (a plain rope there is proportional with factor 1), kept as the spec's rope scaling."""
    params = c.get("rope_parameters") or {}
    local = params.get(SLIDING) or {"rope_type": "default", "rope_theta": 10000.0}
    full = params.get(FULL) or {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}
    if local.get("rope_type", "default") != "default" or full.get("rope_type", "default") not in ("default", "proportional"):
        raise UnsupportedArchitecture(f"gemma4 rope_parameters {params} are not supported (sliding: default; "
                                      "full: default or proportional)")
    factor = float(full.get("partial_rotary_factor", 1.0)) if full.get("rope_type") == "proportional" else 1.0
    scaling = (("factor", float(full.get("factor", 1.0))), ("partial_rotary_factor", factor),
               ("rope_type", "proportional"))
    return dict(rope_theta=float(full["rope_theta"]), rope_local_theta=float(local["rope_theta"]),
                rope_scaling=scaling, partial_rotary_factor=1.0)


ARCH = Architecture(
    name="gemma4",
    model=Model,
    hf_names=HF_NAMES,
    hf_defaults={
        "vocab_size": 262144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
        "sliding_window": 512, "tie_word_embeddings": True, "hidden_act": "gelu_pytorch_tanh",
        "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262144,
    },  # transformers' Gemma4TextConfig defaults (5.x): multimodal configs list only what differs
    hf_config=hf_config,
    hf_spec=hf_spec,
)
