"""GLM-4.5 / 4.6 / 4.5-Air (`glm4_moe`): grouped-query attention with partial rotary and optional
QK-norm, DeepSeek-style MoE after `first_k_dense_replace` dense layers; MTP layers are skipped by name
(docs/models.md, "GLM-4.5")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from twinfer.runtime.loaders.names import NameTable, rule
from twinfer.runtime.models.arch import Architecture, Fields
from twinfer.runtime.models.common import GGUF_COMMON, GGUF_QK, GGUF_QK_NORM, HF_DECODER
from twinfer.runtime.models.shared_experts import (
    GGUF_MOE_RULES,
    HF_MOE_RULES,
    SharedExpertsDecoder,
    moe_from_config,
    moe_from_gguf,
)
from twinfer.runtime.spec import ModelSpec

if TYPE_CHECKING:
    from twinfer.runtime.loaders.gguf_file import GGUFKeys


class Model(SharedExpertsDecoder):
    pass


def hf_spec(c: dict[str, Any], fields: Fields) -> Fields:
    return fields | dict(qk_norm=bool(c.get("use_qk_norm")), moe=moe_from_config(c))


def hf_skip(c: dict[str, Any]) -> tuple[str, ...]:
    """The multi-token-prediction layers' tensors (`model.layers.{N + j}.*`), which twinfer does not run."""
    n = int(c["num_hidden_layers"])
    return tuple(f"model.layers.{n + j}." for j in range(int(c.get("num_nextn_predict_layers") or 0)))


GGUF_NAMES = NameTable(
    "glm4moe GGUF",
    GGUF_COMMON + GGUF_QK + GGUF_QK_NORM + GGUF_MOE_RULES
    + (rule("blk.{i}.post_attention_norm.weight", "layers.{i}.mlp_norm"),),
)


def gguf_spec(k: GGUFKeys, fields: Fields) -> Fields:
    rotary = k.int("rope.dimension_count", fields["head_dim"])
    return fields | dict(
        num_layers=fields["num_layers"] - k.int("nextn_predict_layers", 0),
        partial_rotary_factor=rotary / fields["head_dim"],
        moe=moe_from_gguf(k),
    )


def gguf_skip(k: GGUFKeys, spec: ModelSpec) -> tuple[str, ...]:
    """The multi-token-prediction blocks (`blk.{N + j}.*`) the converter appends, which twinfer does not run."""
    n = spec.num_layers
    return tuple(f"blk.{n + j}." for j in range(k.int("nextn_predict_layers", 0)))


ARCH = Architecture(
    name="glm4_moe",
    model=Model,
    hf_names=HF_DECODER.extended("glm4_moe", HF_MOE_RULES),
    gguf_names=GGUF_NAMES,
    hf_defaults={
        "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944, "num_hidden_layers": 46,
        "num_attention_heads": 96, "num_key_value_heads": 8, "partial_rotary_factor": 0.5,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "moe_intermediate_size": 1408,
        "num_experts_per_tok": 8, "n_shared_experts": 1, "n_routed_experts": 128, "routed_scaling_factor": 1.0,
        "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True, "use_qk_norm": False,
    },  # transformers' Glm4MoeConfig defaults
    hf_spec=hf_spec,
    hf_skip=hf_skip,
    gguf_spec=gguf_spec,
    gguf_skip=gguf_skip,
)
