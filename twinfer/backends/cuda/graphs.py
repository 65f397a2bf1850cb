"""CUDA graphs for pure-decode steps at batch-size buckets (1, 2, 4, ... up to `max_graph_batch`).
One graph per bucket is captured on first use and replayed; real rows are padded to the bucket with rows
that write a scratch block and whose logits are dropped. Prefill, mixed or oversized steps, CPUs,
TurboQuant KV and the plain-torch kernels run eagerly; `step_padded` lets CPU tests check the padding."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from twinfer.backends.cuda.ops import TorchOps, TorchStep
from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch
from twinfer.runtime.ops import Ops
from twinfer.runtime.runner import KVLayout, OpsRunner
from twinfer.runtime.spec import ModelSpec

log = logging.getLogger(__name__)

DEFAULT_MAX_GRAPH_BATCH = 64
STATIC_INPUTS = ("tokens", "positions", "slots", "block_tables", "context_lens")  # what a replay reads


def decode_buckets(max_batch: int) -> list[int]:
    """Powers of two below `max_batch`, then `max_batch` itself: 1, 2, 4, ..., max_batch."""
    if max_batch < 1:
        raise ValueError(f"max_graph_batch must be at least 1, got {max_batch}")
    out = [1]
    while out[-1] * 2 < max_batch:
        out.append(out[-1] * 2)
    return out + ([max_batch] if out[-1] != max_batch else [])


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding `n` sequences, or None when n is larger than every bucket."""
    return next((b for b in buckets if b >= n), None)


def is_pure_decode(batch: StepBatch) -> bool:
    return bool(batch.chunks) and all(len(c.tokens) == 1 for c in batch.chunks)


def pad_decode_batch(batch: StepBatch, bucket: int, scratch_block: int) -> StepBatch:
    """`batch` (one token per chunk) padded to `bucket` chunks; a padding chunk is token 0 at position 0 of
    the scratch block, so it writes and reads only there and cannot change a real row."""
    n = len(batch.chunks)
    if n > bucket:
        raise ValueError(f"{n} sequences do not fit a decode bucket of {bucket}")
    real = [replace(c, logits=LogitsWanted.LAST) for c in batch.chunks]
    pads = [SeqChunk(-1 - i, [0], 0, [scratch_block], LogitsWanted.LAST) for i in range(bucket - n)]
    return StepBatch(real + pads)


def wanted_rows(batch: StepBatch) -> list[int]:
    """Which of a decode batch's chunks asked for logits (a padded step computes a row for every chunk)."""
    return [i for i, c in enumerate(batch.chunks) if c.logit_rows]


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    ctx: TorchStep  # the static inputs the graph reads; a replay copies each step's into them
    logits: torch.Tensor  # [bucket, V], written by every replay


