"""Qwen3-MoE: Qwen3 attention (QK-norm) with a routed-expert feed-forward.

Router: softmax over all experts, keep the top k, renormalize when `moe.norm_topk_prob`.
The feed-forward dispatch is `Ops.moe`, which a backend may fuse.
"""

from __future__ import annotations

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
