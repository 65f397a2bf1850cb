"""Qwen3.5 MoE (the text model): Qwen3-Next's hybrid layers with the linear projections stored apart.

The forward pass is qwen3_next's. The differences are in the checkpoint: in_proj_qkv, in_proj_z,
in_proj_b and in_proj_a are separate tensors already in the canonical order (no per-key-head
grouping), the router always renormalizes its top k, and the published checkpoints are multimodal
(`Qwen3_5MoeForConditionalGeneration`): the text model's keys sit in `text_config`, its tensors under
`model.language_model.`, and the vision tower and the multi-token-prediction head are not read.
Text positions are the same on all three mrope axes, which makes its interleaved mrope plain rope.
"""

from __future__ import annotations

from typing import Any

from twinfer.runtime.loaders.names import NameTable, rule
from twinfer.runtime.models import qwen3_next
from twinfer.runtime.models.arch import Architecture, Fields
from twinfer.runtime.models.qwen3_next import LIN, TRANSFORMS


class Model(qwen3_next.Model):
    pass


HF_NAMES = NameTable("qwen3_5_moe", qwen3_next.HF_RULES + (
    rule(LIN + "in_proj_qkv.weight", "layers.{i}.lin.qkv"),
    rule(LIN + "in_proj_z.weight", "layers.{i}.lin.z"),
    rule(LIN + "in_proj_b.weight", "layers.{i}.lin.b"),
    rule(LIN + "in_proj_a.weight", "layers.{i}.lin.a"),
    rule("model.visual.{*}", None),  # the vision tower is not part of a text model
), aliases=(("model.language_model.", "model."),), transforms=TRANSFORMS)


def hf_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's keys: the multimodal config nests them in `text_config`."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else None
    return dict(text or config)


def hf_spec(c: dict[str, Any], fields: Fields) -> Fields:
    c = {**c, "norm_topk_prob": True}  # Qwen3.5's router always renormalizes its top k
    out = qwen3_next.hf_spec(c, fields)
    if not c.get("intermediate_size") and out["moe"] is not None:  # no dense MLP: the shared expert's width
        out["intermediate_size"] = out["moe"].shared_intermediate_size
    return out


ARCH = Architecture(
    name="qwen3_5_moe",
    model=Model,
    hf_names=HF_NAMES,
    hf_defaults={**qwen3_next.HF_DEFAULTS, "vocab_size": 248320, "max_position_embeddings": 262144,
                 "intermediate_size": 0},
    hf_config=hf_config,
    hf_spec=hf_spec,
    hf_skip=qwen3_next.hf_skip,
)