class TorchRunner(OpsRunner):
    """The torch backend's runner: eager steps, and CUDA-graph replays of decode steps on a GPU. With
    `padded_steps` the cache holds one more block than `kv` reports: the padding rows' scratch."""

    def __init__(self, spec: ModelSpec, ops: TorchOps, weights: dict[str, Any], kv: KVLayout, *,
                 cuda_graphs: bool = True, max_graph_batch: int = DEFAULT_MAX_GRAPH_BATCH, padded_steps: bool = True):
        super().__init__(spec, ops_protocol(ops), weights, kv, backend="torch")
        self.torch_ops = ops
        self.scratch_block = kv.num_blocks
        self.padded_steps = padded_steps
        self.buckets = decode_buckets(max_graph_batch)
        self.graphs: dict[int, _Graph] = {}
        # None: graphs are used
        self.graphs_off = graphs_off_reason(ops, cuda_graphs) or (None if padded_steps else "padded_steps=False")
        self._pool: Any = None

    def step(self, batch: StepBatch) -> np.ndarray:
        bucket = bucket_for(len(batch.chunks), self.buckets) if is_pure_decode(batch) else None
        if self.graphs_off is not None or bucket is None:
            return super().step(batch)
        graph = self.graphs.get(bucket) or self._capture(bucket)
        if graph is None:
            return super().step(batch)
        return self._replay(graph, batch, bucket)

    def step_padded(self, batch: StepBatch, bucket: int) -> np.ndarray:
        """An eager decode step padded to `bucket` rows with the graphs' fixed-width inputs: what a replay
        computes, on any device (how CPU tests check the padding)."""
        if not self.padded_steps:
            raise ValueError("step_padded needs a runner built with padded_steps=True (a scratch KV block)")
        ctx = self.torch_ops.begin_step(pad_decode_batch(batch, bucket, self.scratch_block), self.table_width)
        with torch.no_grad():
            logits = self._forward(ctx)  # [bucket, V]
        return self.torch_ops.to_host(logits)[wanted_rows(batch)]

    def describe(self) -> dict[str, Any]:
        ops = self.torch_ops
        graphs = f"off ({self.graphs_off})" if self.graphs_off else f"decode buckets {self.buckets}"
        return {"backend": "torch", "device": str(ops.device), "dtype": str(ops.dtype).removeprefix("torch."),
                "kernels": ops.kernels, "cuda_graphs": graphs, "torch": torch.__version__}

    @property
    def table_width(self) -> int:
        """Block-table width of every graph: the most blocks one sequence can hold, plus the scratch."""
        return -(-self.kv.max_seq_tokens // self.kv.block_size) + 1

    def _forward(self, ctx: TorchStep) -> torch.Tensor:
        ctx.cache.clear()  # rope tables are recomputed from the static positions inside the graph
        ops = self.ops
        hidden = self.model.forward(ops, self.weights, ctx)
        return self.model.logits(ops, self.weights, ops.select_rows(hidden, ctx))  # type: ignore[no-any-return]

    def _capture(self, bucket: int) -> _Graph | None:
        """Capture `bucket`'s graph over an all-padding batch (its writes land in the scratch block)."""
        ops = self.torch_ops
        try:
            ctx = ops.begin_step(pad_decode_batch(StepBatch([]), bucket, self.scratch_block), self.table_width)
            with torch.no_grad():
                side = torch.cuda.Stream(ops.device)
                side.wait_stream(torch.cuda.current_stream(ops.device))
                with torch.cuda.stream(side):  # warm-up: triton compiles, cuBLAS picks its kernels
                    for _ in range(2):
                        self._forward(ctx)
                torch.cuda.current_stream(ops.device).wait_stream(side)
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    logits = self._forward(ctx)
        except Exception as e:  # an op that syncs with the host, or a kernel that fails to build: run eagerly
            self.graphs_off = f"capture failed at batch {bucket}: {str(e).splitlines()[0]}"
            log.warning("CUDA graphs turned off: %s", self.graphs_off)
            return None
        self.graphs[bucket] = _Graph(graph, ctx, logits)
        return self.graphs[bucket]

    def _replay(self, g: _Graph, batch: StepBatch, bucket: int) -> np.ndarray:
        ops = self.torch_ops
        inputs = ops.decode_inputs(pad_decode_batch(batch, bucket, self.scratch_block), self.table_width)
        for name in STATIC_INPUTS:
            getattr(g.ctx, name).copy_(torch.from_numpy(inputs[name]))
        g.graph.replay()
        rows = torch.as_tensor(wanted_rows(batch), device=ops.device)
        return ops.to_host(g.logits.index_select(0, rows))


def graphs_off_reason(ops: TorchOps, wanted: bool) -> str | None:
    """Why decode steps of these Ops cannot be captured, or None when they can."""
    if not wanted:
        return "cuda_graphs=False"
    if ops.device.type != "cuda":
        return f"device {ops.device.type}"
    if ops.kernels != "triton":
        return "the plain-torch kernels read MoE counts back from the device; graphs need the triton path"
    if ops.kv_quant:
        return "TurboQuant KV caches run eagerly"
    if ops.spec.mla is not None:  # it gathers each step's [B, L] slots, which a replay does not copy in
        return "latent attention runs eagerly"
    if ops.states is not None:  # a replay would read the slots of the step it was captured on
        return "recurrent-state slots are bound per step (linear-attention layers)"
    if ops.spec.head_dim & (ops.spec.head_dim - 1):
        return f"head_dim {ops.spec.head_dim} is not a power of two (the decode kernel's tile)"
    return None


def ops_protocol(ops: TorchOps) -> Ops:
    """TorchOps typed as the Ops protocol (its step context is its own class, not the protocol)."""
    return ops  # type: ignore[return-value]
