"""`Architecture`: what one model file declares about itself (name tables, config defaults, spec hooks)
for the generic loaders and the registry."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from twinfer.runtime.loaders.names import NameTable

if TYPE_CHECKING:
    from pathlib import Path

    from twinfer.runtime.loaders.gguf_file import GGUFKeys
    from twinfer.runtime.models.base import Model
    from twinfer.runtime.ops import Ops
    from twinfer.runtime.spec import ModelSpec
    from twinfer.runtime.vision import VisionTower

Fields = dict[str, Any]
"""ModelSpec keyword arguments being built by a loader."""


@dataclass(frozen=True)
class Architecture:
    """One architecture as its model file declares it: `hf_config` picks the text model's keys;
    `hf_spec`/`gguf_spec` return the generic spec fields with its own added or changed."""

    name: str  # the canonical model_type, `ModelSpec.model_type`
    model: type[Model]
    hf_names: NameTable
    gguf_names: NameTable | None = None
    hf_defaults: Mapping[str, Any] = field(default_factory=dict)
    hf_config: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    hf_spec: Callable[[dict[str, Any], Fields], Fields] | None = None
    gguf_spec: Callable[[GGUFKeys, Fields], Fields] | None = None
    gguf_skip: Callable[[GGUFKeys, ModelSpec], tuple[str, ...]] | None = None  # tensor-name prefixes left unread
    hf_skip: Callable[[dict[str, Any]], tuple[str, ...]] | None = None  # tensor-name prefixes left unread
    hf_quant_methods: tuple[str, ...] = ()  # published `quantization_config.quant_method`s its table reads
    chat_template: str | None = None  # for model files that carry none (Gemma 3 GGUFs)
    # (folder, config.json, spec, a backend's Ops) -> the checkpoint's vision tower; None where it has none
    vision: Callable[[Path, dict[str, Any], ModelSpec, Ops], VisionTower | None] | None = None
    # (text around one image's placeholder run, the placeholder token) for a projector file's runner (llama.cpp)
    image_text: tuple[str, str] | None = None
