"""Hugging Face model folders: config.json -> ModelSpec, safetensors (single or sharded) -> WeightSet.

Reads configs written by transformers 4 (`rope_theta`, `rope_scaling`) and 5 (`rope_parameters`,
per layer type for Gemma 3). Keys a config leaves out take the transformers class defaults below,
which matters for Gemma 3 multimodal configs whose `text_config` lists only what differs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from twinfer.runtime.errors import ModelError, UnsupportedArchitecture
from twinfer.runtime.loaders.names import HF_TABLES, map_weights
from twinfer.runtime.loaders.safetensors_file import SafetensorsTensor, read_safetensors
from twinfer.runtime.loaders.weights import WeightSet
from twinfer.runtime.models import MODEL_TYPES, supported_types
from twinfer.runtime.spec import FULL, SLIDING, ModelSpec, MoESpec

INDEX_FILE = "model.safetensors.index.json"

_BASE_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "sliding_window": None,
}
# transformers' config-class defaults for the keys read here (transformers 5.24).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3": {
        "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "max_position_embeddings": 131072, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
        "tie_word_embeddings": True, "hidden_act": "gelu_pytorch_tanh",
    },
    "llama": {"vocab_size": 32000, "max_position_embeddings": 2048},
    "mistral": {"vocab_size": 32000, "max_position_embeddings": 131072, "sliding_window": 4096},
    "qwen2": {"vocab_size": 151936, "max_position_embeddings": 32768, "attention_bias": True},
    "qwen3": {"vocab_size": 151936, "max_position_embeddings": 32768},
    "qwen3_moe": {"vocab_size": 151936, "max_position_embeddings": 32768, "norm_topk_prob": False},
    "mixtral": {"vocab_size": 32000, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                "rope_theta": 1_000_000.0},
}  # fmt: skip
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def load_hf(folder: Path) -> tuple[ModelSpec, WeightSet, dict[str, Any]]:
    """Read `folder`'s config.json and safetensors; returns (spec, weights, config)."""
    config = read_config(folder)
    spec = spec_from_config(config, name=folder.name)
    stored = stored_tensors(folder)
    table = HF_TABLES[_family(config)]
    return spec, map_weights(spec, table, stored, str(folder)), config


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelError(
            f"{folder} has no config.json; a model folder needs config.json and *.safetensors "
            "(as written by transformers' save_pretrained), or pass a .gguf file"
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read {path}: {e}; fix or re-download the file") from e
    if not isinstance(config, dict):
        raise ModelError(f"{path} does not hold a JSON object; fix or re-download the file")
    return config


def _family(config: dict[str, Any]) -> str:
    """The key of HF_TABLES / _DEFAULTS: the model_type with Gemma 3's text and multimodal merged."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UnsupportedArchitecture(
            f"unsupported model_type {model_type!r} in config.json; twinfer runs {', '.join(supported_types())}"
        )
    return "gemma3" if model_type in ("gemma3", "gemma3_text") else str(model_type)


def spec_from_config(config: dict[str, Any], name: str = "") -> ModelSpec:
    """The ModelSpec of a transformers config.json dict."""
    family = _family(config)
    text = config.get("text_config") if config.get("model_type") == "gemma3" else None
    c = {**_BASE_DEFAULTS, **_DEFAULTS[family], **(text or config)}
    if "hidden_activation" in c:  # Gemma's name for hidden_act
        c["hidden_act"] = c["hidden_activation"]
    heads, hidden, n_layers = (
        int(c["num_attention_heads"]),
        int(c["hidden_size"]),
        int(c["num_hidden_layers"]),
    )
    rope_theta, local_theta, rope_scaling = _rope(c)
    layer_types = _layer_types(c, family, n_layers)
    act = _ACTIVATIONS.get(str(c["hidden_act"]))
    if act is None:
        raise UnsupportedArchitecture(f"hidden activation {c['hidden_act']!r} is not supported")
    softcap = c.get("final_logit_softcapping")
    return ModelSpec(
        model_type="gemma3" if family == "gemma3" else family,
        name=name,
        vocab_size=int(c["vocab_size"]),
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or hidden // heads),
        intermediate_size=int(c["intermediate_size"]),
        max_position=int(c["max_position_embeddings"]),
        rms_norm_eps=float(c["rms_norm_eps"]),
        rope_theta=rope_theta,
        rope_local_theta=local_theta,
        rope_scaling=rope_scaling,
        sliding_window=int(c["sliding_window"]) if SLIDING in layer_types else None,
        layer_types=layer_types,
        hidden_act=act,
        tie_word_embeddings=bool(c["tie_word_embeddings"]),
        attention_bias=bool(c["attention_bias"]),
        qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
        embed_scale=family == "gemma3",
        query_pre_attn_scalar=float(c["query_pre_attn_scalar"]) if family == "gemma3" else None,
        final_logit_softcap=float(softcap) if softcap else None,
        moe=_moe(c, family, n_layers),
    )


def _rope(c: dict[str, Any]) -> tuple[float, float | None, tuple[tuple[str, Any], ...] | None]:
    """(global base, local base or None, frozen scaling items or None) from either config style."""
    params = c.get("rope_parameters")
    local: float | None = None
    if isinstance(params, dict) and FULL in params:  # transformers 5, per layer type (Gemma 3)
        sliding = params.get(SLIDING) or {}
        local = float(sliding["rope_theta"]) if "rope_theta" in sliding else None
        params = params[FULL]
    elif not isinstance(params, dict):  # transformers 4
        params = dict(c.get("rope_scaling") or {}, rope_theta=c["rope_theta"])
        if "rope_local_base_freq" in c:
            local = float(c["rope_local_base_freq"])
    theta = float(params.get("rope_theta", c["rope_theta"]))
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if "type" in scaling:  # the old spelling of rope_type
        scaling.setdefault("rope_type", scaling.pop("type"))
    if scaling.get("rope_type", "default") == "default":
        return theta, local, None
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in scaling.items()))
    return theta, local, frozen


def _layer_types(c: dict[str, Any], family: str, n_layers: int) -> tuple[str, ...]:
    types = c.get("layer_types")
    if types:
        if len(types) != n_layers or set(types) - {FULL, SLIDING}:
            raise ModelError(f"config layer_types {types} do not fit {n_layers} full/sliding layers")
        return tuple(types) if SLIDING in types else ()  # () means all full, as from a GGUF file
    window = c.get("sliding_window")
    if family == "gemma3":
        pattern = int(c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or 6)
        return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n_layers))
    if family in ("mistral", "mixtral") and window:  # every layer slides (Mistral 7B v0.1)
        return (SLIDING,) * n_layers
    if c.get("use_sliding_window") and window:  # Qwen: layers from max_window_layers on slide
        first = int(c.get("max_window_layers", 0))
        return tuple(SLIDING if i >= first else FULL for i in range(n_layers))
    return ()


def _moe(c: dict[str, Any], family: str, n_layers: int) -> MoESpec | None:
    if family == "mixtral":
        experts = c.get("num_local_experts", c.get("num_experts", 8))
        return MoESpec(int(experts), int(c.get("num_experts_per_tok", 2)), int(c["intermediate_size"]), True)
    if family != "qwen3_moe":
        return None
    if c.get("mlp_only_layers") or int(c.get("decoder_sparse_step", 1)) != 1:
        raise UnsupportedArchitecture(
            "qwen3_moe configs with dense layers (mlp_only_layers / decoder_sparse_step) are not supported"
        )
    experts = c.get("num_experts", c.get("num_local_experts", 128))
    return MoESpec(
        num_experts=int(experts),
        top_k=int(c.get("num_experts_per_tok", 8)),
        expert_intermediate_size=int(c.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(c["norm_topk_prob"]),
    )


def stored_tensors(folder: Path) -> dict[str, SafetensorsTensor]:
    """Every tensor of the folder's safetensors, following the shard index when there is one."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelError(f"cannot read shard index {index}: {e}; fix or re-download it") from e
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise ModelError(
                f"{folder}: shard {missing[0]!r} listed in {INDEX_FILE} is missing; re-download it"
            )
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:  # skip Mistral's original-format consolidated.safetensors next to HF weights
        files = sorted(p.name for p in folder.glob("*.safetensors") if not p.name.startswith("consolidated"))
    if not files:
        raise ModelError(
            f"{folder} has no *.safetensors weights; save the model with save_pretrained "
            "(safe_serialization) or convert its .bin/.pt files to safetensors"
        )
    out: dict[str, SafetensorsTensor] = {}
    for name in files:
        for tensor_name, tensor in read_safetensors(folder / name).items():
            if tensor_name in out:
                raise ModelError(f"{folder}: tensor {tensor_name!r} is stored in two files; remove one")
            out[tensor_name] = tensor
    return out
