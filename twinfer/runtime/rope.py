"""Rotary position embedding frequencies, computed once on the host for every backend.
Backends build cos/sin from `inv_freq(spec, layer)`, scale by `attention_factor` (YaRN) and rotate the
first `spec.rotary_dim` dims in the NeoX half-split layout; loaders permute interleaved checkpoints."""

from __future__ import annotations

import math

import numpy as np

from twinfer.runtime.errors import ModelError
from twinfer.runtime.spec import ModelSpec


def inv_freq(spec: ModelSpec, layer: int) -> np.ndarray:
    """float32 [rotary_dim // 2] inverse frequencies of `layer`, with the spec's rope scaling applied."""
    dim = spec.rotary_dim
    base = spec.rope_base(layer)
    scaling = spec.rope_scaling_for(layer)
    if scaling and scaling.get("rope_type") == "proportional":
        return _proportional(spec.head_dim_for(layer), base, scaling)
    # float32 throughout, as Hugging Face computes it, so logits match the reference bit for bit
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    freqs = np.float32(1.0) / (np.float32(base) ** exponent)
    if scaling:
        freqs = _scale(freqs, scaling, spec, base)
    return freqs.astype(np.float32)


def attention_factor(spec: ModelSpec, layer: int) -> float:
    """The factor on `layer`'s cos/sin tables: YaRN's attention temperature, 1.0 for other ropes."""
    cfg = spec.rope_scaling_for(layer)
    if not cfg or cfg.get("rope_type") != "yarn":
        return 1.0
    if cfg.get("attention_factor") is not None:
        return float(cfg["attention_factor"])
    factor, mscale, mscale_all = yarn_factor(spec, cfg), cfg.get("mscale"), cfg.get("mscale_all_dim")
    if mscale and mscale_all:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all))
    return yarn_mscale(factor)


def yarn_factor(spec: ModelSpec, cfg: dict) -> float:
    """YaRN's stretch factor: as given, else the context over the original context."""
    if cfg.get("factor") is not None:
        return float(cfg["factor"])
    return spec.max_position / float(cfg["original_max_position_embeddings"])


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _scale(freqs: np.ndarray, cfg: dict, spec: ModelSpec, base: float) -> np.ndarray:
    kind = cfg.get("rope_type", cfg.get("type", "default"))
    if kind == "default":
        return freqs
    if kind == "linear":
        return freqs / float(cfg["factor"])
    if kind == "llama3":
        return _llama3(freqs, cfg)
    if kind == "yarn":
        return _yarn(freqs, cfg, spec, base)
    raise ModelError(f"rope scaling type {kind!r} is not supported yet (supported: default, linear, llama3, yarn)")


def _yarn(freqs: np.ndarray, cfg: dict, spec: ModelSpec, base: float) -> np.ndarray:
    # YaRN: interpolate (divide by `factor`) the low frequencies, keep the high ones, ramp between
    # the dims that turn beta_fast and beta_slow times over the original context.
    dim = spec.rotary_dim
    factor = yarn_factor(spec, cfg)
    original = float(cfg.get("original_max_position_embeddings") or spec.max_position)
    fast, slow = float(cfg.get("beta_fast") or 32), float(cfg.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if cfg.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolate = np.float32(1) - ramp.astype(np.float32)  # 1 where the frequency is kept
    interpolated = freqs / np.float32(factor)
    return interpolated * (np.float32(1) - extrapolate) + freqs * extrapolate


def _proportional(head_dim: int, base: float, cfg: dict) -> np.ndarray:
    """Gemma 4's "proportional" rope: the whole head turns, but only the first
    `partial_rotary_factor * head_dim / 2` frequencies (exponents over the whole head_dim) are
    non-zero; the rest are 0, so their dims pass through unrotated."""
    angles = int(float(cfg.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    exponent = np.arange(0, 2 * angles, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    freqs = np.zeros(head_dim // 2, dtype=np.float32)
    freqs[:angles] = np.float32(1.0) / (np.float32(base) ** exponent)
    return (freqs / np.float32(cfg.get("factor", 1.0))).astype(np.float32)


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
