"""Kimi K2.5 (`kimi_k25`): a multimodal wrapper around a DeepSeek-V3 text model, run as deepseek_v3.

config.json nests the text model in `text_config` (model_type `kimi_k2` / `deepseek_v3`, the keys
that differ from DeepseekV3Config's defaults); `tie_word_embeddings` is the wrapper's. Checkpoints
hold the text model under `language_model.` (`language_model.model.layers...`,
`language_model.lm_head`; transformers 5 holds `model.language_model.` and `lm_head`). Images are
not supported yet: the MoonViT vision tower and the `mm_projector` are skipped by name, and an
image in a request is refused by the chat layer. The published routed experts are INT4
compressed-tensors (pack-quantized, symmetric groups of 32, `quantization_config` inside
`text_config`), read as published by the generic loader (runtime/loaders/published.py).

GGUF: llama.cpp's converter writes the text model as `deepseek2`, which deepseek_v3.py reads.
"""

from __future__ import annotations

from typing import Any

from twinfer.runtime.errors import ModelError
from twinfer.runtime.loaders.names import rule
from twinfer.runtime.models import deepseek_v3
from twinfer.runtime.models.arch import Architecture

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


ARCH = Architecture(
    name="deepseek_v3",
    model=deepseek_v3.Model,
    hf_names=HF_NAMES,
    hf_defaults=deepseek_v3.ARCH.hf_defaults,
    hf_config=hf_config,
    hf_spec=deepseek_v3.hf_spec,
    hf_skip=deepseek_v3.hf_skip,
)
