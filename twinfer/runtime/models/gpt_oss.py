"""gpt-oss (`gpt_oss`): attention with per-head sinks, alternating sliding and full layers, YaRN rope,
biased Q/K/V/O; a biased router and experts running a clamped SwiGLU. Expert layouts (interleaved
gate/up, MXFP4, GGUF): docs/models.md, "gpt-oss"."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from twinfer.formats.mxfp4 import load_mxfp4_tensor
from twinfer.runtime.loaders.names import NameTable, rule
from twinfer.runtime.loaders.weights import Shape, Transform
from twinfer.runtime.models.arch import Architecture, Fields
from twinfer.runtime.models.base import Model as _Decoder
from twinfer.runtime.models.base import Shapes, Weights
from twinfer.runtime.models.common import GGUF_COMMON, GGUF_QK, HF_COMMON, L
from twinfer.runtime.ops import Array, ExpertExtras, Ops
from twinfer.runtime.spec import FULL, SLIDING, ModelSpec, MoESpec

if TYPE_CHECKING:
    from twinfer.runtime.loaders.gguf_file import GGUFKeys


class Model(_Decoder):
    def attention_shapes(self, p: str) -> Shapes:
        s = self.spec
        return super().attention_shapes(p) | {p + "sinks": (s.num_heads,), p + "o_bias": (s.hidden_size,)}

    def feed_forward_shapes(self, p: str, layer: int) -> Shapes:
        out = super().feed_forward_shapes(p, layer)
        m = self.spec.moe
        assert m is not None
        E, Ie, C = m.num_experts, m.expert_intermediate_size, self.spec.hidden_size
        return out | {p + "router_bias": (E,), p + "experts.gate_bias": (E, Ie), p + "experts.up_bias": (E, Ie),
                      p + "experts.down_bias": (E, C)}

    def feed_forward(self, ops: Ops, w: Weights, p: str, layer: int, h: Array) -> Array:
        assert self.spec.moe is not None
        extras = ExpertExtras(router_bias=w[p + "router_bias"], gate_bias=w[p + "experts.gate_bias"],
                              up_bias=w[p + "experts.up_bias"], down_bias=w[p + "experts.down_bias"])
        return ops.moe(h, w[p + "router"], w[p + "experts.gate"], w[p + "experts.up"], w[p + "experts.down"],
                       self.spec.moe, self.spec.hidden_act, extras)


def _columns(part: int, transpose: bool) -> Transform:
    """Every other column of the last axis from `part` (0: gate, 1: up), moved to rows when `transpose`."""

    def apply(a: list[np.ndarray], spec: ModelSpec) -> np.ndarray:
        picked = a[0][..., part::2]
        return picked.transpose(0, 2, 1) if transpose else picked

    def shape(s: list[Shape], spec: ModelSpec) -> Shape:
        if transpose:  # [E, C, 2I] -> [E, I, C]
            return (s[0][0], s[0][2] // 2, s[0][1])
        return (*s[0][:-1], s[0][-1] // 2)

    return Transform(apply, shape, split=2)


MXFP4_PARTS = ("blocks", "scales")


def _mxfp4(rows: int | None) -> Transform:
    """Dequantized MXFP4 experts [E, out, in]; `rows` 0 / 1 keeps the even (gate) / odd (up) rows."""

    def apply(a: list[np.ndarray], spec: ModelSpec) -> np.ndarray:
        w = load_mxfp4_tensor(a[0], a[1])  # [E, out, G, 16] + [E, out, G] -> [E, out, G * 32]
        return w if rows is None else w[:, rows::2]

    def shape(s: list[Shape], spec: ModelSpec) -> Shape:
        E, out, groups, _ = s[0]
        return (E, out if rows is None else out // 2, groups * 32)

    return Transform(apply, shape, split=1 if rows is None else 2, parts=MXFP4_PARTS)


_TRANSPOSE = Transform(lambda a, spec: a[0].transpose(0, 2, 1), lambda s, spec: (s[0][0], s[0][2], s[0][1]))
_X = L + "mlp.experts."
HF_NAMES = NameTable(
    "gpt_oss",
    tuple(r for r in HF_COMMON if ".mlp." not in r.source) + (
        rule(L + "self_attn.o_proj.bias", "layers.{i}.o_bias"),
        rule(L + "self_attn.sinks", "layers.{i}.sinks"),
        rule(L + "mlp.router.weight", "layers.{i}.router"),
        rule(L + "mlp.router.bias", "layers.{i}.router_bias"),
        rule(_X + "gate_up_proj", "layers.{i}.experts.gate", "gate_columns"),
        rule(_X + "gate_up_proj", "layers.{i}.experts.up", "up_columns"),
        rule(_X + "gate_up_proj_bias", "layers.{i}.experts.gate_bias", "gate_bias_columns"),
        rule(_X + "gate_up_proj_bias", "layers.{i}.experts.up_bias", "up_bias_columns"),
        rule(_X + "down_proj", "layers.{i}.experts.down", "transpose_experts"),
        rule(_X + "down_proj_bias", "layers.{i}.experts.down_bias"),
        rule(_X + "gate_up_proj_{part}", "layers.{i}.experts.gate", "mxfp4_gate"),
        rule(_X + "gate_up_proj_{part}", "layers.{i}.experts.up", "mxfp4_up"),
        rule(_X + "down_proj_{part}", "layers.{i}.experts.down", "mxfp4_experts"),
    ),
    transforms=(("gate_columns", _columns(0, True)), ("up_columns", _columns(1, True)),
                ("gate_bias_columns", _columns(0, False)), ("up_bias_columns", _columns(1, False)),
                ("transpose_experts", _TRANSPOSE), ("mxfp4_gate", _mxfp4(0)), ("mxfp4_up", _mxfp4(1)),
                ("mxfp4_experts", _mxfp4(None))),
)


def hf_spec(c: dict[str, Any], fields: Fields) -> Fields:
    moe = MoESpec(
        num_experts=int(c["num_local_experts"]),
        top_k=int(c["num_experts_per_tok"]),
        expert_intermediate_size=int(c["intermediate_size"]),
        norm_topk_prob=True,  # softmax over the top-k logits = softmax over all, renormalized
        router_softmax_before_topk=False,
        router_bias=True,
        expert_bias=True,
        swiglu_limit=float(c["swiglu_limit"]),
        swiglu_alpha=float(c.get("swiglu_alpha", 1.702)),
    )
    return fields | dict(moe=moe, attention_sinks=True)


_B = "blk.{i}."
GGUF_NAMES = NameTable(
    "gpt-oss GGUF",
    GGUF_COMMON + GGUF_QK + (
        rule(_B + "attn_output.bias", "layers.{i}.o_bias"),
        rule(_B + "attn_sinks.weight", "layers.{i}.sinks"),
        rule(_B + "post_attention_norm.weight", "layers.{i}.mlp_norm"),
        rule(_B + "ffn_gate_inp.weight", "layers.{i}.router"),
        rule(_B + "ffn_gate_inp.bias", "layers.{i}.router_bias"),
        *(rule(_B + f"ffn_{p}_exps.weight", f"layers.{{i}}.experts.{p}") for p in ("gate", "up", "down")),
        *(rule(_B + f"ffn_{p}_exps.bias", f"layers.{{i}}.experts.{p}_bias") for p in ("gate", "up", "down")),
    ),
)
SWIGLU_LIMIT, SWIGLU_ALPHA = 7.0, 1.702  # llama.cpp's LLM_FFN_SWIGLU_OAI_MOE constants


def gguf_spec(k: GGUFKeys, fields: Fields) -> Fields:
    assert fields["moe"] is not None, "gpt-oss GGUFs have experts"
    moe = MoESpec(
        num_experts=fields["moe"].num_experts, top_k=fields["moe"].top_k,
        expert_intermediate_size=fields["moe"].expert_intermediate_size, norm_topk_prob=True,
        router_softmax_before_topk=False, router_bias=True, expert_bias=True, swiglu_limit=SWIGLU_LIMIT,
        swiglu_alpha=SWIGLU_ALPHA,
    )
    n = fields["num_layers"]
    pattern = k.meta.get(f"{k.arch}.attention.sliding_window_pattern")  # per layer, true = sliding
    if isinstance(pattern, list) and len(pattern) == n:
        types = tuple(SLIDING if p else FULL for p in pattern)
    else:
        types = tuple(SLIDING if i % 2 == 0 else FULL for i in range(n))
    return fields | dict(moe=moe, attention_sinks=True, sliding_window=k.int("attention.sliding_window"),
                         layer_types=types)


ARCH = Architecture(
    name="gpt_oss",
    model=Model,
    hf_names=HF_NAMES,
    hf_defaults={
        "num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
        "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
        "sliding_window": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 150000.0,
        "num_experts_per_tok": 4, "swiglu_limit": 7.0, "swiglu_alpha": 1.702, "attention_bias": True,
    },  # transformers' GptOssConfig defaults
    hf_spec=hf_spec,
    hf_quant_methods=("mxfp4",),
    gguf_names=GGUF_NAMES,
    gguf_spec=gguf_spec,
)
