"""The DeepSeek-style MoE feed-forward shared by deepseek_v3 and glm4_moe.

Routed experts chosen by a sigmoid router with a score-correction bias, group-limited top-k and a
scaling factor (all in `MoESpec`, run by `Ops.moe`), plus shared experts that every token passes
through: one dense MLP of `shared_intermediate_size` (`shared.gate/up/down`). The first
`first_dense_layers` layers have a plain dense MLP instead.
"""

from __future__ import annotations

from typing import Any

from twinfer.runtime.loaders.names import rule
from twinfer.runtime.models.base import Model as _Decoder
from twinfer.runtime.models.base import Shapes, Weights
from twinfer.runtime.models.common import L
from twinfer.runtime.ops import Array, ExpertExtras, Ops
from twinfer.runtime.spec import SIGMOID, MoESpec

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
