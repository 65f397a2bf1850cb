"""Architectures, one file each, written over the Ops interface, and the registry that finds them.

`MODEL_TYPES` maps every Hugging Face `model_type` twinfer runs to the file that defines it;
GGUF files name their architecture differently (`general.architecture`), and `GGUF_ARCHS` maps
those. Each file's `ARCH` (an `arch.Architecture`) declares its name tables, config
reading and model class; files are imported only when asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from twinfer.runtime.errors import UnsupportedArchitecture
from twinfer.runtime.spec import ModelSpec

if TYPE_CHECKING:
    from twinfer.runtime.models.arch import Architecture
    from twinfer.runtime.models.base import Model

MODEL_TYPES: dict[str, str] = {
    "gemma3": "gemma3",
    "gemma3_text": "gemma3",
    "gemma4": "gemma4",
    "gemma4_text": "gemma4",
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "qwen3_next": "qwen3_next",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "mixtral": "mixtral",
    "glm4_moe": "glm4_moe",
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "deepseek_v32": "deepseek_v32",
    "glm_moe_dsa": "glm_moe_dsa",
    "kimi_k25": "kimi_k25",
    "gpt_oss": "gpt_oss",
    "minimax_m2": "minimax_m2",
}

# GGUF general.architecture -> model file (llama.cpp stores Mixtral as "llama" with experts).
GGUF_ARCHS: dict[str, str] = {
    "gemma3": "gemma3",
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "qwen3next": "qwen3_next",
    "qwen35moe": "qwen3_5_moe",
    "glm4moe": "glm4_moe",
    "deepseek2": "deepseek_v3",
    "deepseek32": "deepseek_v32",
    "glm-dsa": "glm_moe_dsa",
    "gpt-oss": "gpt_oss",
    "minimax-m2": "minimax_m2",
}


# model_types twinfer recognises but does not run yet -> the file whose `refusal()` names what is missing
NOT_YET: dict[str, str] = {
    "deepseek_v4": "deepseek_v4",
}


def supported_types() -> list[str]:
    return sorted(MODEL_TYPES)


def not_yet(model_type: object) -> str | None:
    """Why twinfer does not run `model_type` yet (one line), or None for a type it does not recognise."""
    module_name = NOT_YET.get(model_type) if isinstance(model_type, str) else None
    if module_name is None:
        return None
    reason: str = importlib.import_module(f"twinfer.runtime.models.{module_name}").refusal()
    return reason


def _load(module_name: str) -> Architecture:
    module = importlib.import_module(f"twinfer.runtime.models.{module_name}")
    arch: Architecture = module.ARCH
    return arch


def architecture(model_type: object) -> Architecture | None:
    """The architecture of a Hugging Face `model_type`, or None when twinfer has no file for it."""
    module_name = MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
    return None if module_name is None else _load(module_name)


def gguf_architecture(arch: object) -> Architecture | None:
    """The architecture of a GGUF `general.architecture`, or None when twinfer does not read it."""
    module_name = GGUF_ARCHS.get(arch) if isinstance(arch, str) else None
    return None if module_name is None else _load(module_name)


def model_for(spec: ModelSpec) -> Model:
    """The architecture object that runs `spec`; raises UnsupportedArchitecture with the known list."""
    arch = architecture(spec.model_type)
    if arch is None:
        raise UnsupportedArchitecture(
            f"unsupported architecture {spec.model_type!r}: twinfer runs {', '.join(supported_types())}"
        )
    return arch.model(spec)
