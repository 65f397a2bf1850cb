"""Sharding as a transform of a built model's weights: full canonical tensors -> one rank's slices.

Rules (Megatron-style): Q/K/V and the MLP's gate/up are column-parallel (split by output rows, by
whole heads for attention); O and down are row-parallel (split by input columns, summed across the
tensor group afterwards); the embedding and lm_head are vocab-parallel; experts are split across
expert groups, each expert's width across tensor ranks; norms and the router are replicated. A
pipeline stage keeps only its own layers (the embedding on the first stage, norm and lm_head on
the last). Fewer KV heads than tensor ranks are replicated, so every rank holds the KV head its
query heads read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from twinfer.backends.cuda.parallel.layout import RankPosition
from twinfer.runtime.errors import WeightError
from twinfer.runtime.spec import ModelSpec

REPLICATED, COLUMN, ROW, VOCAB, EXPERTS = "replicated", "column", "row", "vocab", "experts"
_REPLICATED = {"attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm", "router"}


@dataclass(frozen=True)
class Shard:
    """One rank's slice of a weight and how the forward pass combines it across ranks."""

    value: Any  # numpy array
    kind: str  # REPLICATED, COLUMN, ROW, VOCAB or EXPERTS
    offset: int = 0  # VOCAB: first token id; EXPERTS: first expert id


def local_spec(spec: ModelSpec, pos: RankPosition) -> ModelSpec:
    """The shapes one rank computes with: its share of heads and MLP/expert widths."""
    tp = pos.config.tp
    moe = spec.moe
    if moe is not None:
        moe = replace(moe, expert_intermediate_size=moe.expert_intermediate_size // tp)
    return spec.with_(
        num_heads=spec.num_heads // tp,
        num_kv_heads=max(1, spec.num_kv_heads // tp),
        intermediate_size=spec.intermediate_size // tp if spec.intermediate_size % tp == 0 else spec.intermediate_size,
        moe=moe,
    )


def owned(name: str, spec: ModelSpec, pos: RankPosition) -> bool:
    """Whether this rank's stage holds `name` at all."""
    if name.startswith("layers."):
        return int(name.split(".")[1]) in pos.layers
    if name == "embed":
        return pos.first_stage or (pos.last_stage and spec.tie_word_embeddings)
    return pos.last_stage  # norm, lm_head


def shard(name: str, value: np.ndarray, spec: ModelSpec, pos: RankPosition) -> Shard:
    """This rank's slice of the full tensor `name`; WeightError for a name no rule covers."""
    tp, t = pos.config.tp, pos.tp_rank
    if name in ("embed", "lm_head"):
        n = spec.vocab_size // tp
        return Shard(value[t * n : (t + 1) * n], VOCAB, t * n)
    if name == "norm":
        return Shard(value, REPLICATED)
    part = name.split(".", 2)[-1] if name.startswith("layers.") else name
    if part in _REPLICATED:
        return Shard(value, REPLICATED)
    D = spec.head_dim
    if part in ("q", "q_bias"):
        h = spec.num_heads // tp
        return Shard(value[t * h * D : (t + 1) * h * D], COLUMN)
    if part in ("k", "v", "k_bias", "v_bias"):
        kv = spec.num_kv_heads
        first, n = (t * kv // tp, kv // tp) if kv % tp == 0 else (t * kv // tp, 1)
        return Shard(value[first * D : (first + n) * D], COLUMN)
    if part == "o":
        h = spec.num_heads // tp
        return Shard(value[:, t * h * D : (t + 1) * h * D], ROW)
    if part in ("gate", "up"):
        n = value.shape[0] // tp
        return Shard(value[t * n : (t + 1) * n], COLUMN)
    if part == "down":
        n = value.shape[1] // tp
        return Shard(value[:, t * n : (t + 1) * n], ROW)
    if part.startswith("experts."):
        ep, g = pos.config.ep, pos.expert_group
        e = value.shape[0] // ep
        mine = value[g * e : (g + 1) * e]  # [E/ep, I, C] or [E/ep, C, I]
        axis = 2 if part == "experts.down" else 1
        n = mine.shape[axis] // tp
        sl = [slice(None)] * 3
        sl[axis] = slice(t * n, (t + 1) * n)
        return Shard(mine[tuple(sl)], EXPERTS, g * e)
    raise WeightError(f"no tensor-parallel rule for weight {name!r}; the parallel torch backend cannot split it")
