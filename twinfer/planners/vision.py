"""A model's vision encoder as the planner sees it: weights and tokens per image (docs/images.md, "Planning")."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from twinfer.runtime.errors import PlanError

VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "mm_projector.", "visual.", "vision_model.",
                   "model.vision_tower.", "model.multi_modal_projector.", "model.mm_projector.", "model.visual.")
REFERENCE_IMAGE_SIDE = 896  # the image a dynamic-resolution tower is priced for: Gemma 3's fixed size
POOL_DEFAULT = 4  # llama.cpp's scale factor when a Gemma 3 projector file omits it


@dataclass(frozen=True)
class VisionProfile:
    """Encoder + projector `params` (`stored_bytes` in a file, 0 if counted) and `images` per request."""

    params: float
    tokens_per_image: int
    stored_bytes: float = 0.0
    images: int = 1
    source: str = ""

    @property
    def image_tokens(self) -> int:
        return self.images * self.tokens_per_image

    def weight_bytes(self, default_format: str, engine: str) -> float:
        """Never quantized: f32 where the runner widens, llama.cpp's projector file as stored, else 16-bit."""
        if default_format == "f32":
            return self.params * 4.0
        if engine == "llamacpp" and self.stored_bytes:
            return self.stored_bytes
        return self.params * 2.0

    def with_images(self, images: int) -> VisionProfile:
        if images < 0:
            raise PlanError(f"--images must be 0 or more, got {images}")
        return replace(self, images=images)


def merged_tokens(side: int, patch: int, merge: int) -> int:
    """Tokens of a `side` x `side` image cut in `patch`-pixel patches merged `merge` x `merge`."""
    per_side = math.ceil(side / (patch * merge))
    return per_side * per_side


def tokens_from_config(config: dict[str, Any]) -> int:
    """`mm_tokens_per_image`, else the merged patches of a REFERENCE_IMAGE_SIDE image."""
    if config.get("mm_tokens_per_image"):
        return int(config["mm_tokens_per_image"])
    v = config.get("vision_config") or {}
    patch = int(v.get("patch_size") or 14)
    merge = v.get("spatial_merge_size") or (v.get("merge_kernel_size") or [1])[0]
    return merged_tokens(REFERENCE_IMAGE_SIDE, patch, int(merge))


def from_checkpoint(folder: Path, config: dict[str, Any]) -> VisionProfile | None:
    """The vision tensors of a Hugging Face folder (None when it has none), counted from the file table."""
    from twinfer.runtime.loaders.hf import stored_tensors

    params = stored = 0.0
    for name, t in stored_tensors(folder).items():
        if name.startswith(VISION_PREFIXES):
            params += math.prod(t.shape)
            stored += t.nbytes
    if not params:
        return None
    return VisionProfile(params, tokens_from_config(config), stored, source=f"vision tensors of {folder.name}")


def mmproj_beside(model: Path) -> Path | None:
    """The first `*mmproj*.gguf` next to a GGUF model, by name."""
    found = sorted(p for p in model.parent.glob("*.gguf") if "mmproj" in p.name.lower() and p != model)
    return found[0] if found else None


def from_mmproj(path: Path) -> VisionProfile:
    """A llama.cpp projector file: its tensors' bytes, and the tokens per image its clip keys imply."""
    from gguf import VisionProjectorType

    from twinfer.runtime.loaders.gguf_file import read_gguf

    contents = read_gguf(path)
    meta = contents.metadata
    params = float(sum(math.prod(t.ne) for t in contents.tensors.values()))
    stored = float(sum(t.nbytes for t in contents.tensors.values()))
    side = int(meta.get("clip.vision.image_size", REFERENCE_IMAGE_SIDE))
    patch = int(meta.get("clip.vision.patch_size", 14))
    default = POOL_DEFAULT if meta.get("clip.projector_type") == VisionProjectorType.GEMMA3 else 1
    scale = int(meta.get("clip.vision.projector.scale_factor", default))
    merge = int(meta.get("clip.vision.spatial_merge_size", 1))
    return VisionProfile(params, merged_tokens(side, patch, scale * merge), stored, source=f"projector {path.name}")
