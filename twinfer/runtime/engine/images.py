"""Images inside the engine (docs/images.md, "Caching"): prefix-cache key ids per image digest, chunks
that never split an image whose positions attend both ways, and features encoded once per digest."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from twinfer.runtime.vision import ChunkImage, ImageSpan, VisionTower

KEY_BITS = 60  # digest bits in an image's key id: vocab + 2**60 stays inside the int64 a block key hashes


def image_key(span: ImageSpan, vocab_size: int) -> int:
    """The id every position of `span` takes in prefix-cache keys: >= vocab_size, one per image digest."""
    return vocab_size + int(span.image.digest[: KEY_BITS // 4], 16)


def key_tokens(prompt: Sequence[int], spans: Sequence[ImageSpan], vocab_size: int) -> list[int]:
    """`prompt` with each image's positions replaced by its key id (what prefix-cache keys hash)."""
    out = list(prompt)
    for span in spans:
        out[span.start : span.end] = [image_key(span, vocab_size)] * span.length
    return out


def whole_image_chunk(spans: Sequence[ImageSpan], start: int, n: int, budget: int) -> int:
    """Of `n` tokens from `start`, how many to compute without splitting an image: stop before one, or take
    it whole when it starts there (0: it does not fit `budget`, wait for a step with room)."""
    end = start + n
    for span in spans:
        if span.start < end < span.end:
            if span.start > start:
                return span.start - start
            return span.end - start if span.end - start <= budget else 0
    return n


def whole_image_prefix(spans: Sequence[ImageSpan], blocks: int, block_size: int) -> int:
    """How many of `blocks` cached blocks to start from: a prefix ending inside an image backs off to the
    block where that image starts."""
    cached = blocks * block_size
    for span in reversed(spans):  # backing off can land inside an earlier image: check those next
        if span.start < cached < span.end:
            cached = span.start // block_size * block_size
    return cached // block_size


class FeatureCache:
    """Image features by digest, the last `capacity` images used kept; the engine thread's only."""

    def __init__(self, tower: VisionTower, capacity: int = 16):
        if capacity < 1:
            raise ValueError(f"the image feature cache needs room for at least one image, got {capacity}")
        self.tower = tower
        self.capacity = capacity
        self._features: OrderedDict[str, Any] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def features(self, span: ImageSpan) -> tuple[Any, float]:
        """The image's features [span.length, C], and the encoder seconds this call spent (0 on a hit)."""
        digest = span.image.digest
        cached = self._features.get(digest)
        if cached is not None:
            self._features.move_to_end(digest)
            self.hits += 1
            return cached, 0.0
        started = time.perf_counter()
        features = self.tower.encode(span.image)
        seconds = time.perf_counter() - started
        rows = int(features.shape[0])
        if rows != span.length:
            raise ValueError(f"the vision tower gave {rows} feature rows for an image of {span.length} positions")
        self.misses += 1
        self._features[digest] = features
        while len(self._features) > self.capacity:
            self._features.popitem(last=False)
        return features, seconds

    def chunk_images(self, spans: Sequence[ImageSpan], start: int, n: int) -> tuple[list[ChunkImage], float]:
        """The feature rows chunk [start, start + n) covers (offsets from `start`), and the encoder seconds."""
        out: list[ChunkImage] = []
        seconds = 0.0
        end = start + n
        for span in spans:
            lo, hi = max(span.start, start), min(span.end, end)
            if lo >= hi:
                continue
            features, spent = self.features(span)
            seconds += spent
            rows = features if hi - lo == span.length else features[lo - span.start : hi - span.start]
            out.append(ChunkImage(lo - start, rows, self.tower.bidirectional))
        return out, seconds
