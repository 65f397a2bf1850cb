"""The Ops interface: the operations an architecture's forward pass is written over.
Model files call these and nothing else that touches arrays, besides `+`, `*`, `.reshape` and basic
slicing. Shapes: T tokens in the step, C hidden, H/Hkv query/KV heads, D head dim, E experts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from twinfer.runtime.batch import StepBatch
from twinfer.runtime.spec import MoESpec

Array = Any  # a torch.Tensor or mx.array; the runtime never looks inside


@dataclass(frozen=True)
class ExpertExtras:
    """The optional weights of an MoE layer, None where the architecture has none (see MoESpec)."""

    router_bias: Array | None = None  # [E] added to the router logits
    score_bias: Array | None = None  # [E] added to sigmoid scores for choosing experts only
    gate_bias: Array | None = None  # [E, I]
    up_bias: Array | None = None  # [E, I]
    down_bias: Array | None = None  # [E, C]
    router_input: Array | None = None  # [T, C] the rows the router scores, where they are not x (Gemma 4)
    expert_scale: Array | None = None  # [E] multiplies each chosen expert's routing weight (Gemma 4)


class StepContext(Protocol):
    """Per-step device state a backend builds from a StepBatch; model code passes it through unread."""

    tokens: Array  # [T] int token ids on the device
    images: list[tuple[int, Array]]  # (first row in T, features [n, C]) of each image the step covers


class Ops(Protocol):
    """Array operations over one backend's device, called once per step from one thread (OpsRunner and
    model files). No method waits for the device except `to_host`."""

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

    def layer_norm(self, x: Array, w: Array, b: Array, eps: float) -> Array:
        """LayerNorm over the last axis, in float32: (x - mean) / sqrt(var + eps) * w + b."""
        ...

    def add_rms_norm(self, x: Array, delta: Array, w: Array, eps: float) -> tuple[Array, Array]:
        """(x + delta, rms_norm(x + delta, w, eps)): a residual add and the next block's pre-norm,
        which a backend may fuse into one kernel."""
        ...

    def act(self, x: Array, kind: str) -> Array:
        """Elementwise activation: "silu", "gelu_tanh", "gelu" (the exact, erf one) or "sigmoid"."""
        ...

    def softcap(self, x: Array, cap: float) -> Array:
        """cap * tanh(x / cap) (Gemma 2 style logit soft-capping)."""
        ...

    def rope(self, x: Array, ctx: StepContext, layer: int) -> Array:
        """Rotate [T, heads, D] by each token's position (NeoX half-split layout), layer's base.

        Only the first `spec.rotary_dim` dims turn (partial rotary); the rest pass through."""
        ...

    def head_linear(self, x: Array, w: Array) -> Array:
        """Per-head matrices: x [T, H, in] and w [H, out, in] -> [T, H, out] (MLA's absorbed projections)."""
        ...

    def attention(
        self, q: Array, k: Array, v: Array, ctx: StepContext, layer: int, sinks: Array | None = None
    ) -> Array:
        """Store k, v [T, Hkv, D] in layer's KV cache, then attend causally: q [T, H, D] -> [T, H, D].
        k and v None: attend over the cache as earlier layers left it (`ModelSpec.kv_source`). Each query
        sees its sequence's keys up to its position, within the layer's window, and the positions of one
        bidirectional image (`ChunkImage`) see each other both ways; `sinks` [H] join every softmax's
        denominator (gpt-oss)."""
        ...

    def encoder_attention(self, q: Array, k: Array, v: Array, scale: float) -> Array:
        """Every query attends to every key, with no cache and no mask (a vision encoder's layers):
        q, k, v [T, H, D] -> [T, H, D]."""
        ...

    def latent_attention(
        self, q: Array, q_rope: Array, latent: Array, k_rope: Array, ctx: StepContext, layer: int,
        selection: int | None = None,
    ) -> Array:
        """Multi-head latent attention (MLA) over one cached [latent, k_rope] per token: q [T, H, R]
        absorbed, q_rope [T, H, P]; scores q . latent + q_rope . k_rope, values the latents -> [T, H, R].
        `selection`: attend only to the tokens `indexer_topk` chose at that layer this step."""
        ...

    def indexer_topk(self, q: Array, k: Array, weights: Array, ctx: StepContext, layer: int, top_k: int) -> None:
        """DeepSeek sparse attention's lightning indexer: cache k [T, D] beside the latents, then keep for
        each query its `top_k` tokens by sum_h weights * relu(q . k), for `latent_attention`'s `selection`."""
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
        extras: ExpertExtras | None = None,
    ) -> Array:
        """Routed experts: x [T, C]; router [E, C]; gate/up [E, I, C]; down [E, C, I] -> [T, C].

        Routing follows `moe` (see MoESpec); `extras` holds the biases an architecture adds."""
        ...

    def causal_conv1d(self, x: Array, w: Array, ctx: StepContext, layer: int) -> Array:
        """Depthwise causal convolution over each sequence's tokens: x [T, Ch], w [Ch, K] -> [T, Ch].

        Output t is sum_j w[:, j] * input[t - K + 1 + j], reading before the chunk from the layer's conv
        state of the sequence (its last K - 1 inputs; zeros at position 0), which the step then updates."""
        ...

    def gated_delta(
        self, q: Array, k: Array, v: Array, a: Array, b: Array, decay: Array, dt_bias: Array, ctx: StepContext,
        layer: int,
    ) -> Array:
        """The gated delta rule over each sequence's tokens with the layer's float32 state S [Hv, Dk, Dv]:
        q, k [T, Hk, Dk], v [T, Hv, Dv], a, b [T, Hv] -> [T, Hv, Dv] (the recurrence: docs/models.md,
        "Qwen3-Next")."""
        ...

    def release_state(self, seq_id: int) -> None:
        """Free the recurrent state of a sequence (a no-op for a model without LINEAR layers)."""
        ...

    def select_rows(self, x: Array, ctx: StepContext) -> Array:
        """The rows of x [T, C] whose logits the batch asked for, in batch order."""
        ...

    def to_host(self, x: Array) -> Any:
        """Copy to a numpy float32 array; the one place a step waits for the device."""
        ...


def selected(step_cache: dict[Any, Any], layer: int, selection: int) -> Any:
    """For backends: the token choice `indexer_topk` kept in a step's cache at layer `selection`."""
    if ("selection", selection) not in step_cache:
        raise ValueError(f"layer {layer} attends to the tokens layer {selection}'s indexer chose, which this "
                         "process did not run this step (a pipeline stage boundary between the two layers)")
    return step_cache[("selection", selection)]
