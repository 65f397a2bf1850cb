"""Which model file a user means: the path they gave, or the embedded default."""

from __future__ import annotations

from pathlib import Path

from twinfer.runtime.errors import ModelError
from twinfer.runtime.loaders import default_model_path


def resolve_path(model: str | None) -> Path:
    """The model path a user means: theirs, or the embedded default."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelError(f"model path {model!r} does not exist: give a GGUF file or a Hugging Face model folder")
    return path
