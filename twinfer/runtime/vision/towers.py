"""Which vision tower a checkpoint carries: its architecture's `vision` opener (runtime/models), called
by the torch and MLX runner builders with the runner's Ops, so features come out as that backend's arrays."""

from __future__ import annotations

from typing import TYPE_CHECKING

from twinfer.runtime.models import architecture
from twinfer.runtime.ops import Ops
from twinfer.runtime.vision import VisionTower

if TYPE_CHECKING:
    from twinfer.runtime.loaders import LoadedModel


def open_vision(loaded: LoadedModel, ops: Ops) -> VisionTower | None:
    """The vision tower of a Hugging Face checkpoint over `ops`; None for a text-only model (or a GGUF
    file, whose projector is a separate file)."""
    if loaded.format != "hf":
        return None
    arch = architecture(loaded.metadata.get("model_type"))  # the checkpoint's: a wrapper's, not its text model's
    opener = arch.vision if arch is not None else None
    return opener(loaded.path, loaded.metadata, loaded.spec, ops) if opener is not None else None
