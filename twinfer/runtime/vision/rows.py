"""Where a step's image features go (host side, for both backends' `begin_step`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from twinfer.runtime.batch import StepBatch


def feature_rows(batch: StepBatch) -> list[tuple[int, Any]]:
    """(first row in the step's flat token list, features) of every image the batch's chunks carry."""
    out: list[tuple[int, Any]] = []
    offset = 0
    for c in batch.chunks:
        for im in c.images:
            if im.offset < 0 or im.offset + im.rows > len(c.tokens):
                raise ValueError(f"sequence {c.seq_id}: image rows [{im.offset}, {im.offset + im.rows}) fall "
                                 f"outside its chunk of {len(c.tokens)} tokens")
            out.append((offset + im.offset, im.features))
        offset += len(c.tokens)
    return out


def bidirectional_spans(batch: StepBatch, width: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Per query [B, width] (`begin_step`'s padded layout), the key positions [lo, hi) of the bidirectional
    image it lies in (lo == hi elsewhere); None when no chunk has one: the plain causal mask."""
    if not any(im.bidirectional for c in batch.chunks for im in c.images):
        return None
    lo = np.zeros((len(batch.chunks), width), dtype=np.int64)
    hi = np.zeros_like(lo)
    for b, c in enumerate(batch.chunks):
        for im in c.images:
            if im.bidirectional:
                first = c.start + im.offset
                lo[b, im.offset : im.offset + im.rows] = first
                hi[b, im.offset : im.offset + im.rows] = first + im.rows
    return lo, hi
