"""Qwen3: Llama's decoder with per-head RMSNorm on queries and keys (`spec.qk_norm`), no biases."""

from __future__ import annotations

from typing import Any

from twinfer.runtime.models.arch import Architecture, Fields
from twinfer.runtime.models.base import Model as _Decoder
from twinfer.runtime.models.common import GGUF_DECODER, GGUF_QK_NORM, HF_DECODER
from twinfer.runtime.models.qwen2 import qwen_sliding


class Model(_Decoder):
    pass


def hf_spec(c: dict[str, Any], fields: Fields) -> Fields:
    return qwen_sliding(c, fields) | {"qk_norm": True}


ARCH = Architecture(
    name="qwen3",
    model=Model,
    hf_names=HF_DECODER.extended("qwen3"),
    gguf_names=GGUF_DECODER.extended("qwen3 GGUF", GGUF_QK_NORM),
    hf_defaults={"vocab_size": 151936, "max_position_embeddings": 32768},
    hf_spec=hf_spec,
)
