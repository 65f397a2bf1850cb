"""Model loaders: a GGUF file or a Hugging Face folder -> ModelSpec + lazily read canonical weights.
`load_model(path)` (None: the embedded default model); names map by the tables in `names.py`, and a
tensor that maps to nothing, or a missing one, is a `WeightError`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from twinfer.runtime.errors import ModelError
from twinfer.runtime.loaders.default import DEFAULT_MODEL_PACKAGE, default_model_path
from twinfer.runtime.loaders.gguf_file import load_gguf, read_gguf
from twinfer.runtime.loaders.hf import load_hf, spec_from_config
from twinfer.runtime.loaders.weights import StoredTensor, WeightSet
from twinfer.runtime.spec import ModelSpec

__all__ = [
    "DEFAULT_MODEL_PACKAGE",
    "LoadedModel",
    "StoredTensor",
    "WeightSet",
    "default_model_path",
    "load_model",
    "read_gguf_array",
    "spec_from_config",
]

GGUF_MAGIC = b"GGUF"


@dataclass
class LoadedModel:
    """A model ready to build a runner from: its spec, its weights (unread) and the file's metadata (GGUF
    key/values without the large arrays, or config.json)."""

    path: Path
    format: str  # "gguf", "hf" or "quantized" (a `twinfer quantize` folder)
    spec: ModelSpec
    weights: WeightSet
    metadata: dict[str, Any] = field(default_factory=dict)


def load_model(path: str | Path | None = None) -> LoadedModel:
    """Open a GGUF file or a Hugging Face folder (None: the embedded default model); ModelError (or a
    subclass) with a one-line message when it cannot."""
    resolved = default_model_path() if path is None else Path(path).expanduser()
    if not resolved.exists():
        raise ModelError(f"model path {str(resolved)!r} does not exist; pass a .gguf file or a model folder")
    if resolved.is_dir():
        from twinfer.runtime.loaders.quantized import is_quantized_folder, load_quantized

        if is_quantized_folder(resolved):  # written by `twinfer quantize`
            spec, qweights, config = load_quantized(resolved)
            return LoadedModel(resolved, "quantized", spec, qweights, config)
        spec, weights, metadata = load_hf(resolved)
        return LoadedModel(resolved, "hf", spec, weights, metadata)
    if _is_gguf(resolved):
        spec, weights, metadata = load_gguf(resolved)
        return LoadedModel(resolved, "gguf", spec, weights, metadata)
    if resolved.suffix == ".safetensors" or resolved.name == "config.json":
        raise ModelError(f"{resolved} is one file of a Hugging Face model; pass its folder {resolved.parent}")
    raise ModelError(
        f"{resolved} is neither a GGUF file nor a model folder; pass a .gguf file or a folder with "
        "config.json and *.safetensors"
    )


def read_gguf_array(path: str | Path, key: str) -> list[Any] | Any:
    """A GGUF metadata array by key, including those `LoadedModel.metadata` leaves out
    (`tokenizer.ggml.tokens`, `.scores`, `.token_type`, `.merges`): strings as a list, numbers as numpy."""
    return read_gguf(Path(path)).array(key)


def _is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelError(f"cannot read {path}: {e}") from e
    if magic == GGUF_MAGIC:
        return True
    if path.suffix.lower() == ".gguf":
        raise ModelError(
            f"{path} is not a valid GGUF file (starts with {magic!r}, expected b'GGUF'); re-download it"
        )
    return False
