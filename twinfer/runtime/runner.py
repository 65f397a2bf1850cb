"""The runner interface: `step(batch) -> logits for the rows to sample`.

Two kinds implement it: `OpsRunner` (an architecture from runtime/models over a backend's Ops) and
whole-model runners such as llama.cpp's. The engine owns scheduling and KV accounting; a runner
only computes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from twinfer.runtime.batch import StepBatch
from twinfer.runtime.ops import Ops
from twinfer.runtime.spec import ModelSpec


@dataclass(frozen=True)
class KVLayout:
    """How a runner's KV cache is addressed.

    Paged runners hold `num_blocks` blocks of `block_size` positions each and read the chunks'
    block tables. Sequence-slot runners (llama.cpp) keep KV per `seq_id` below `max_seqs`, with at
    most `num_blocks * block_size` cells in total; they ignore block tables. `seq_tokens` caps one
    sequence when the runner gives each sequence its own cells (llama.cpp without a unified cache);
    such runners cannot share cells between sequences, so the engine turns prefix reuse off.
    """

    block_size: int
    num_blocks: int
    paged: bool = True
    max_seqs: int = 1 << 30
    seq_tokens: int | None = None

    @property
    def capacity_tokens(self) -> int:
        return self.block_size * self.num_blocks

    @property
    def max_seq_tokens(self) -> int:
        """The most positions one sequence may hold."""
        return self.capacity_tokens if self.seq_tokens is None else min(self.seq_tokens, self.capacity_tokens)


class Runner(ABC):
    """Computes logits for a StepBatch. Called by the engine from one thread, one step at a time.

    Contract: rows come back in `batch.logit_token_index()` order as float32 [rows, vocab]; the KV
    of every chunk's tokens is stored before `step` returns, so the next step may continue them.
    """

    spec: ModelSpec
    kv: KVLayout
    backend: str  # "torch", "mlx", "llamacpp"

    @abstractmethod
    def step(self, batch: StepBatch) -> np.ndarray:
        """Run one forward pass; return float32 logits [batch.num_logit_rows, vocab]."""

    def release(self, seq_id: int) -> None:  # noqa: B027 - optional hook
        """Forget a finished or preempted sequence's KV (paged runners: nothing to do)."""

    def truncate(self, seq_id: int, length: int) -> None:  # noqa: B027 - optional hook
        """Keep only the first `length` KV positions of a sequence (sequence-slot runners only)."""

    def copy_prefix(self, src_seq: int, dst_seq: int, num_tokens: int) -> None:  # noqa: B027 - optional hook
        """Share the first `num_tokens` KV positions of src with dst (sequence-slot runners only)."""

    def describe(self) -> dict[str, Any]:
        """Facts for bench and status displays: backend, device, dtype, versions."""
        return {"backend": self.backend}


class OpsRunner(Runner):
    """Runs an architecture from runtime/models over a backend's Ops."""

    def __init__(self, spec: ModelSpec, ops: Ops, weights: dict[str, Any], kv: KVLayout, backend: str):
        from twinfer.runtime.models import model_for

        self.spec = spec
        self.kv = kv
        self.backend = backend
        self.ops = ops
        self.model = model_for(spec)
        self.weights = weights

    def step(self, batch: StepBatch) -> np.ndarray:
        ctx = self.ops.begin_step(batch)
        hidden = self.model.forward(self.ops, self.weights, ctx)  # [T, C]
        rows = self.ops.select_rows(hidden, ctx)  # [R, C]
        logits = self.model.logits(self.ops, self.weights, rows)  # [R, V]
        out: np.ndarray = self.ops.to_host(logits)
        return out
