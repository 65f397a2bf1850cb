"""Sharding as a transform of a built model's weights: which part of each weight one rank reads.
Megatron-style rules per architecture (docs/parallelism.md); `shard_request` is the one place they live.
A rank reads exactly its box from the file (`WeightSet.load_region`) and never opens other stages' weights."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from twinfer.backends.cuda.parallel.layout import RankPosition
from twinfer.runtime.errors import WeightError
from twinfer.runtime.loaders.weights import Region
from twinfer.runtime.spec import ModelSpec

REPLICATED, COLUMN, ROW, VOCAB, EXPERTS, NORM = "replicated", "column", "row", "vocab", "experts", "norm"
_REPLICATED = {"attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm", "router",
               "router_bias", "router_score_bias", "o_bias",
               # MLA's low-rank down-projections and their norms: every rank needs the whole latent
               "q_a", "q_a_bias", "q_a_norm", "kv_a", "kv_a_bias", "kv_a_norm",
               # sparse attention's indexer: every rank picks the tokens for all its heads
               "indexer.q", "indexer.k", "indexer.k_norm", "indexer.k_norm_bias", "indexer.weights",
               # Gemma 4: per-head value norm, the MoE block's norms, router scale and per-expert scale, scalars
               "v_norm", "router_norm", "expert_scale", "post_mlp_norm_1", "mlp_norm_2", "post_mlp_norm_2",
               "layer_scalar", "per_layer_gate", "per_layer_out", "per_layer_norm",
               # Qwen3-Next / Qwen3.5: the shared expert's gate (one value per token), the delta net's head norm
               "shared_gate", "lin.norm"}
_EVERY_STAGE = ("per_layer.",)  # Gemma 4's per-layer embeddings: each block reads its own slice


@dataclass(frozen=True)
class Part:
    """What one rank holds of a weight: the box it reads and how the forward pass combines it."""

    kind: str  # REPLICATED, COLUMN, ROW, VOCAB or EXPERTS
    region: Region = ()  # one slice per leading axis; () is the whole tensor
    offset: int = 0  # VOCAB: first token id; EXPERTS: first expert id; NORM: values the summed squares cover
    pieces: tuple[tuple[int, int], ...] = ()  # (first row, rows) runs read and stacked instead of `region`


class WeightReader(Protocol):
    """Where a rank reads weights: a loader's `WeightSet` or `HostWeights` (tests); `ShardedModel` calls
    `shape`, then `load` or `load_region` once per weight its stage holds."""

    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def load(self, name: str) -> np.ndarray: ...

    def load_region(self, name: str, region: Region) -> np.ndarray: ...


class HostWeights:
    """A WeightReader over canonical float32 arrays already in memory."""

    def __init__(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.arrays = arrays

    def names(self) -> list[str]:
        return list(self.arrays)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.arrays[name].shape)

    def load(self, name: str) -> np.ndarray:
        return np.array(self.arrays[name], dtype=np.float32)

    def load_region(self, name: str, region: Region) -> np.ndarray:
        return np.array(self.arrays[name][region], dtype=np.float32)


def local_spec(spec: ModelSpec, pos: RankPosition) -> ModelSpec:
    """The shapes one rank computes with: its share of heads and MLP/expert widths."""
    tp = pos.config.tp
    moe, la = spec.moe, spec.linear_attn
    if moe is not None:
        moe = replace(moe, expert_intermediate_size=moe.expert_intermediate_size // tp,
                      shared_intermediate_size=moe.shared_intermediate_size // tp)
    if la is not None:  # each rank runs its delta-net heads and keeps their recurrent state
        la = replace(la, num_k_heads=la.num_k_heads // tp, num_v_heads=la.num_v_heads // tp)
    return spec.with_(
        linear_attn=la,
        num_heads=spec.num_heads // tp,
        num_kv_heads=max(1, spec.num_kv_heads // tp),
        global_kv_heads=max(1, spec.global_kv_heads // tp) if spec.global_kv_heads else None,
        intermediate_size=spec.intermediate_size // tp if spec.intermediate_size % tp == 0 else spec.intermediate_size,
        moe=moe,
    )


def owned(name: str, spec: ModelSpec, pos: RankPosition) -> bool:
    """Whether this rank's stage holds `name` at all."""
    if name.startswith("layers."):
        return int(name.split(".")[1]) in pos.layers
    if name.startswith(_EVERY_STAGE):
        return True
    if name == "embed":
        return pos.first_stage or (pos.last_stage and spec.tie_word_embeddings)
    return pos.last_stage  # norm, lm_head


