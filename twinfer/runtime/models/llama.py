"""Llama 2/3: the plain pre-norm decoder of `base.Model`, SiLU-gated MLP, NeoX rope.

Llama 3's rope frequency scaling comes from the spec (see runtime/rope.py). llama.cpp's converter
permutes Q and K rows for its interleaved rope; the GGUF table un-permutes them. llama.cpp also
stores Mixtral under this GGUF architecture, with experts: such a file becomes a `mixtral` spec.
"""

from __future__ import annotations

from twinfer.runtime.loaders.names import NameTable, rule
from twinfer.runtime.models.arch import Architecture, Fields
from twinfer.runtime.models.base import Model as _Decoder
from twinfer.runtime.models.common import GGUF_COMMON, GGUF_MOE, HF_DECODER


class Model(_Decoder):
    pass


GGUF_QK_PERMUTED = (
    rule("blk.{i}.attn_q.weight", "layers.{i}.q", "unpermute_q"),
    rule("blk.{i}.attn_k.weight", "layers.{i}.k", "unpermute_k"),
    rule("blk.{i}.attn_q.bias", "layers.{i}.q_bias", "unpermute_q"),
    rule("blk.{i}.attn_k.bias", "layers.{i}.k_bias", "unpermute_k"),
)
GGUF_NAMES = NameTable(
    "llama GGUF",
    GGUF_COMMON + GGUF_QK_PERMUTED + GGUF_MOE + (rule("rope_freqs.weight", "rope_freqs"),),
    optional=("rope_freqs",),  # llama 3.x rope frequency factors, precomputed by the converter
)


def gguf_spec(keys: object, fields: Fields) -> Fields:
    """A llama-architecture GGUF with experts is Mixtral."""
    return fields | {"model_type": "mixtral"} if fields["moe"] is not None else fields


ARCH = Architecture(
    name="llama",
    model=Model,
    hf_names=HF_DECODER.extended("llama"),
    gguf_names=GGUF_NAMES,
    hf_defaults={"vocab_size": 32000, "max_position_embeddings": 2048},
    gguf_spec=gguf_spec,
)
