"""Build an `OpsRunner` over torch from a loaded model or from a dict of canonical-name weights."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch

from twinfer.backends.cuda.ops import TorchOps
from twinfer.runtime.ops import Ops
from twinfer.runtime.runner import KVLayout, OpsRunner
from twinfer.runtime.spec import ModelSpec

if TYPE_CHECKING:
    from twinfer.runtime.loaders import LoadedModel


def load_torch_runner(
    loaded: LoadedModel,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    kv_tokens: int = 4096,
    block_size: int = 16,
) -> OpsRunner:
    """A torch runner for a model from `runtime.loaders.load_model`, with a paged KV cache of
    `kv_tokens` positions in blocks of `block_size`. Weights are moved one at a time."""
    w = loaded.weights
    return _build(loaded.spec, w.names(), w.load, device, dtype, kv_tokens, block_size)


def build_torch_runner(
    spec: ModelSpec,
    weights: Mapping[str, Any],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    kv_tokens: int = 4096,
    block_size: int = 16,
) -> OpsRunner:
    """A torch runner from canonical-name -> host tensor (numpy float32) weights."""
    return _build(spec, weights.keys(), weights.__getitem__, device, dtype, kv_tokens, block_size)


def _build(
    spec: ModelSpec,
    names: Iterable[str],
    load: Callable[[str], Any],
    device: str | torch.device,
    dtype: torch.dtype,
    kv_tokens: int,
    block_size: int,
) -> OpsRunner:
    if block_size <= 0 or kv_tokens < block_size:
        raise ValueError(
            f"KV cache of {kv_tokens} tokens in blocks of {block_size}: need kv_tokens >= block_size > 0"
        )
    kv = KVLayout(block_size=block_size, num_blocks=-(-kv_tokens // block_size))
    ops = TorchOps(spec, num_blocks=kv.num_blocks, block_size=block_size, device=device, dtype=dtype)
    weights = {}
    for name in names:
        if name == "lm_head" and spec.tie_word_embeddings:
            continue  # tied: the model reads `embed`; keep one copy on the device
        weights[name] = ops.weight(name, load(name))
    # cast: Ops types its step context as the StepContext protocol, backends as their own class
    return OpsRunner(spec, cast(Ops, ops), weights, kv, backend="torch")
