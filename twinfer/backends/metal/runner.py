"""Build an `OpsRunner` over MLX from a loaded model or from a dict of canonical-name weights."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx

from twinfer.backends.metal.kv_port import MlxKVPort
from twinfer.backends.metal.ops import MlxOps
from twinfer.runtime.kv.recurrent import DRAFT_ROLLBACK
from twinfer.runtime.kv.traffic import StepTraffic, held_bytes, resident_traffic
from twinfer.runtime.ops import Ops
from twinfer.runtime.runner import KVLayout, OpsRunner
from twinfer.runtime.spec import ModelSpec

if TYPE_CHECKING:
    from twinfer.runtime.loaders import LoadedModel


def load_mlx_runner(
    loaded: LoadedModel,
    *,
    kv_tokens: int = 4096,
    block_size: int = 16,
    dtype: str | mx.Dtype = "float32",
    kv_format: str | None = None,
) -> OpsRunner:
    """An MLX runner for a model from `runtime.loaders.load_model`, with a paged KV cache of
    `kv_tokens` positions in blocks of `block_size`. Weights are converted one at a time.
    `kv_format` ("tq4", "tq2.5", "tq3-qjl"; None: dense) codes the KV cache with TurboQuant. A checkpoint
    with a vision tower gets it as `runner.vision`, in the runner's dtype."""
    from twinfer.runtime.vision.towers import open_vision

    w = loaded.weights
    runner = _build(loaded.spec, w.names(), w.__getitem__, kv_tokens, block_size, dtype, kv_format)  # packed where kept
    runner.vision = open_vision(loaded, runner.ops)
    return runner


def build_mlx_runner(
    spec: ModelSpec,
    weights: Mapping[str, Any],
    *,
    kv_tokens: int = 4096,
    block_size: int = 16,
    dtype: str | mx.Dtype = "float32",
    kv_format: str | None = None,
) -> OpsRunner:
    """An MLX runner from canonical-name -> host tensor (numpy float32 or QuantizedWeight) weights."""
    return _build(spec, weights.keys(), weights.__getitem__, kv_tokens, block_size, dtype, kv_format)


def _build(
    spec: ModelSpec,
    names: Iterable[str],
    load: Callable[[str], Any],
    kv_tokens: int,
    block_size: int,
    dtype: str | mx.Dtype,
    kv_format: str | None = None,
) -> OpsRunner:
    if block_size <= 0 or kv_tokens < block_size:
        raise ValueError(
            f"KV cache of {kv_tokens} tokens in blocks of {block_size}: need kv_tokens >= block_size > 0"
        )
    _wire_working_set()
    kv = KVLayout(block_size=block_size, num_blocks=-(-kv_tokens // block_size), recurrent=spec.recurrent,
                  state_rollback=DRAFT_ROLLBACK if spec.recurrent else 0)  # recurrent.py keeps drafts' states
    ops = MlxOps(spec, num_blocks=kv.num_blocks, block_size=block_size, dtype=dtype, kv_format=kv_format)
    weights = {}
    for name in names:
        if name == "lm_head" and spec.tie_word_embeddings:
            continue  # tied: the model reads `embed`; keep one copy on the device
        weights[name] = ops.weight(name, load(name))
    # cast: Ops types its step context as the StepContext protocol, backends as their own class
    runner = OpsRunner(spec, cast(Ops, ops), weights, kv, backend="mlx")
    runner.traffic = mlx_traffic(spec, weights, ops, kv.num_blocks * block_size)
    runner.kv_port = MlxKVPort(ops)  # a recurrent model's linear-attention layers send their state
    return runner


def mlx_traffic(spec: ModelSpec, weights: Mapping[str, Any], ops: MlxOps, slots: int) -> StepTraffic:
    """What a step reads and writes: the weights as held (the torch runner's accounting), and each layer's
    KV cache bytes per slot (`slots`: the cache's positions; dense K/V, or TurboQuant's codes and norms)."""
    if ops.kv_quant:
        layers = tuple(c.nbytes / slots for c in ops.kv_quant)
    else:
        layers = tuple((k.nbytes + v.nbytes) / slots for k, v in zip(ops.k_cache, ops.v_cache, strict=True))
    return resident_traffic(spec, {n: float(held_bytes(w, mx.array)) for n, w in weights.items()}, layers)


def _wire_working_set() -> None:
    # On Apple silicon, keep up to the recommended working set wired so weights are not paged out
    # between steps (what mlx-lm does while generating). Nothing to do on the CPU device.
    if not mx.metal.is_available():
        return
    limit = mx.device_info().get("max_recommended_working_set_size")
    if limit:
        mx.set_wired_limit(int(limit))
