"""DeepSeek-V3.2 (`deepseek_v32`): DeepSeek-V3 with DeepSeek sparse attention (DSA): a lightning indexer
picks each query's `index_topk` tokens, applied as an exact mask over the latent attention; its keys
share the latents' slots (docs/models.md, "DeepSeek-V3.2")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from twinfer.runtime.errors import UnsupportedArchitecture
from twinfer.runtime.loaders.names import rule
from twinfer.runtime.loaders.weights import Transform
from twinfer.runtime.models import deepseek_v3
from twinfer.runtime.models.arch import Architecture, Fields
from twinfer.runtime.models.base import Shapes, Weights
from twinfer.runtime.models.common import L
from twinfer.runtime.models.deepseek_v3 import _deinterleave, mla_fields
from twinfer.runtime.models.glm4_moe import gguf_skip, hf_skip
from twinfer.runtime.ops import Array, Ops, StepContext
from twinfer.runtime.spec import DSASpec, ModelSpec

if TYPE_CHECKING:
    from twinfer.runtime.loaders.gguf_file import GGUFKeys

INDEXER_INTERLEAVED = "indexer_rope_interleave"  # a spec.extra key: the indexer's rope pairs are interleaved
INDEXER_NORM_EPS = 1e-6  # the key LayerNorm's epsilon (the reference's nn.LayerNorm(eps=1e-6))
INDEXED = "indexed_attention"  # transformers' layer type of every DSA layer


class Model(deepseek_v3.Model):
    def weight_shapes(self) -> Shapes:
        out = super().weight_shapes()
        dsa, s = _dsa(self.spec), self.spec
        q_lora = s.mla.q_lora_rank if s.mla else None
        assert q_lora, "sparse attention's indexer reads the q latent (q_lora_rank)"
        D = dsa.head_dim
        for layer in range(s.num_layers):
            if dsa.has_indexer(layer):
                p = f"layers.{layer}.indexer."
                out |= {p + "q": (dsa.n_heads * D, q_lora), p + "k": (D, s.hidden_size), p + "k_norm": (D,),
                        p + "k_norm_bias": (D,), p + "weights": (dsa.n_heads, s.hidden_size)}
        return out

    def select(self, ops: Ops, w: Weights, p: str, layer: int, h: Array, q_low: Array | None,
               ctx: StepContext) -> int | None:
        dsa = _dsa(self.spec)
        if not dsa.has_indexer(layer):
            return dsa.source(layer)  # GLM-5's shared layers: the last indexer's choice
        T, Hi, D = h.shape[0], dsa.n_heads, dsa.head_dim
        i = p + "indexer."
        q = ops.rope(ops.linear(q_low, w[i + "q"]).reshape(T, Hi, D), ctx, layer)  # [T, Hi, D]
        k = ops.layer_norm(ops.linear(h, w[i + "k"]), w[i + "k_norm"], w[i + "k_norm_bias"], INDEXER_NORM_EPS)
        k = ops.rope(k.reshape(T, 1, D), ctx, layer).reshape(T, D)
        weights = ops.linear(h, w[i + "weights"]) * (D * Hi) ** -0.5  # relu(a x) = a relu(x): the scales fold in
        ops.indexer_topk(q, k, weights, ctx, layer, dsa.top_k)
        return layer


def _dsa(spec: ModelSpec) -> DSASpec:
    assert spec.dsa is not None, "sparse-attention specs carry a DSASpec"
    return spec.dsa


def _indexer_rope_rows(part: str) -> Transform:
    """Interleaved indexer rope (GLM-5) to half-split: permute the first P rows of each indexer head
    (`q`) or of the key (`k`, its LayerNorm's weight and bias); a no-op for half-split checkpoints."""

    def apply(a: list[np.ndarray], spec: ModelSpec) -> np.ndarray:
        w, dsa, P = a[0], _dsa(spec), spec.rotary_dim
        if not dict(spec.extra).get(INDEXER_INTERLEAVED, False):
            return w
        if part == "k":
            return w[_deinterleave(w.shape[0], 0, P)]
        heads = w.reshape(dsa.n_heads, dsa.head_dim, *w.shape[1:])
        return heads[:, _deinterleave(dsa.head_dim, 0, P)].reshape(w.shape)

    return Transform(apply, lambda s, spec: s[0])


INDEXER_TRANSFORMS = (("indexer_rope_q", _indexer_rope_rows("q")), ("indexer_rope_k", _indexer_rope_rows("k")))
_I = L + "self_attn.indexer."
HF_NAMES = deepseek_v3.HF_NAMES.extended(
    "deepseek_v32",
    (
        rule(_I + "wq_b.weight", "layers.{i}.indexer.q", "indexer_rope_q"),
        rule(_I + "wk.weight", "layers.{i}.indexer.k", "indexer_rope_k"),
        rule(_I + "k_norm.weight", "layers.{i}.indexer.k_norm", "indexer_rope_k"),
        rule(_I + "k_norm.bias", "layers.{i}.indexer.k_norm_bias", "indexer_rope_k"),
        rule(_I + "weights_proj.weight", "layers.{i}.indexer.weights"),
    ),
    transforms=deepseek_v3.HF_NAMES.transforms + INDEXER_TRANSFORMS,
)
_B = "blk.{i}.indexer."
GGUF_RULES = (  # llama.cpp's names for the indexer (deepseek32, glm-dsa)
    rule(_B + "attn_q_b.weight", "layers.{i}.indexer.q", "indexer_rope_q"),
    rule(_B + "attn_k.weight", "layers.{i}.indexer.k", "indexer_rope_k"),
    rule(_B + "k_norm.weight", "layers.{i}.indexer.k_norm", "indexer_rope_k"),
    rule(_B + "k_norm.bias", "layers.{i}.indexer.k_norm_bias", "indexer_rope_k"),
    rule(_B + "proj.weight", "layers.{i}.indexer.weights"),
)


def hf_config(c: dict[str, Any]) -> dict[str, Any]:
    """The config less transformers' `layer_types` (every layer is DSA), which no generic reader knows."""
    types = c.get("layer_types")
    if types and set(types) != {INDEXED}:
        raise UnsupportedArchitecture(f"config.json layer_types {sorted(set(types))}: twinfer runs {INDEXED!r} layers")
    mlp = c.get("mlp_layer_types")
    dense = int(c.get("first_k_dense_replace") or 0)
    if mlp and list(mlp) != ["dense"] * dense + ["sparse"] * (len(mlp) - dense):
        raise UnsupportedArchitecture(f"config.json mlp_layer_types {mlp}: twinfer runs {dense} dense layers, then experts")
    return {k: v for k, v in c.items() if k != "layer_types"}


def dsa_fields(c: dict[str, Any], fields: Fields, indexers: tuple[bool, ...], interleaved: bool) -> Fields:
    """DeepSeek-V3's MLA and experts (`deepseek_v3.mla_fields`) with the indexer of `c` added."""
    if not c.get("q_lora_rank"):
        raise UnsupportedArchitecture("config.json has no q_lora_rank: sparse attention's indexer reads the q latent")
    fields = mla_fields(c, fields)
    dsa = DSASpec(n_heads=int(c["index_n_heads"]), head_dim=int(c["index_head_dim"]), top_k=int(c["index_topk"]),
                  indexers=indexers)
    if dsa.head_dim < fields["mla"].qk_rope_head_dim:
        raise UnsupportedArchitecture(f"index_head_dim {dsa.head_dim} is below qk_rope_head_dim (the indexer's rope part)")
    return fields | dict(dsa=dsa, extra=(*fields["extra"], (INDEXER_INTERLEAVED, interleaved)))


def hf_spec(c: dict[str, Any], fields: Fields) -> Fields:
    return dsa_fields(c, fields, (), interleaved=False)


def gguf_dsa(k: GGUFKeys, fields: Fields, interleaved: bool) -> Fields:
    """`deepseek_v3.gguf_spec` with the indexer of a deepseek32 / glm-dsa file (`attention.indexer.*`)."""
    fields = deepseek_v3.gguf_spec(k, fields)
    layers = fields["num_layers"] - k.int("nextn_predict_layers", 0)  # the converter appends the MTP blocks
    types = k.meta.get(f"{k.arch}.attention.indexer.types")
    indexers = tuple(bool(t) for t in types[:layers]) if types is not None else ()
    dsa = DSASpec(n_heads=k.int("attention.indexer.head_count"), head_dim=k.int("attention.indexer.key_length"),
                  top_k=k.int("attention.indexer.top_k"), indexers=() if all(indexers) else indexers)
    return fields | dict(num_layers=layers, dsa=dsa, extra=(*fields["extra"], (INDEXER_INTERLEAVED, interleaved)))


def gguf_spec(k: GGUFKeys, fields: Fields) -> Fields:
    return gguf_dsa(k, fields, interleaved=False)


ARCH = Architecture(
    name="deepseek_v32",
    model=Model,
    hf_names=HF_NAMES,
    hf_defaults={
        **deepseek_v3.ARCH.hf_defaults, "max_position_embeddings": 163840,
        "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64,
    },  # transformers' DeepseekV32Config defaults
    hf_config=hf_config,
    hf_spec=hf_spec,
    hf_skip=hf_skip,
    gguf_names=deepseek_v3.GGUF_NAMES.extended("deepseek32 GGUF", GGUF_RULES,
                                                transforms=deepseek_v3.GGUF_NAMES.transforms + INDEXER_TRANSFORMS),
    gguf_spec=gguf_spec,
    gguf_skip=gguf_skip,
)
