"""GLM-5 (`glm_moe_dsa`): DeepSeek-V3.2's sparse attention with an interleaved indexer rope and
"shared" layers that reuse the last full layer's choice (docs/models.md, "GLM-5")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from twinfer.runtime.errors import UnsupportedArchitecture
from twinfer.runtime.models import deepseek_v3, deepseek_v32
from twinfer.runtime.models.arch import Architecture, Fields
from twinfer.runtime.models.glm4_moe import gguf_skip, hf_skip

if TYPE_CHECKING:
    from twinfer.runtime.loaders.gguf_file import GGUFKeys


class Model(deepseek_v32.Model):
    pass


def indexer_types(c: dict[str, Any]) -> tuple[bool, ...]:
    """Which layers run their own indexer (True: "full"), read the way transformers' GlmMoeDsaConfig does."""
    n = int(c["num_hidden_layers"])
    types = c.get("indexer_types")
    if types is None and (pattern := c.get("index_topk_pattern")) is not None:
        types = [{"F": "full", "S": "shared"}.get(t, t) for t in pattern]
    if types is None:
        freq, offset = max(int(c.get("index_topk_freq", 1)), 1), int(c.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if len(types) != n or set(types) - {"full", "shared"}:
        raise UnsupportedArchitecture(f"config.json indexer_types {types}: want 'full' or 'shared' for each of {n} layers")
    return tuple(t == "full" for t in types)


def hf_spec(c: dict[str, Any], fields: Fields) -> Fields:
    full = indexer_types(c)
    return deepseek_v32.dsa_fields(c, fields, () if all(full) else full, interleaved=True)


def gguf_spec(k: GGUFKeys, fields: Fields) -> Fields:
    if f"{k.arch}.attention.indexer.types" not in k.meta and k.int("context_length") >= 1 << 20:
        # llama.cpp gives such files GLM-5.2's pattern of shared layers, which the file does not state
        raise UnsupportedArchitecture(f"{k.path}: no {k.arch}.attention.indexer.types; re-convert with a "
                                      "llama.cpp that writes which layers share their indexer")
    return deepseek_v32.gguf_dsa(k, fields, interleaved=True)


ARCH = Architecture(
    name="glm_moe_dsa",
    model=Model,
    hf_names=deepseek_v32.HF_NAMES.extended("glm_moe_dsa"),
    hf_defaults={
        **deepseek_v3.ARCH.hf_defaults, "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288,
        "num_hidden_layers": 78, "num_attention_heads": 64, "q_lora_rank": 2048, "v_head_dim": 256,
        "qk_nope_head_dim": 192, "n_group": 1, "topk_group": 1, "max_position_embeddings": 202752,
        "rms_norm_eps": 1e-5, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
    },  # transformers' GlmMoeDsaConfig defaults
    hf_config=deepseek_v32.hf_config,
    hf_spec=hf_spec,
    hf_skip=hf_skip,
    gguf_names=deepseek_v32.ARCH.gguf_names.extended("glm-dsa GGUF") if deepseek_v32.ARCH.gguf_names else None,
    gguf_spec=gguf_spec,
    gguf_skip=gguf_skip,
)
