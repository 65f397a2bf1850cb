"""ModelSpec: the architecture of a model as plain numbers, from the loaders, for model files and the
planner; no weights, nothing heavy imported."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from twinfer.runtime.errors import ModelError

FULL = "full_attention"
SLIDING = "sliding_attention"
LINEAR = "linear_attention"  # a recurrent token mixer (gated delta rule): state per sequence, no KV


@dataclass(frozen=True)
class MLASpec:
    """DeepSeek-style multi-head latent attention: K and V are cached as one compressed latent."""

    kv_lora_rank: int
    q_lora_rank: int | None
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class LinearAttnSpec:
    """Gated DeltaNet layers (Qwen3-Next, Qwen3.5): a causal depthwise conv, then the gated delta rule; the
    per-sequence state has a fixed size and only moves forward."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads or self.conv_kernel < 1:
            raise ModelError(f"linear attention: {self.num_v_heads} value heads must be a multiple of "
                             f"{self.num_k_heads} key heads, and the conv kernel at least 1")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    def state_bytes(self, bytes_per_element: float = 2.0) -> float:
        """One layer's state for one sequence: the conv's last K-1 inputs, and the fp32 delta state."""
        conv = (self.conv_kernel - 1) * self.conv_dim * bytes_per_element
        return conv + 4.0 * self.num_v_heads * self.head_k_dim * self.head_v_dim


@dataclass(frozen=True)
class DSASpec:
    """DeepSeek sparse attention (DeepSeek-V3.2, GLM-5) over MLA: an indexer scores visible tokens and
    attention reads the `top_k` best; layers outside `indexers` reuse the last indexer's choice."""

    n_heads: int
    head_dim: int
    top_k: int
    indexers: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        if self.indexers and not self.indexers[0]:
            raise ModelError("sparse attention: layer 0 must run its own indexer (a shared layer reuses an earlier one's)")

    def has_indexer(self, layer: int) -> bool:
        return not self.indexers or self.indexers[layer]

    def source(self, layer: int) -> int:
        """The layer whose selection `layer` attends through: itself, or the last indexer before it."""
        return max(i for i in range(layer + 1) if self.has_indexer(i))


SOFTMAX = "softmax"
SIGMOID = "sigmoid"


