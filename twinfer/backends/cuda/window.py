"""Sliding-window layers whose KV is bounded by the window (gpt-oss, Gemma 3) on torch: each sliding
layer caches `window_blocks` blocks through `runtime.kv.window` tables (dropped positions read the null
block), and `WindowedTorchRunner` keeps the tables in step with the engine."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from twinfer.backends.cuda.graphs import TorchRunner
from twinfer.backends.cuda.ops import TorchOps, TorchStep
from twinfer.backends.cuda.runner import torch_traffic
from twinfer.runtime.batch import StepBatch
from twinfer.runtime.kv.block_manager import BlockManager
from twinfer.runtime.kv.traffic import StepTraffic
from twinfer.runtime.kv.window import WindowBlocks, per_sequence
from twinfer.runtime.runner import KVLayout, KVSync
from twinfer.runtime.spec import ModelSpec


@dataclass
class WindowStep(TorchStep):
    """A TorchStep plus the sliding layers' slots: new tokens [T] and the context gather [B, L]."""

    w_slots: torch.Tensor | None = None
    w_kv_slots: torch.Tensor | None = None


class WindowedTorchOps(TorchOps):
    """TorchOps whose sliding-window layers hold `window_blocks` blocks of KV in all."""

    def __init__(self, spec: ModelSpec, *, num_blocks: int, block_size: int, window_blocks: int, **kwargs: Any):
        super().__init__(spec, num_blocks=num_blocks, block_size=block_size, **kwargs)
        if self.kv_quant or spec.mla is not None:
            raise ValueError("window-bounded KV runs dense K/V caches (no TurboQuant, no latent attention)")
        self.window_tables: dict[int, list[int]] = {}
        for i in range(spec.num_layers):
            if spec.window(i) is not None and self.k_cache[i].shape[0]:
                shape = (window_blocks * block_size, *self.k_cache[i].shape[1:])
                self.k_cache[i] = torch.zeros(shape, dtype=self.dtype, device=self.device)
                self.v_cache[i] = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def begin_step(self, batch: StepBatch, table_width: int | None = None) -> WindowStep:
        ctx = super().begin_step(batch, table_width)
        bs, L = self.block_size, int(ctx.kv_slots.shape[1])
        kv_slots = np.zeros((len(batch.chunks), L), dtype=np.int64)
        slots: list[np.ndarray] = []
        for b, c in enumerate(batch.chunks):
            table = np.asarray(self.window_tables[c.seq_id], dtype=np.int64)
            pos = np.arange(c.end)
            kv_slots[b, : c.end] = table[pos // bs] * bs + pos % bs
            slots.append(kv_slots[b, c.start : c.end])
        fields = {f: getattr(ctx, f) for f in TorchStep.__dataclass_fields__}
        return WindowStep(**fields, w_slots=torch.as_tensor(np.concatenate(slots)).to(self.device),
                          w_kv_slots=torch.as_tensor(kv_slots).to(self.device))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: TorchStep, layer: int,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        if self.spec.window(layer) is None or not isinstance(ctx, WindowStep) or ctx.w_slots is None \
                or ctx.w_kv_slots is None:
            return super().attention(q, k, v, ctx, layer, sinks)
        # the same cache dict: masks depend on positions only, which the window gather keeps
        windowed = replace(ctx, slots=ctx.w_slots, kv_slots=ctx.w_kv_slots, block_tables=None, context_lens=None)
        return super().attention(q, k, v, windowed, layer, sinks)


class _WindowSync(KVSync):
    def __init__(self, release: Callable[[int], None]):
        self._release = release

    def begin_step(self, preempted: list[int], admitted: list[tuple[int, int]]) -> None:
        for seq_id in preempted:
            self._release(seq_id)

    def finished(self, seq_id: int, table: list[int]) -> None:
        self._release(seq_id)

    def dropped(self, seq_id: int) -> None:
        self._release(seq_id)


class WindowedTorchRunner(TorchRunner):
    """A torch runner whose sliding-window layers keep at most the window (plus the running chunk) of KV."""

    def __init__(self, spec: ModelSpec, ops: WindowedTorchOps, weights: dict[str, Any], kv: KVLayout,
                 window: WindowBlocks):
        super().__init__(spec, ops, weights, kv, cuda_graphs=False, padded_steps=False)
        self.window = window
        self.window_ops = ops

    def step(self, batch: StepBatch) -> np.ndarray:
        for c in batch.chunks:
            self.window_ops.window_tables[c.seq_id] = self.window.table(c.seq_id, c.start, c.end)
        return super().step(batch)

    def release(self, seq_id: int) -> None:
        self.window.release(seq_id)
        self.window_ops.window_tables.pop(seq_id, None)

    def kv_sync(self, blocks: BlockManager, slots: int, running: Callable[[], int]) -> KVSync:
        return _WindowSync(self.release)


def build_windowed_torch_runner(spec: ModelSpec, weights: Mapping[str, Any], *, max_seqs: int, max_chunk: int = 512,
                                kv_tokens: int = 4096, block_size: int = 16, device: str | torch.device = "cpu",
                                dtype: torch.dtype = torch.float32) -> WindowedTorchRunner:
    """A torch runner for a model with sliding-window layers: full layers page `kv_tokens` positions,
    sliding layers hold `per_sequence(window, block_size, max_chunk)` blocks for each of `max_seqs`
    sequences (and the null block). Prefix reuse is off: the window layers do not keep a prefix."""
    window = max((spec.window(i) or 0 for i in range(spec.num_layers)), default=0)  # the widest keeps the most
    if not window:
        raise ValueError(f"{spec.name or spec.model_type} has no sliding-window layers")
    num_blocks = -(-kv_tokens // block_size)
    pool = min(num_blocks, max_seqs * per_sequence(window, block_size, max_chunk)) + 1
    kv = KVLayout(block_size=block_size, num_blocks=num_blocks, max_seqs=max_seqs, seq_tokens=num_blocks * block_size)
    ops = WindowedTorchOps(spec, num_blocks=num_blocks, block_size=block_size, window_blocks=pool, device=device,
                           dtype=dtype, kernels="torch")
    held = {n: ops.weight(n, weights[n]) for n in weights if not (n == "lm_head" and spec.tie_word_embeddings)}
    runner = WindowedTorchRunner(spec, ops, held, kv, WindowBlocks(pool, block_size, window))
    runner.traffic = window_traffic(spec, held, ops)
    return runner


def window_traffic(spec: ModelSpec, weights: Mapping[str, Any], ops: WindowedTorchOps) -> StepTraffic:
    """The torch runner's traffic (weights, experts), with KV bytes per position read off each layer's own
    cache: a sliding layer's holds the window pool, not the context, so the cache's size per position of
    the whole pool would undercount it. Its reads stop at the window either way (`StepTraffic.windows`)."""

    def per_position(cache: torch.Tensor) -> float:
        return float(cache[0].numel() * cache.element_size()) if cache.shape[0] else 0.0

    layers = tuple(per_position(k) + per_position(v) for k, v in zip(ops.k_cache, ops.v_cache, strict=True))
    return replace(torch_traffic(spec, weights, ops, ops.block_size), kv_layer_bytes=layers)
