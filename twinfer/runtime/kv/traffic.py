"""Bytes a runner's step moves: resident weights touched, routed experts, KV read and written; the
engine shares a step's `StepBytes` over its requests (engine/bill.py). Pure arithmetic."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from twinfer.runtime.batch import StepBatch


@dataclass(frozen=True)
class StepBytes:
    """Bytes one step moved: weights and experts for the whole step, KV per chunk (chunk order)."""

    weights_read: float
    experts_read: float
    kv_read: tuple[float, ...]
    kv_written: tuple[float, ...]


@dataclass(frozen=True)
class StepTraffic:
    """How a runner's steps move bytes: `weight_bytes` every step touches (not an untied embedding),
    `expert_bytes` per routed expert and layer, `kv_layer_bytes` per position and layer, and each layer's
    sliding `windows` (None: full)."""

    weight_bytes: float
    kv_layer_bytes: tuple[float, ...]
    windows: tuple[int | None, ...]
    expert_bytes: float = 0.0
    num_experts: int = 0
    top_k: int = 0
    moe_layers: int = 0

    @property
    def kv_bytes_per_token(self) -> float:
        return float(sum(self.kv_layer_bytes))

    @cached_property
    def _kv_groups(self) -> tuple[tuple[int | None, float], ...]:
        """The layers' KV bytes per position summed per sliding window (None: full attention), so a
        step's arithmetic runs once per window size rather than once per layer."""
        groups: dict[int | None, float] = {}
        for per_pos, window in zip(self.kv_layer_bytes, self.windows, strict=True):
            groups[window] = groups.get(window, 0.0) + per_pos
        return tuple(groups.items())

    def kv_read(self, end: int, new: int) -> float:
        """KV bytes a chunk of `new` tokens ending at position `end` reads (each layer's context once)."""
        total = 0.0
        for window, per_pos in self._kv_groups:
            total += per_pos * (end if window is None else min(end, window + new - 1))
        return total

    def step(self, batch: StepBatch) -> StepBytes:
        tokens = batch.num_tokens
        experts = 0.0
        if self.num_experts:
            experts = self.expert_bytes * self.moe_layers * min(self.num_experts, tokens * self.top_k)
        return StepBytes(self.weight_bytes, experts,
                         tuple(self.kv_read(c.end, len(c.tokens)) for c in batch.chunks),
                         tuple(self.kv_bytes_per_token * len(c.tokens) for c in batch.chunks))


def kv_layer_bytes(spec: Any, bytes_per_element: float) -> tuple[float, ...]:
    """KV bytes per position of each layer of a `ModelSpec` (MLA: one latent; else K and V)."""
    if spec.mla is not None:
        per_layer = float(spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim)
    else:
        per_layer = 2.0 * spec.kv_size
    return tuple(per_layer * bytes_per_element for _ in range(spec.num_layers))


def held_bytes(value: Any, array: type) -> int:
    """Bytes of a held weight: an `array` (a torch tensor, an mx array), or a packed format's arrays
    (in a list, a dict or an object's attributes)."""
    if isinstance(value, array):
        return int(value.nbytes)  # type: ignore[attr-defined]
    if isinstance(value, (list, tuple)):
        return sum(held_bytes(v, array) for v in value)
    if isinstance(value, dict):
        return sum(held_bytes(v, array) for v in value.values())
    if hasattr(value, "__dict__"):
        return sum(held_bytes(v, array) for v in vars(value).values())
    return 0


def resident_traffic(spec: Any, weight_sizes: Mapping[str, float], kv_layer: tuple[float, ...]) -> StepTraffic:
    """A `StepTraffic` from the bytes of each resident weight (canonical names) and each layer's KV bytes per
    position: routed experts ("expert" in the name, not "shared") counted apart, by the share a step
    touches; an untied embedding table left out (a step reads only its rows)."""
    dense = experts = 0.0
    expert_layers: set[str] = set()
    for name, size in weight_sizes.items():
        if name == "embed" and not spec.tie_word_embeddings:
            continue
        if "expert" in name and "shared" not in name and spec.moe is not None:
            experts += size
            expert_layers.add(name.split(".")[1] if name.startswith("layers.") else name)
        else:
            dense += size
    moe, n_moe = spec.moe, len(expert_layers)
    if moe is None or not n_moe:
        return StepTraffic(dense, kv_layer, tuple(spec.window(i) for i in range(spec.num_layers)))
    return StepTraffic(dense, kv_layer, tuple(spec.window(i) for i in range(spec.num_layers)),
                       experts / (moe.num_experts * n_moe), moe.num_experts, moe.top_k, n_moe)
