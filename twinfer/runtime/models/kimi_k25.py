"""Kimi K2.5 (`kimi_k25`): a multimodal wrapper around a DeepSeek-V3 text model, run as deepseek_v3.
The text loader skips the vision tower by name; `open_vision` loads it on its own
(runtime/vision/kimi_k25.py, docs/images.md); INT4 experts load as published (docs/models.md, "Kimi K2.5")."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from twinfer.runtime.errors import ModelError
from twinfer.runtime.loaders.names import rule
from twinfer.runtime.models import deepseek_v3
from twinfer.runtime.models.arch import Architecture
from twinfer.runtime.ops import Ops
from twinfer.runtime.spec import ModelSpec

if TYPE_CHECKING:
    from twinfer.runtime.vision import VisionTower

HF_NAMES = deepseek_v3.HF_NAMES.extended(
    "kimi_k25",
    (rule("vision_tower.{*}", None), rule("mm_projector.{*}", None)),
    aliases=(
        ("language_model.model.", "model."),  # as published
        ("language_model.lm_head.", "lm_head."),
        ("model.language_model.", "model."),  # transformers 5
        ("model.vision_tower.", "vision_tower."),
        ("model.mm_projector.", "mm_projector."),
    ),
)


def hf_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's keys, with the wrapper's `tie_word_embeddings` (transformers ties by it)."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ModelError("config.json of a kimi_k25 model has no 'text_config' object; re-download config.json")
    return {**text, "tie_word_embeddings": bool(config.get("tie_word_embeddings", True))}


def open_vision(folder: Path, config: dict[str, Any], spec: ModelSpec, ops: Ops) -> VisionTower | None:
    """The MoonViT tower and patch-merger projector of the checkpoint (runtime/vision/kimi_k25.py)."""
    from twinfer.runtime.vision.kimi_k25 import open_kimi_vision

    return open_kimi_vision(folder, config, spec, ops)


ARCH = Architecture(
    name="deepseek_v3",
    model=deepseek_v3.Model,
    hf_names=HF_NAMES,
    hf_defaults=deepseek_v3.ARCH.hf_defaults,
    hf_config=hf_config,
    hf_spec=deepseek_v3.hf_spec,
    hf_skip=deepseek_v3.hf_skip,
    vision=open_vision,
)
