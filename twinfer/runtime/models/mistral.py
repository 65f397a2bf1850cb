"""Mistral: Llama's decoder; Mistral 7B v0.1 slides every layer over `sliding_window` tokens."""

from __future__ import annotations

from typing import Any

from twinfer.runtime.models import llama
from twinfer.runtime.models.arch import Architecture, Fields
from twinfer.runtime.spec import SLIDING

Model = llama.Model


def all_sliding(c: dict[str, Any], fields: Fields) -> Fields:
    """Every layer slides when the config sets a window and lists no layer types."""
    if not c.get("layer_types") and c.get("sliding_window"):
        return fields | {"layer_types": (SLIDING,) * fields["num_layers"]}
    return fields


ARCH = Architecture(
    name="mistral",
    model=Model,
    hf_names=llama.ARCH.hf_names.extended("mistral"),
    gguf_names=llama.GGUF_NAMES,
    hf_defaults={"vocab_size": 32000, "max_position_embeddings": 131072, "sliding_window": 4096},
    hf_spec=all_sliding,
    gguf_spec=llama.gguf_spec,
)
