"""Rotary position embedding frequencies, computed once on the host for every backend.

Backends build cos/sin tables from `inv_freq(spec, layer)` and rotate in the NeoX half-split
layout: x = [x1, x2] -> [x1*cos - x2*sin, x2*cos + x1*sin].
"""

from __future__ import annotations

import math

import numpy as np

from twinfer.runtime.errors import ModelError
from twinfer.runtime.spec import ModelSpec


def inv_freq(spec: ModelSpec, layer: int) -> np.ndarray:
    """float32 [head_dim // 2] inverse frequencies of `layer`, with the spec's rope scaling applied."""
    dim = spec.head_dim
    base = spec.rope_base(layer)
    # float32 throughout, as Hugging Face computes it, so logits match the reference bit for bit
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    freqs = np.float32(1.0) / (np.float32(base) ** exponent)
    scaling = spec.rope_scaling_for(layer)
    if scaling:
        freqs = _scale(freqs, scaling)
    return freqs.astype(np.float32)


def _scale(freqs: np.ndarray, cfg: dict) -> np.ndarray:
    kind = cfg.get("rope_type", cfg.get("type", "default"))
    if kind == "default":
        return freqs
    if kind == "linear":
        return freqs / float(cfg["factor"])
    if kind == "llama3":
        return _llama3(freqs, cfg)
    raise ModelError(f"rope scaling type {kind!r} is not supported yet (supported: default, linear, llama3)")


def _llama3(freqs: np.ndarray, cfg: dict) -> np.ndarray:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    factor = float(cfg["factor"])
    low, high = float(cfg["low_freq_factor"]), float(cfg["high_freq_factor"])
    old_ctx = float(cfg["original_max_position_embeddings"])
    wavelen = 2 * math.pi / freqs
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * freqs / factor + smooth * freqs
    out = np.where(wavelen > old_ctx / low, freqs / factor, freqs)
    middle = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return np.where(middle, blended, out)
