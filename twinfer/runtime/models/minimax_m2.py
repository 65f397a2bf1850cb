"""MiniMax-M2 / M2.1 / M2.5 (`minimax_m2`): attention with QK RMSNorm over the whole projection and
partial rotary, and a sigmoid-routed MoE without shared experts (docs/models.md, "MiniMax-M2")."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from twinfer.runtime.errors import UnsupportedArchitecture
from twinfer.runtime.loaders.names import NameTable, rule
from twinfer.runtime.models.arch import Architecture, Fields
from twinfer.runtime.models.base import Shapes, Weights
from twinfer.runtime.models.common import GGUF_COMMON, GGUF_QK, GGUF_QK_NORM, HF_DECODER, HF_FUSED_EXPERTS, L
from twinfer.runtime.models.shared_experts import GGUF_MOE_RULES, SharedExpertsDecoder, moe_from_gguf
from twinfer.runtime.ops import Array, Ops, StepContext
from twinfer.runtime.spec import SIGMOID, MoESpec

if TYPE_CHECKING:
    from twinfer.runtime.loaders.gguf_file import GGUFKeys


class Model(SharedExpertsDecoder):
    """The llama-style decoder with whole-projection QK norms; the MoE layers' score bias comes from
    `SharedExpertsDecoder` (with no shared experts)."""

    def attention_shapes(self, p: str) -> Shapes:
        s = self.spec
        return super().attention_shapes(p) | {p + "q_norm": (s.q_size,), p + "k_norm": (s.kv_size,)}

    def attention(self, ops: Ops, w: Weights, p: str, layer: int, h: Array, ctx: StepContext) -> Array:
        s, eps = self.spec, self.spec.rms_norm_eps
        T = h.shape[0]
        q = ops.rms_norm(ops.linear(h, w[p + "q"]), w[p + "q_norm"], eps).reshape(T, s.num_heads, s.head_dim)
        k = ops.rms_norm(ops.linear(h, w[p + "k"]), w[p + "k_norm"], eps).reshape(T, s.num_kv_heads, s.head_dim)
        v = ops.linear(h, w[p + "v"]).reshape(T, s.num_kv_heads, s.head_dim)
        q, k = ops.rope(q, ctx, layer), ops.rope(k, ctx, layer)
        o = ops.attention(q, k, v, ctx, layer)  # [T, H, D]
        return ops.linear(o.reshape(T, s.q_size), w[p + "o"])


_M = L + "block_sparse_moe."
HF_NAMES = HF_DECODER.extended("minimax_m2", HF_FUSED_EXPERTS + (
    rule(_M + "gate.weight", "layers.{i}.router"),
    rule(_M + "e_score_correction_bias", "layers.{i}.router_score_bias"),
    rule(L + "mlp.e_score_correction_bias", "layers.{i}.router_score_bias"),  # transformers 5's in-memory name
    rule(_M + "experts.{e}.w1.weight", "layers.{i}.experts.gate", "stack_experts"),
    rule(_M + "experts.{e}.w3.weight", "layers.{i}.experts.up", "stack_experts"),
    rule(_M + "experts.{e}.w2.weight", "layers.{i}.experts.down", "stack_experts"),
))

UNSUPPORTED = {  # config values of variants twinfer does not run, with what they are
    "qk_norm_type": ("per_layer", "QK norm per head instead of over the whole projection"),
    "use_qk_norm": (True, "attention without QK norm"),
    "scoring_func": ("sigmoid", "a router other than sigmoid"),
    "use_routing_bias": (True, "a router without e_score_correction_bias"),
}


def _rotary_factor(c: dict[str, Any], fields: Fields) -> float:
    """Released configs give `rotary_dim`; transformers 5 writes `partial_rotary_factor` (which wins)."""
    params = c.get("rope_parameters")
    explicit = "partial_rotary_factor" in c or (isinstance(params, dict) and "partial_rotary_factor" in params)
    if explicit or not c.get("rotary_dim"):
        return float(fields["partial_rotary_factor"])
    return int(c["rotary_dim"]) / int(fields["head_dim"])


def hf_spec(c: dict[str, Any], fields: Fields) -> Fields:
    for key, (want, what) in UNSUPPORTED.items():
        if c.get(key, want) != want:
            raise UnsupportedArchitecture(f"config.json {key}={c[key]!r} ({what}) is not supported by twinfer")
    if int(c.get("shared_intermediate_size") or 0):
        raise UnsupportedArchitecture("config.json sets 'shared_intermediate_size' (a shared expert), which "
                                      "twinfer's minimax_m2 does not run")
    if any(int(t) != 1 for t in c.get("attn_type_list") or ()):
        raise UnsupportedArchitecture("config.json 'attn_type_list' has linear-attention layers (0), which "
                                      "twinfer's minimax_m2 does not run")
    moe = MoESpec(
        num_experts=int(c["num_local_experts"]),
        top_k=int(c["num_experts_per_tok"]),
        expert_intermediate_size=int(c["intermediate_size"]),
        norm_topk_prob=True,
        router_softmax_before_topk=False,
        scoring=SIGMOID,
        score_bias=True,
    )
    return fields | dict(qk_norm=True, moe=moe, partial_rotary_factor=_rotary_factor(c, fields))


def hf_skip(c: dict[str, Any]) -> tuple[str, ...]:
    """The multi-token-prediction modules' tensors (`model.layers.{N + j}.*`), which twinfer does not run."""
    n = int(c["num_hidden_layers"])
    return tuple(f"model.layers.{n + j}." for j in range(int(c.get("num_mtp_modules") or 0)))


GGUF_NAMES = NameTable("minimax-m2 GGUF", GGUF_COMMON + GGUF_QK + GGUF_QK_NORM + GGUF_MOE_RULES)


def gguf_spec(k: GGUFKeys, fields: Fields) -> Fields:
    moe = moe_from_gguf(k)
    if moe is None:
        raise UnsupportedArchitecture(f"{k.path}: a minimax-m2 GGUF without experts ({k.arch}.expert_count)")
    rotary = k.int("rope.dimension_count", fields["head_dim"])
    return fields | dict(
        qk_norm=True,
        partial_rotary_factor=rotary / fields["head_dim"],
        intermediate_size=moe.expert_intermediate_size,
        moe=replace(moe, norm_topk_prob=True),  # llama.cpp's graph always renormalizes
    )


ARCH = Architecture(
    name="minimax_m2",
    model=Model,
    hf_names=HF_NAMES,
    hf_defaults={
        "vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 1536, "num_hidden_layers": 62,
        "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 196608,
        "rms_norm_eps": 1e-6, "rope_theta": 5000000.0, "num_experts_per_tok": 8, "num_local_experts": 256,
    },  # transformers' MiniMaxM2Config defaults
    hf_spec=hf_spec,
    hf_skip=hf_skip,
    gguf_names=GGUF_NAMES,
    gguf_spec=gguf_spec,
)
