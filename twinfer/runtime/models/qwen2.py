"""Qwen2: Llama's decoder with biases on the Q, K and V projections (`q_bias`, `k_bias`, `v_bias`).
The biases ride in `base.Model.attention` through `w.get(...)`; nothing else differs."""

from __future__ import annotations

from typing import Any

from twinfer.runtime.models.arch import Architecture, Fields
from twinfer.runtime.models.base import Model as _Decoder
from twinfer.runtime.models.common import GGUF_DECODER, HF_DECODER, qwen_layer_types


class Model(_Decoder):
    pass


def qwen_sliding(c: dict[str, Any], fields: Fields) -> Fields:
    """Qwen's `use_sliding_window` layers, unless the config lists its layer types."""
    types = None if c.get("layer_types") else qwen_layer_types(c, fields["num_layers"])
    return fields if types is None else fields | {"layer_types": types}


ARCH = Architecture(
    name="qwen2",
    model=Model,
    hf_names=HF_DECODER.extended("qwen2"),
    gguf_names=GGUF_DECODER.extended("qwen2 GGUF"),
    hf_defaults={"vocab_size": 151936, "max_position_embeddings": 32768, "attention_bias": True},
    hf_spec=qwen_sliding,
)
