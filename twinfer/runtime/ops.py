"""The Ops interface: the operations an architecture's forward pass is written over.

Model files in `runtime/models/` call these and nothing else that touches arrays, apart from
`+`, `*` and `.reshape(...)`, which torch and MLX arrays both support. A backend (`backends/cuda`
with torch, `backends/metal` with MLX) implements Ops once and runs every architecture.

Shapes: T is the number of tokens in the step (all sequences flattened), C the hidden size,
H/Hkv the query/KV heads, D the head dim, E the number of experts.
"""

from __future__ import annotations

from typing import Any, Protocol

from twinfer.runtime.batch import StepBatch
from twinfer.runtime.spec import MoESpec

Array = Any  # a torch.Tensor or mx.array; the runtime never looks inside


class StepContext(Protocol):
    """Per-step device state a backend builds from a StepBatch (positions, KV slots, masks).

    Model code passes it through to `rope` and `attention` without looking inside.
    """

    tokens: Array  # [T] int token ids on the device


class Ops(Protocol):
    """Array operations over one backend's device. Created by the backend with its KV storage.

    Called by `runtime.runner.OpsRunner` (begin_step, select_rows) and by model files (the rest),
    once per step, from one thread. No method waits for the device except `to_host`.
    """

    def begin_step(self, batch: StepBatch) -> StepContext:
        """Upload the batch's ids, positions and KV slot tables; the KV blocks must be allocated."""
        ...

    def weight(self, name: str, value: Any) -> Array:
        """Turn a host tensor (numpy float32 or a quantized handle) into this backend's weight."""
        ...

    def embedding(self, table: Array, ids: Array) -> Array:
        """[T] ids -> [T, C] rows of `table` ([vocab, C])."""
        ...

    def linear(self, x: Array, w: Array, bias: Array | None = None) -> Array:
        """[T, in] @ w[out, in].T (+ bias) -> [T, out]."""
        ...

    def rms_norm(self, x: Array, w: Array, eps: float) -> Array:
        """RMS-normalize over the last axis, in float32, then multiply by `w`."""
        ...

    def act(self, x: Array, kind: str) -> Array:
        """Elementwise activation: "silu" or "gelu_tanh"."""
        ...

    def softcap(self, x: Array, cap: float) -> Array:
        """cap * tanh(x / cap) (Gemma 2 style logit soft-capping)."""
        ...

    def rope(self, x: Array, ctx: StepContext, layer: int) -> Array:
        """Rotate [T, heads, D] by each token's position (NeoX half-split layout), layer's base."""
        ...

    def attention(self, q: Array, k: Array, v: Array, ctx: StepContext, layer: int) -> Array:
        """Store k, v [T, Hkv, D] in layer's KV cache, then attend causally: q [T, H, D] -> [T, H, D].

        Each query sees its own sequence's keys up to its position, limited to the layer's sliding
        window when it has one. Scale is the spec's attention_scale.
        """
        ...

    def moe(
        self,
        x: Array,
        router: Array,
        gate: Array,
        up: Array,
        down: Array,
        moe: MoESpec,
        act: str,
    ) -> Array:
        """Routed experts: x [T, C]; router [E, C]; gate/up [E, I, C]; down [E, C, I] -> [T, C]."""
        ...

    def select_rows(self, x: Array, ctx: StepContext) -> Array:
        """The rows of x [T, C] whose logits the batch asked for, in batch order."""
        ...

    def to_host(self, x: Array) -> Any:
        """Copy to a numpy float32 array; the one place a step waits for the device."""
        ...
