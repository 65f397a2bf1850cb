"""Mixtral: Mistral attention with 8 SiLU experts, top-2. Softmax over the top-k logits equals
renormalized softmax over all, so the spec sets `norm_topk_prob=True` and shares `Ops.moe`."""

from __future__ import annotations

from typing import Any

from twinfer.runtime.loaders.names import rule
from twinfer.runtime.models.arch import Architecture, Fields
from twinfer.runtime.models.base import Model as _Decoder
from twinfer.runtime.models.common import HF_DECODER, HF_FUSED_EXPERTS, L
from twinfer.runtime.models.mistral import all_sliding
from twinfer.runtime.spec import MoESpec


class Model(_Decoder):
    pass


HF_NAMES = HF_DECODER.extended("mixtral", HF_FUSED_EXPERTS + (
    rule(L + "block_sparse_moe.gate.weight", "layers.{i}.router"),
    rule(L + "block_sparse_moe.experts.{e}.w1.weight", "layers.{i}.experts.gate", "stack_experts"),
    rule(L + "block_sparse_moe.experts.{e}.w3.weight", "layers.{i}.experts.up", "stack_experts"),
    rule(L + "block_sparse_moe.experts.{e}.w2.weight", "layers.{i}.experts.down", "stack_experts"),
))


def hf_spec(c: dict[str, Any], fields: Fields) -> Fields:
    experts = c.get("num_local_experts", c.get("num_experts", 8))
    moe = MoESpec(int(experts), int(c.get("num_experts_per_tok", 2)), int(c["intermediate_size"]), True)
    return all_sliding(c, fields) | {"moe": moe}


ARCH = Architecture(
    name="mixtral",
    model=Model,
    hf_names=HF_NAMES,
    hf_defaults={"vocab_size": 32000, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                 "rope_theta": 1_000_000.0},
    hf_spec=hf_spec,
)
