"""Where a plan's model comes from: a GGUF or Hugging Face path, a catalog name, or parameter counts.
Files are read for their spec and stored sizes only, so planning a 400 GB GGUF reads its header."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from twinfer.planners import catalog, vision
from twinfer.planners.formats import FORMATS, GGML_TYPES, Mix
from twinfer.planners.model import ModelProfile
from twinfer.planners.vision import VisionProfile
from twinfer.runtime.errors import PlanError

_ATTN_V = {"v", "v_bias"}
_ATTN_OUT = {"o", "o_bias"}
_MLP = {"gate", "up"}


def component(name: str, ndim: int) -> str:
    """The planner component of a canonical weight name (see runtime/loaders/names.py)."""
    if name in ("embed", "lm_head"):
        return name
    if name == "per_layer.embed":  # Gemma 4's per-layer embedding table: gathered like the embedding
        return "embed"
    leaf = name.split(".", 2)[2] if name.startswith("layers.") else name
    if "norm" in leaf or ndim <= 1 and not leaf.endswith("bias"):
        return "norm"
    if leaf.startswith("experts."):
        return "experts_down" if leaf.endswith("down") else "experts"
    if leaf.startswith("shared"):
        return "shared"
    if leaf == "router" or leaf.startswith("router"):
        return "router"
    if leaf in _ATTN_V:
        return "attn_v"
    if leaf in _ATTN_OUT:
        return "attn_out"
    if leaf in _MLP:
        return "mlp"
    if leaf == "down":
        return "mlp_down"
    return "attn"


def _format_name(dtype: str) -> str:
    d = dtype.lower().replace("f8_e4m3", "fp8").replace("float8_e4m3fn", "fp8")
    d = d.replace("fp8-block", "fp8")  # a published block-FP8 linear (runtime/loaders/published.py)
    if d in FORMATS:
        return d
    for name in d.split("+"):
        if name in FORMATS:
            return name
    return "bf16"


def profile_from_loaded(loaded: Any, name: str = "") -> ModelProfile:
    """Count parameters and stored bytes per component from a loader's `LoadedModel`.
    The stored mix carries exact bits per component, so `weight_bytes` equals the file's tensor bytes."""
    w = loaded.weights
    params: dict[str, float] = {}
    stored: dict[str, float] = {}
    shares: dict[str, dict[str, float]] = {}
    for n in w.names():
        shape = tuple(w.shape(n))
        count = 1.0
        for dim in shape:
            count *= dim
        comp = component(n, len(shape))
        params[comp] = params.get(comp, 0.0) + count
        stored[comp] = stored.get(comp, 0.0) + w.nbytes_stored(n)
        fmt = _format_name(str(w.dtype_stored(n)))
        shares.setdefault(comp, {})[fmt] = shares.setdefault(comp, {}).get(fmt, 0.0) + count
    exact = tuple((c, stored[c] * 8 / params[c]) for c in params if params[c])
    parts = tuple((c, tuple((f, v / params[c]) for f, v in split.items())) for c, split in shares.items() if params[c])
    biggest = max(shares.get("attn", {"bf16": 1.0}).items(), key=lambda kv: kv[1])[0]
    label = _file_type(loaded) or biggest.upper()
    mix = Mix("stored", biggest, parts, label=f"{label} (as stored)", exact=exact,
              engines=("llamacpp",) if loaded.format == "gguf" else ())
    spec = loaded.spec
    return ModelProfile(
        name=name or spec.name or Path(str(loaded.path)).name, spec=spec, params=tuple(params.items()),
        native="stored", stored=mix, source=f"{loaded.format} file {loaded.path}", vision=_vision_of(loaded),
    )


def _composed(language: ModelProfile, composition: Any) -> ModelProfile:
    """The language model's profile with the composition's vision encoder (its width checked)."""
    from dataclasses import replace

    from twinfer.runtime.loaders.hf import read_config
    from twinfer.runtime.vision.compose import check_width

    check_width(composition, language.spec)
    encoder = vision.from_checkpoint(composition.vision, read_config(composition.vision))
    if encoder is None:
        raise PlanError(f"{composition.source}: {composition.vision} has no vision tensors")
    return replace(language, vision=encoder, source=f"composition {composition.source}")


def _vision_of(loaded: Any) -> VisionProfile | None:
    """A checkpoint's own vision tensors, or the llama.cpp projector file beside a GGUF model."""
    path = Path(str(loaded.path))
    if loaded.format == "hf":
        return vision.from_checkpoint(path, loaded.metadata)
    if loaded.format == "gguf":
        mmproj = vision.mmproj_beside(path)
        return vision.from_mmproj(mmproj) if mmproj else None
    return None


def _file_type(loaded: Any) -> str:
    ft = (getattr(loaded, "metadata", None) or {}).get("general.file_type")
    if ft is None:
        return ""
    try:
        from gguf.constants import LlamaFileType

        return re.sub(r"^(MOSTLY|ALL)_", "", LlamaFileType(int(ft)).name)
    except (ImportError, ValueError):
        return GGML_TYPES.get(int(ft), "").upper()


def resolve(model: str | None) -> ModelProfile:
    """A path (GGUF file, model folder, a composition file), a catalog name, or None for the embedded default."""
    if model is None or Path(model).expanduser().exists():
        from twinfer.runtime.loaders import load_model  # lazy: reads only the header of a GGUF
        from twinfer.runtime.vision.compose import read_composition

        composition = read_composition(Path(model).expanduser()) if model is not None else None
        if composition is None:
            return profile_from_loaded(load_model(model))
        return _composed(profile_from_loaded(load_model(composition.language)), composition)
    if model.endswith((".gguf", ".safetensors", "/")) or "/" in model and not catalog.CATALOG.get(model):
        try:
            return catalog.find(model.rstrip("/").split("/")[-1]).profile()
        except PlanError:
            raise PlanError(f"model path {model!r} does not exist, and it is not a catalog name either") from None
    return catalog.find(model).profile()
