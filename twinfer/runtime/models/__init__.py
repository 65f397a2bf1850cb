"""Architectures, one file each, written over the Ops interface.

`MODEL_TYPES` maps every Hugging Face `model_type` twinfer runs to the module that defines it.
GGUF files name their architecture differently (`general.architecture`); `GGUF_ARCHS` maps those.
"""

from __future__ import annotations

import importlib

from twinfer.runtime.errors import UnsupportedArchitecture
from twinfer.runtime.models.base import Model
from twinfer.runtime.spec import ModelSpec

MODEL_TYPES: dict[str, str] = {
    "gemma3": "gemma3",
    "gemma3_text": "gemma3",
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
}

# GGUF general.architecture -> HF model_type (llama.cpp stores Mixtral as "llama" with experts).
GGUF_ARCHS: dict[str, str] = {
    "gemma3": "gemma3",
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
}


def supported_types() -> list[str]:
    return sorted(MODEL_TYPES)


def model_for(spec: ModelSpec) -> Model:
    """The architecture object that runs `spec`; raises UnsupportedArchitecture with the known list."""
    module_name = MODEL_TYPES.get(spec.model_type)
    if module_name is None:
        raise UnsupportedArchitecture(
            f"unsupported architecture {spec.model_type!r}: twinfer runs {', '.join(supported_types())}"
        )
    module = importlib.import_module(f"twinfer.runtime.models.{module_name}")
    model: Model = module.Model(spec)
    return model
