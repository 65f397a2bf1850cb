"""Qwen3-MoE: Qwen3 attention (QK-norm) with a routed-expert feed-forward.
Router: softmax over all experts, keep the top k, renormalize when `moe.norm_topk_prob`.
The feed-forward dispatch is `Ops.moe`, which a backend may fuse."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from twinfer.runtime.errors import UnsupportedArchitecture
from twinfer.runtime.models import qwen3
from twinfer.runtime.models.arch import Architecture, Fields
from twinfer.runtime.models.base import Model as _Decoder
from twinfer.runtime.models.common import (
    GGUF_DECODER,
    GGUF_MOE,
    GGUF_QK_NORM,
    HF_DECODER,
    HF_FUSED_EXPERTS,
    HF_STACKED_EXPERTS,
)
from twinfer.runtime.spec import MoESpec


class Model(_Decoder):
    pass


def hf_spec(c: dict[str, Any], fields: Fields) -> Fields:
    if c.get("mlp_only_layers") or int(c.get("decoder_sparse_step", 1)) != 1:
        raise UnsupportedArchitecture(
            "qwen3_moe configs with dense layers (mlp_only_layers / decoder_sparse_step) are not supported"
        )
    moe = MoESpec(
        num_experts=int(c.get("num_experts", c.get("num_local_experts", 128))),
        top_k=int(c.get("num_experts_per_tok", 8)),
        expert_intermediate_size=int(c.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(c["norm_topk_prob"]),
    )
    return qwen3.hf_spec(c, fields) | {"moe": moe}


ARCH = Architecture(
    name="qwen3_moe",
    model=Model,
    hf_names=HF_DECODER.extended("qwen3_moe", HF_FUSED_EXPERTS + HF_STACKED_EXPERTS),
    gguf_names=GGUF_DECODER.extended("qwen3moe GGUF", GGUF_QK_NORM + GGUF_MOE),
    hf_defaults={"vocab_size": 151936, "max_position_embeddings": 32768, "norm_topk_prob": False},
    hf_spec=hf_spec,
)


@dataclass(frozen=True)
class SyntheticMoE:
    """The shape of a synthetic qwen3_moe model."""

    hidden: int = 256
    intermediate: int = 256  # per expert
    layers: int = 16
    experts: int = 16
    top_k: int = 4
    vocab: int = 512
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "F32"  # "F32" or "BF16" in the file

    @property
    def expert_bytes(self) -> int:
        """Stored bytes of every routed expert in the model."""
        item = 4 if self.dtype == "F32" else 2
        return self.layers * self.experts * 3 * self.intermediate * self.hidden * item

    def config(self) -> dict[str, object]:
        return {
            "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": self.vocab,
            "hidden_size": self.hidden, "intermediate_size": 4 * self.hidden, "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
            "moe_intermediate_size": self.intermediate, "num_experts": self.experts,
            "num_experts_per_tok": self.top_k, "norm_topk_prob": True, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "torch_dtype": "float32" if self.dtype == "F32" else "bfloat16",
        }  # fmt: skip

    def layer_tensors(self, i: int) -> Iterator[tuple[str, tuple[int, ...], float]]:
        """(name, shape, std) of layer i's tensors; std 0 marks a norm (ones plus noise)."""
        C, Ie, D = self.hidden, self.intermediate, self.head_dim
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (C,), 0.0
        yield p + "post_attention_layernorm.weight", (C,), 0.0
        yield p + "self_attn.q_proj.weight", (self.heads * D, C), C**-0.5
        yield p + "self_attn.k_proj.weight", (self.kv_heads * D, C), C**-0.5
        yield p + "self_attn.v_proj.weight", (self.kv_heads * D, C), C**-0.5
        yield p + "self_attn.o_proj.weight", (C, self.heads * D), (self.heads * D) ** -0.5
        yield p + "self_attn.q_norm.weight", (D,), 0.0
        yield p + "self_attn.k_norm.weight", (D,), 0.0
        yield p + "mlp.gate.weight", (self.experts, C), 4 * C**-0.5  # sharp routing: experts differ
        for e in range(self.experts):
            for proj, shape in (("gate", (Ie, C)), ("up", (Ie, C)), ("down", (C, Ie))):
                yield p + f"mlp.experts.{e}.{proj}_proj.weight", shape, shape[1] ** -0.5