@dataclass(frozen=True)
class MoESpec:
    """Mixture-of-experts feed-forward: `num_experts` routed experts, `top_k` per token. `scoring` is
    "softmax" or "sigmoid" (with `score_bias` and group-limited top-k); chosen scores are renormalized
    when `norm_topk_prob` and scaled by `routed_scaling_factor`."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool = True  # renormalize the top-k router weights to sum to 1
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0
    first_dense_layers: int = 0  # leading layers with a dense MLP instead of experts
    router_softmax_before_topk: bool = True  # softmax over all experts, then top-k (Qwen3, Mixtral*)
    scoring: str = SOFTMAX
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    score_bias: bool = False  # e_score_correction_bias: added to the scores for choosing only
    router_bias: bool = False  # a bias on the router's logits (gpt-oss)
    expert_bias: bool = False  # biases on every expert's gate, up and down projections (gpt-oss)
    swiglu_limit: float | None = None  # gpt-oss's clamped SwiGLU: gate <= limit, |up| <= limit,
    swiglu_alpha: float = 1.702  # then gate * sigmoid(alpha * gate) * (up + 1)

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ModelError(f"top_k={self.top_k} must be between 1 and num_experts={self.num_experts}")
        if self.scoring not in (SOFTMAX, SIGMOID):
            raise ModelError(f"router scoring {self.scoring!r} is not one of {SOFTMAX!r}, {SIGMOID!r}")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ModelError(
                f"{self.num_experts} experts in n_group={self.n_group} groups, keeping topk_group="
                f"{self.topk_group}: the groups must divide the experts and keep 1..n_group of them"
            )


@dataclass(frozen=True)
class ModelSpec:
    """One decoder-only transformer, described by the numbers every consumer needs; `model_type` (the
    Hugging Face name) picks the model file in `twinfer/runtime/models/`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    name: str = ""
    max_position: int = 8192
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_local_theta: float | None = None  # sliding-window layers' rope base, when it differs
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # frozen items of HF's rope_scaling
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # FULL or SLIDING per layer; empty means all FULL
    hidden_act: str = "silu"  # "silu" or "gelu_tanh"
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    embed_scale: bool = False  # Gemma multiplies embeddings by sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5 (default head_dim)
    softmax_scale: float | None = None  # the attention scale itself, when a config fixes it (YaRN's mscale)
    partial_rotary_factor: float = 1.0  # rope rotates the first head_dim * this dims of each head
    attention_sinks: bool = False  # a learned per-head logit in every softmax's denominator (gpt-oss)
    final_logit_softcap: float | None = None
    global_head_dim: int | None = None  # the FULL layers' head size, where it differs from head_dim (Gemma 4)
    global_kv_heads: int | None = None  # the FULL layers' KV heads, where they differ from num_kv_heads
    kv_shared_layers: int = 0  # the last N layers attend over the KV of the last earlier layer of their type
    moe: MoESpec | None = None
    mla: MLASpec | None = None
    dsa: DSASpec | None = None  # sparse attention's indexer over the MLA latents
    linear_attn: LinearAttnSpec | None = None  # the LINEAR layers' shape
    extra: tuple[tuple[str, Any], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ModelError(f"model spec: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelError(
                f"model spec: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ModelError(f"model spec: {len(self.layer_types)} layer types for {self.num_layers} layers")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ModelError("model spec: sliding-window layers need a sliding_window size")
        if self.global_kv_heads and self.num_heads % self.global_kv_heads:
            raise ModelError(f"model spec: num_heads={self.num_heads} is not a multiple of "
                             f"global_kv_heads={self.global_kv_heads}")
        if self.kv_shared_layers:
            self._check_kv_sharing()
        if LINEAR in self.layer_types and self.linear_attn is None:
            raise ModelError("model spec: linear-attention layers need their linear_attn shape")

    @property
    def attention_types(self) -> tuple[str, ...]:
        return self.layer_types or (FULL,) * self.num_layers

    @property
    def attention_scale(self) -> float:
        if self.softmax_scale is not None:
            return self.softmax_scale
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that rope rotates: MLA's rope part, else head_dim * partial_rotary_factor."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def recurrent(self) -> bool:
        """Whether some layers keep a recurrent state per sequence (see LinearAttnSpec)."""
        return LINEAR in self.layer_types

    def state_bytes_per_seq(self, bytes_per_element: float = 2.0) -> float:
        """Recurrent-state bytes one sequence holds, whatever its length (0 without LINEAR layers)."""
        if self.linear_attn is None:
            return 0.0
        return self.attention_types.count(LINEAR) * self.linear_attn.state_bytes(bytes_per_element)

    def head_dim_for(self, layer: int) -> int:
        """Head size of `layer`: global_head_dim on FULL layers where set, else head_dim."""
        return self.global_head_dim if self.global_head_dim and self.attention_types[layer] == FULL else self.head_dim

    def kv_heads_for(self, layer: int) -> int:
        """KV heads of `layer`: global_kv_heads on FULL layers where set, else num_kv_heads."""
        return self.global_kv_heads if self.global_kv_heads and self.attention_types[layer] == FULL else self.num_kv_heads

    def kv_source(self, layer: int) -> int:
        """The layer whose KV `layer` attends over: itself, or (shared-KV layers) the last earlier one of its type."""
        first = self.num_layers - self.kv_shared_layers
        if layer < first:
            return layer
        kind = self.attention_types[layer]
        return max(j for j in range(first) if self.attention_types[j] == kind)

    def owns_kv(self, layer: int) -> bool:
        """Whether `layer` stores KV of its own (a layer sharing an earlier one's allocates none)."""
        return layer < self.num_layers - self.kv_shared_layers

    def _check_kv_sharing(self) -> None:
        first = self.num_layers - self.kv_shared_layers
        owners = set(self.attention_types[:first])
        missing = set(self.attention_types[first:]) - owners
        if first <= 0 or missing:
            raise ModelError(f"model spec: kv_shared_layers={self.kv_shared_layers} leaves no earlier layer of "
                             f"type {sorted(missing) or self.attention_types[0]!r} to share KV from")

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer >= self.moe.first_dense_layers

    def window(self, layer: int) -> int | None:
        """Sliding window of `layer` in tokens, or None for full attention."""
        return self.sliding_window if self.attention_types[layer] == SLIDING else None

    def rope_base(self, layer: int) -> float:
        if self.attention_types[layer] == SLIDING and self.rope_local_theta:
            return self.rope_local_theta
        return self.rope_theta

    def rope_scaling_for(self, layer: int) -> dict[str, Any] | None:
        # Gemma 3 scales only its global layers' rope; local layers keep the plain base.
        if self.rope_scaling is None or (self.rope_local_theta and self.attention_types[layer] == SLIDING):
            return None
        return dict(self.rope_scaling)

    def kv_bytes_per_token(self, bytes_per_element: float = 2.0, context: int | None = None) -> float:
        """KV-cache bytes per token of context, averaged over `context` for sliding layers: MLA's latent,
        windowed layers at `min(1, window / context)`, shared-KV layers free, FULL layers by their heads."""
        total = 0.0
        for layer in range(self.num_layers):
            if not self.owns_kv(layer):
                continue
            if self.mla is not None:
                per_layer = float(self.mla.kv_lora_rank + self.mla.qk_rope_head_dim)
            else:
                per_layer = 2.0 * self.kv_heads_for(layer) * self.head_dim_for(layer)
            if self.attention_types[layer] == LINEAR:
                continue  # a recurrent layer holds no KV: its state is per sequence (state_bytes_per_seq)
            window = self.window(layer)
            share = 1.0 if window is None or context is None else min(1.0, window / max(context, 1))
            total += per_layer * share
        if self.dsa is not None:  # the indexer's key beside the latent, in each layer that runs one
            total += self.dsa.head_dim * sum(map(self.dsa.has_indexer, range(self.num_layers)))
        return total * bytes_per_element

    def with_(self, **changes: Any) -> ModelSpec:
        return replace(self, **changes)