def shard_request(name: str, shape: tuple[int, ...], spec: ModelSpec, pos: RankPosition) -> Part | None:
    """The part of weight `name` (full shape `shape`) this rank reads, or None when its stage holds none
    of it; WeightError for a name no rule covers."""
    if not owned(name, spec, pos) or name == "lm_head" and spec.tie_word_embeddings:
        return None  # a tied lm_head is the embedding's rows
    tp, t = pos.config.tp, pos.tp_rank
    if name in ("embed", "lm_head"):
        n = spec.vocab_size // tp
        return Part(VOCAB, (slice(t * n, (t + 1) * n),), t * n)
    part = name.split(".", 2)[-1] if name.startswith("layers.") else name
    layer = int(name.split(".")[1]) if name.startswith("layers.") else 0
    D = spec.head_dim_for(layer)  # Gemma 4's global layers have their own head size and KV heads
    if part in ("q_norm", "k_norm") and tp > 1 and _projection_wide(part, shape, spec, layer):
        return _projection_norm(part, shape, spec, pos, layer)
    if name == "norm" or part in _REPLICATED or name.startswith(_EVERY_STAGE):
        return Part(REPLICATED)
    if part.startswith("lin."):
        return _linear_attention_part(part, shape, spec, pos)
    if part in ("q", "q_bias", "q_b", "q_gate"):  # by whole heads (MLA: head_dim is qk_nope + qk_rope)
        h = spec.num_heads // tp
        return Part(COLUMN, (slice(t * h * D, (t + 1) * h * D),))
    if part in ("sinks", "kv_b_k", "kv_b_v"):  # one entry per head along the first axis
        h = spec.num_heads // tp
        return Part(COLUMN, (slice(t * h, (t + 1) * h),))
    if part in ("k", "v", "k_bias", "v_bias"):
        kv = spec.kv_heads_for(layer)
        first, n = (t * kv // tp, kv // tp) if kv % tp == 0 else (t * kv // tp, 1)
        return Part(COLUMN, (slice(first * D, (first + n) * D),))
    if part in ("o", "down", "shared.down"):  # input columns: heads' outputs, or the MLP width
        n = shape[1] // tp
        return Part(ROW, (slice(None), slice(t * n, (t + 1) * n)))
    if part in ("gate", "up", "shared.gate", "shared.up"):
        n = shape[0] // tp
        return Part(COLUMN, (slice(t * n, (t + 1) * n),))
    if part.startswith("experts."):
        return _experts_part(part, shape, pos)
    raise WeightError(f"no tensor-parallel rule for weight {name!r}; the parallel torch backend cannot split it")


def _projection_wide(part: str, shape: tuple[int, ...], spec: ModelSpec, layer: int) -> bool:
    """Whether a q/k norm spans the whole projection (every head) rather than one head."""
    heads = spec.num_heads if part == "q_norm" else spec.kv_heads_for(layer)
    return heads > 1 and shape == (heads * spec.head_dim_for(layer),)


def _projection_norm(part: str, shape: tuple[int, ...], spec: ModelSpec, pos: RankPosition, layer: int) -> Part:
    """A whole-projection norm's slice, cut like its q or k rows; replicated KV heads count once per copy."""
    tp, t, D = pos.config.tp, pos.tp_rank, spec.head_dim_for(layer)
    if part == "q_norm":
        h = spec.num_heads // tp
        return Part(NORM, (slice(t * h * D, (t + 1) * h * D),), shape[0])
    kv = spec.kv_heads_for(layer)
    first, n, copies = (t * kv // tp, kv // tp, 1) if kv % tp == 0 else (t * kv // tp, 1, tp // kv)
    return Part(NORM, (slice(first * D, (first + n) * D),), shape[0] * copies)


def _linear_attention_part(part: str, shape: tuple[int, ...], spec: ModelSpec, pos: RankPosition) -> Part:
    """A gated delta-net layer's share: whole key heads with their value heads (value heads follow key
    heads in contiguous groups, so both split alike); the projection and conv rows hold the q, k and v
    channels side by side, each cut the same way; the output projection is row-parallel."""
    la, tp, t = spec.linear_attn, pos.config.tp, pos.tp_rank
    assert la is not None
    if part == "lin.out":
        n = shape[1] // tp
        return Part(ROW, (slice(None), slice(t * n, (t + 1) * n)))
    if part in ("lin.qkv", "lin.conv"):
        kd, vd = la.key_dim // tp, la.value_dim // tp
        return Part(COLUMN, pieces=((t * kd, kd), (la.key_dim + t * kd, kd), (2 * la.key_dim + t * vd, vd)))
    n = shape[0] // tp  # z [Vd, C], a and b [Hv, C], dt_bias and decay [Hv]: by value heads
    return Part(COLUMN, (slice(t * n, (t + 1) * n),))


def _experts_part(part: str, shape: tuple[int, ...], pos: RankPosition) -> Part:
    """This expert group's experts; each expert's width split across tensor ranks ([E, I, C] rows,
    [E, C, I] columns, [E, I] biases); the down bias [E, C] is whole (one tensor rank adds it)."""
    tp, t = pos.config.tp, pos.tp_rank
    g, e = pos.expert_group, shape[0] // pos.config.ep
    box = [slice(g * e, (g + 1) * e)] + [slice(None)] * (len(shape) - 1)
    axis = {"experts.down": 2, "experts.down_bias": None}.get(part, 1)
    if axis is not None:
        n = shape[axis] // tp
        box[axis] = slice(t * n, (t + 1) * n)
    return Part(EXPERTS, tuple(box), g * e)


def read_part(weights: WeightReader, name: str, part: Part) -> np.ndarray:
    """This rank's part of `name`: the whole weight when replicated, else only the box's values."""
    if part.pieces:
        return np.concatenate([weights.load_region(name, (slice(a, a + n),)) for a, n in part.pieces])
    return weights.load_region(name, part.region) if part.region else weights.load(name)
