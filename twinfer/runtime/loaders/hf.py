"""Hugging Face model folders: config.json -> ModelSpec, safetensors (single or sharded) -> WeightSet.
Reads transformers 4 and 5 configs; the architecture's file supplies its defaults, fields and names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twinfer.runtime.errors import ModelError, UnsupportedArchitecture
from twinfer.runtime.loaders.names import map_weights
from twinfer.runtime.loaders.published import PublishedWeightSet, read_layout
from twinfer.runtime.loaders.published import pack as pack_layout
from twinfer.runtime.loaders.safetensors_file import SafetensorsTensor, read_safetensors
from twinfer.runtime.loaders.weights import WeightSet
from twinfer.runtime.models import architecture, model_for, not_yet, supported_types
from twinfer.runtime.spec import FULL, LINEAR, SLIDING, ModelSpec

if TYPE_CHECKING:  # the architecture files import the loaders' name machinery
    from twinfer.runtime.models.arch import Architecture, Fields

INDEX_FILE = "model.safetensors.index.json"

_BASE_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "sliding_window": None,
}
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def load_hf(folder: Path) -> tuple[ModelSpec, WeightSet, dict[str, Any]]:
    """Read `folder`'s config.json and safetensors; returns (spec, weights, config)."""
    config = read_config(folder)
    spec = spec_from_config(config, name=folder.name)
    stored = stored_tensors(folder)
    arch = _architecture(config)
    expected = model_for(spec).weight_shapes()
    skip = arch.hf_skip(arch.hf_config(config) if arch.hf_config else config) if arch.hf_skip else ()
    layout = read_layout(config, folder, arch.hf_quant_methods)
    if layout is None:
        return spec, map_weights(spec, arch.hf_names, stored, str(folder), expected, skip), config
    packed = pack_layout(layout, stored, str(folder))  # published quantized linears, one tensor each
    return spec, PublishedWeightSet.of(map_weights(spec, arch.hf_names, packed, str(folder), expected, skip)), config


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


def _architecture(config: dict[str, Any]) -> Architecture:
    model_type = config.get("model_type")
    arch = architecture(model_type)
    if arch is None:  # a type recognised but not run yet says what it lacks
        raise UnsupportedArchitecture(not_yet(model_type) or (
            f"unsupported model_type {model_type!r} in config.json; twinfer runs {', '.join(supported_types())}"))
    return arch


def spec_from_config(config: dict[str, Any], name: str = "") -> ModelSpec:
    """The ModelSpec of a transformers config.json dict."""
    arch = _architecture(config)
    read_layout(config, None, arch.hf_quant_methods)  # refuses a quantization it does not load, by field
    text = arch.hf_config(config) if arch.hf_config else config
    c = {**_BASE_DEFAULTS, **arch.hf_defaults, **text}
    fields = common_fields(c)
    if arch.hf_spec is not None:
        fields = arch.hf_spec(c, fields)
    if "sliding_window" not in fields:
        fields["sliding_window"] = int(c["sliding_window"]) if SLIDING in fields["layer_types"] else None
    return ModelSpec(model_type=arch.name, name=name, **fields)


def common_fields(c: dict[str, Any]) -> Fields:
    """The spec fields every decoder's config spells the same way (layer types only when listed)."""
    heads, hidden, n_layers = int(c["num_attention_heads"]), int(c["hidden_size"]), int(c["num_hidden_layers"])
    rope_theta, local_theta, rope_scaling = _rope(c)
    act = ACTIVATIONS.get(str(c["hidden_act"]))
    if act is None:
        raise UnsupportedArchitecture(f"hidden activation {c['hidden_act']!r} is not supported")
    softcap = c.get("final_logit_softcapping")
    return dict(
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
        partial_rotary_factor=_partial_rotary(c),
        layer_types=_listed_layer_types(c, n_layers),
        hidden_act=act,
        tie_word_embeddings=bool(c["tie_word_embeddings"]),
        attention_bias=bool(c["attention_bias"]),
        final_logit_softcap=float(softcap) if softcap else None,
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
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if "type" in scaling:  # the old spelling of rope_type
        scaling.setdefault("rope_type", scaling.pop("type"))
    if scaling.get("rope_type", "default") == "default":
        return theta, local, None
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in scaling.items()))
    return theta, local, frozen


def _partial_rotary(c: dict[str, Any]) -> float:
    """The share of each head that rope turns (transformers 5 keeps it in `rope_parameters`)."""
    params = c.get("rope_parameters")
    if isinstance(params, dict) and FULL in params:
        params = params[FULL]
    value = (params if isinstance(params, dict) else {}).get("partial_rotary_factor")
    return float(value if value is not None else c.get("partial_rotary_factor", 1.0))


def _listed_layer_types(c: dict[str, Any], n_layers: int) -> tuple[str, ...]:
    """The config's `layer_types`, () when it lists none or only full layers (as from a GGUF file)."""
    types = c.get("layer_types")
    if not types:
        return ()
    if len(types) != n_layers or set(types) - {FULL, SLIDING, LINEAR}:
        raise ModelError(f"config layer_types {types} do not fit {n_layers} full/sliding/linear layers")
    return tuple(types) if SLIDING in types or LINEAR in types else ()


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
