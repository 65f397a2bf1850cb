"""Images in: what a request carries (`Image`, `ImageSpan`), what a step hands the model (`ChunkImage`)
and what a vision tower provides (`VisionTower`); docs/images.md."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True, eq=False)
class Image:
    """One decoded image: `pixels` uint8 [H, W, 3] RGB; `digest` identifies the pixels (every cache keys
    on it: the same placeholder ids with other pixels never share KV or features)."""

    pixels: np.ndarray
    digest: str = field(default="")

    def __post_init__(self) -> None:
        if self.pixels.dtype != np.uint8 or self.pixels.ndim != 3 or self.pixels.shape[2] != 3:
            raise ValueError(f"an image is uint8 [H, W, 3] RGB, not {self.pixels.dtype} {self.pixels.shape}")
        if not self.digest:
            h = hashlib.sha256(np.asarray(self.pixels.shape, dtype=np.int64).tobytes())
            h.update(np.ascontiguousarray(self.pixels).tobytes())
            object.__setattr__(self, "digest", h.hexdigest())

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels."""
        return int(self.pixels.shape[1]), int(self.pixels.shape[0])


@dataclass(frozen=True)
class ImageSpan:
    """One image's placeholder run in a prompt: positions [`start`, `start + length`)."""

    start: int
    length: int
    image: Image

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass
class ChunkImage:
    """The rows of one image's features that a step chunk covers: `features` ([n, C], a backend array,
    already sliced) replace the embeddings of chunk positions [`offset`, `offset + n`). `bidirectional`:
    these positions also attend to each other both ways (Gemma 3), which needs the whole image in the
    chunk."""

    offset: int
    features: Any
    bidirectional: bool = False

    @property
    def rows(self) -> int:
        return int(self.features.shape[0])


class VisionTower(Protocol):
    """What a runner that reads images provides (`Runner.vision`)."""

    bidirectional: bool  # image positions attend to each other both ways; the scheduler never splits one

    def expand(self, tokens: list[int], images: list[Image]) -> tuple[list[int], list[ImageSpan]]:
        """Replace each image marker token in `tokens` (in order, one per image) with the family's full
        placeholder run; returns the new ids and where each image's features go."""
        ...

    def encode(self, image: Image) -> Any:
        """The image's features: a backend array [span length, hidden size] in the language model's width."""
        ...

    def weight_bytes(self) -> int:
        """Bytes of the encoder and projector weights as loaded."""
        ...
