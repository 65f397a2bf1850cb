"""The DeepSeek-style MoE feed-forward shared by deepseek_v3 and glm4_moe: routed experts (`MoESpec`,
`Ops.moe`) plus shared experts every token passes through; the first `first_dense_layers` are dense."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from twinfer.runtime.errors import UnsupportedArchitecture
from twinfer.runtime.loaders.names import rule
from twinfer.runtime.models.base import Model as _Decoder
from twinfer.runtime.models.base import Shapes, Weights
from twinfer.runtime.models.common import L
from twinfer.runtime.ops import Array, ExpertExtras, Ops
from twinfer.runtime.spec import SIGMOID, MoESpec

if TYPE_CHECKING:
    from twinfer.runtime.loaders.gguf_file import GGUFKeys

# transformers' names for the MoE layers (fused experts as transformers 5 holds them, or one per expert)
HF_MOE_RULES = (
    rule(L + "mlp.gate.weight", "layers.{i}.router"),
    rule(L + "mlp.gate.e_score_correction_bias", "layers.{i}.router_score_bias"),
    rule(L + "mlp.experts.gate_up_proj", "layers.{i}.experts.gate", "gate_half"),
    rule(L + "mlp.experts.gate_up_proj", "layers.{i}.experts.up", "up_half"),
    rule(L + "mlp.experts.down_proj", "layers.{i}.experts.down"),
    *(rule(L + f"mlp.experts.{{e}}.{p}_proj.weight", f"layers.{{i}}.experts.{p}", "stack_experts")
      for p in ("gate", "up", "down")),
    *(rule(L + f"mlp.shared_experts.{p}_proj.weight", f"layers.{{i}}.shared.{p}") for p in ("gate", "up", "down")),
)

# llama.cpp's names for the same layers (deepseek2, glm4moe)
GGUF_MOE_RULES = (
    rule("blk.{i}.ffn_gate_inp.weight", "layers.{i}.router"),
    rule("blk.{i}.exp_probs_b.bias", "layers.{i}.router_score_bias"),
    *(rule(f"blk.{{i}}.ffn_{p}_exps.weight", f"layers.{{i}}.experts.{p}") for p in ("gate", "up", "down")),
    *(rule(f"blk.{{i}}.ffn_{p}_shexp.weight", f"layers.{{i}}.shared.{p}") for p in ("gate", "up", "down")),
)
GATING_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def moe_from_gguf(k: GGUFKeys) -> MoESpec | None:
    """The MoESpec of a deepseek2 / glm4moe GGUF (`{arch}.expert_*`, `leading_dense_block_count`), or None
    without experts; refuses routers other than sigmoid (DeepSeek-V2's softmax files carry no gating key)."""
    experts = k.int("expert_count", 0)
    if not experts:
        return None
    gating = k.int("expert_gating_func", 0)
    if gating != GATING_SIGMOID:
        raise UnsupportedArchitecture(
            f"{k.path}: {k.arch}.expert_gating_func is {gating or 'absent (softmax)'}; twinfer runs the sigmoid "
            "router of DeepSeek-V3 / GLM-4.5 (2); re-convert with a llama.cpp that writes it"
        )
    inter, shared = k.int("expert_feed_forward_length"), k.int("expert_shared_count", 0)
    return MoESpec(
        num_experts=experts,
        top_k=k.int("expert_used_count"),
        expert_intermediate_size=inter,
        norm_topk_prob=bool(k.meta.get(f"{k.arch}.expert_weights_norm", False)),  # llama.cpp's default
        num_shared_experts=shared,
        shared_intermediate_size=inter * shared,
        first_dense_layers=k.int("leading_dense_block_count", 0),
        router_softmax_before_topk=False,
        scoring=SIGMOID,
        n_group=k.int("expert_group_count", 0) or 1,
        topk_group=k.int("expert_group_used_count", 0) or 1,
        routed_scaling_factor=k.float("expert_weights_scale", 1.0),
        score_bias=True,
    )


def moe_from_config(c: dict[str, Any]) -> MoESpec:
    """The MoESpec of a DeepSeek-V3 / GLM-4.5 config (`n_routed_experts`, `n_group`, ...)."""
    shared = int(c.get("n_shared_experts") or 0)
    inter = int(c["moe_intermediate_size"])
    return MoESpec(
        num_experts=int(c["n_routed_experts"]),
        top_k=int(c["num_experts_per_tok"]),
        expert_intermediate_size=inter,
        norm_topk_prob=bool(c["norm_topk_prob"]),
        num_shared_experts=shared,
        shared_intermediate_size=inter * shared,
        first_dense_layers=int(c.get("first_k_dense_replace") or 0),
        router_softmax_before_topk=False,
        scoring=SIGMOID,
        n_group=int(c.get("n_group") or 1),
        topk_group=int(c.get("topk_group") or 1),
        routed_scaling_factor=float(c.get("routed_scaling_factor") or 1.0),
        score_bias=True,
    )


class SharedExpertsDecoder(_Decoder):
    """A decoder whose MoE layers add shared experts to the sigmoid-routed ones."""

    def feed_forward_shapes(self, p: str, layer: int) -> Shapes:
        out = super().feed_forward_shapes(p, layer)
        moe = self.spec.moe
        if moe is None or not self.spec.is_moe_layer(layer):
            return out
        C = self.spec.hidden_size
        out[p + "router_score_bias"] = (moe.num_experts,)
        if moe.num_shared_experts:
            S = moe.shared_intermediate_size
            out |= {p + "shared.gate": (S, C), p + "shared.up": (S, C), p + "shared.down": (C, S)}
        return out

    def feed_forward(self, ops: Ops, w: Weights, p: str, layer: int, h: Array) -> Array:
        moe = self.spec.moe
        if moe is None or not self.spec.is_moe_layer(layer):
            return self.mlp(ops, w, p, h)
        extras = ExpertExtras(score_bias=w[p + "router_score_bias"])
        out = ops.moe(h, w[p + "router"], w[p + "experts.gate"], w[p + "experts.up"], w[p + "experts.down"],
                      moe, self.spec.hidden_act, extras)
        if moe.num_shared_experts:
            out = out + self.mlp(ops, w, p + "shared.", h)
        return out
