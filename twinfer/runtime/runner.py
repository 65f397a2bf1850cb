"""The runner interface: `step(batch) -> logits for the rows to sample`.
`OpsRunner` runs an architecture over a backend's Ops; whole-model runners (llama.cpp) compute alone.
A runner declares what it needs from the scheduler: `kv`, `exact_shapes()`, `kv_sync(...)`
(docs/architecture.md, "The runner contract")."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from twinfer.runtime.batch import StepBatch
from twinfer.runtime.kv.block_manager import BlockManager
from twinfer.runtime.kv.connector import KVPort
from twinfer.runtime.kv.traffic import StepBytes, StepTraffic
from twinfer.runtime.ops import Ops
from twinfer.runtime.spec import ModelSpec
from twinfer.runtime.vision import VisionTower


@dataclass(frozen=True)
class KVLayout:
    """How a runner's KV cache is addressed.
    Paged runners hold `num_blocks` blocks of `block_size` positions and read block tables. Slot runners
    keep KV per `seq_id` (at most `max_seqs`, `num_blocks * block_size` cells in all); `seq_tokens` caps
    one sequence when each has its own cells, and then prefix reuse needs `copies_prefix`. `recurrent`:
    a forward-only state per sequence, so no prefix reuse and preemption recomputes; `state_rollback`:
    how many drafted tokens such a runner can take back from a chunk (0: none, so no speculation)."""

    block_size: int
    num_blocks: int
    paged: bool = True
    max_seqs: int = 1 << 30
    seq_tokens: int | None = None
    copies_prefix: bool = False
    recurrent: bool = False
    state_rollback: int = 0

    @property
    def capacity_tokens(self) -> int:
        return self.block_size * self.num_blocks

    @property
    def max_seq_tokens(self) -> int:
        """The most positions one sequence may hold."""
        return self.capacity_tokens if self.seq_tokens is None else min(self.seq_tokens, self.capacity_tokens)


@dataclass(frozen=True)
class ExactShapes:
    """Step shapes under which a runner gives every row the logits it would get alone: in batch-invariant
    mode each prompt chunk alone at fixed boundaries, at most `decode_rows` one-token rows, drafts only
    while one request runs; `reserved_seqs` stay with the runner to pad a lone row (`StepBatch.exact`)."""

    decode_rows: int
    reserved_seqs: int = 0

    def __post_init__(self) -> None:
        if self.decode_rows < 1 or self.reserved_seqs < 0:
            raise ValueError("exact shapes need at least one decode row and no negative reservation")


class KVSync:
    """Keeps a runner's KV storage in step with the engine's block accounting.
    Made by `Runner.kv_sync` for one engine and called from its thread at fixed points of every step.
    This base suits paged runners (does nothing); a per-sequence runner copies prefixes and keeps finished
    sequences' blocks while it has room. Evicting nothing is always safe."""

    def reusable(self, block_ids: list[int]) -> int:
        """How many leading blocks of a matched cached prefix a new sequence may start from."""
        return len(block_ids)

    def begin_step(self, preempted: list[int], admitted: list[tuple[int, int]]) -> None:  # noqa: B027 - optional hook
        """Before the batch is built: `preempted` sequences lost their blocks; each admitted
        `(seq_id, prefix_blocks)` starts from that many cached blocks (its table's first ones)."""

    def computed(self, seq_id: int, num_computed: int) -> None:  # noqa: B027 - optional hook
        """The sequence's first `num_computed` positions are now in the runner's KV."""

    def finished(self, seq_id: int, table: list[int]) -> None:  # noqa: B027 - optional hook
        """The sequence ended and the block manager freed `table` (its registered blocks stay cached)."""

    def dropped(self, seq_id: int) -> None:  # noqa: B027 - optional hook
        """The sequence's KV is void (a retry recomputes it from position 0)."""

    def isolate(self) -> None:  # noqa: B027 - optional hook
        """The sequence admitted this step runs alone and must compute as on a fresh runner (a scored
        prompt): drop whatever else the runner keeps that could change its numerics."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """The engine closes: give back every sequence kept for reuse."""


class Runner(ABC):
    """Computes logits for a StepBatch. Called by the engine from one thread, one step at a time.
    Rows come back in `batch.logit_token_index()` order as float32 [rows, vocab]; every chunk's KV is
    stored before `step` returns. A chunk starting before the held positions overwrites from `start` on."""

    spec: ModelSpec
    kv: KVLayout
    backend: str  # "torch", "mlx", "llamacpp"
    traffic: StepTraffic | None = None  # how its steps move bytes (the request bill); None: unknown
    kv_port: KVPort | None = None  # how its KV leaves and enters for another replica (kv/connector.py)
    step_tokens: int = 512  # tokens an engine step computes by default (EngineConfig.max_batch_tokens=None)
    vision: VisionTower | None = None  # how the model reads images; None: text only

    @abstractmethod
    def step(self, batch: StepBatch) -> np.ndarray:
        """Run one forward pass; return float32 logits [batch.num_logit_rows, vocab]."""

    def step_borrowed(self, batch: StepBatch) -> np.ndarray:
        """`step`, whose rows may be a view of the runner's buffer, valid until the next call into it;
        callers that keep rows call `step`."""
        return self.step(batch)

    def release(self, seq_id: int) -> None:  # noqa: B027 - optional hook
        """Forget a finished or preempted sequence's KV (paged runners: nothing to do)."""

    def step_bytes(self, batch: StepBatch) -> StepBytes | None:
        """Bytes `batch` moves (weights, experts, KV per chunk), from `traffic`; None when unknown."""
        return self.traffic.step(batch) if self.traffic is not None else None

    def exact_shapes(self) -> ExactShapes | None:
        """The step shapes that keep this runner batch-invariant; None when every shape does."""
        return None

    def kv_sync(self, blocks: BlockManager, slots: int, running: Callable[[], int]) -> KVSync:
        """The KVSync for one engine: `blocks` is its accounting, `slots` the sequences it may hold
        at once (running and kept), `running()` how many run now. Paged runners need nothing."""
        return KVSync()

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

    def release(self, seq_id: int) -> None:
        if self.spec.recurrent:
            self.ops.release_state(seq_id)

    def kv_sync(self, blocks: BlockManager, slots: int, running: Callable[[], int]) -> KVSync:
        if not self.spec.recurrent:
            return KVSync()
        from twinfer.runtime.kv.recurrent import StateSync

        return StateSync(self.release)  # state slots go back when a sequence is preempted, dropped or done

    def step(self, batch: StepBatch) -> np.ndarray:
        ctx = self.ops.begin_step(batch)
        hidden = self.model.forward(self.ops, self.weights, ctx)  # [T, C]
        rows = self.ops.select_rows(hidden, ctx)  # [R, C]
        logits = self.model.logits(self.ops, self.weights, rows)  # [R, V]
        out: np.ndarray = self.ops.to_host(logits)
        return out
