"""The memory model: what one device holds under a strategy (weights shard, a vision encoder whole, KV
for the sequences in flight and their images, workspace, overhead), and what is left for the KV cache.
Only batch-1 plans stream experts."""

from __future__ import annotations

import math
from dataclasses import dataclass

from twinfer.planners.cost import Strategy, kv_shard
from twinfer.planners.hardware import APPLE, CPU, Cluster
from twinfer.planners.model import ModelProfile

# a local run's interpreter, libraries and allocator slack (twinfer's session before a model opens: ~0.1 GB)
LOCAL_OVERHEAD = 0.15e9
RUNTIME_OVERHEAD = {"llamacpp": 0.3e9, "torch": 1.0e9, "mlx": 0.3e9}  # CUDA context, graphs, allocator slack
# Runners whose cache keeps sliding-window layers at full length (llama.cpp's `swa_full`; torch and MLX
# page every layer through the same block tables).
FULL_LENGTH_KV = frozenset({"llamacpp", "torch", "mlx"})
LLAMACPP_CELLS = 256  # llama.cpp allocates its KV cache in multiples of this many cells


@dataclass(frozen=True)
class Memory:
    """Bytes per device, except `weights_bytes` (one full copy of the model) and the `*_total` views."""

    weights_bytes: float
    resident_weights: float
    streamed_weights: float
    kv_bytes_per_token: float
    kv: float
    activations: float
    overhead: float
    capacity: float
    devices: int
    vision_weights: float = 0.0  # the vision encoder and projector, whole on every device
    image_kv: float = 0.0  # KV of the sequences' image tokens (beside `kv`, their text)

    @property
    def used(self) -> float:
        return self.resident_weights + self.vision_weights + self.kv + self.image_kv + self.activations + self.overhead

    @property
    def fits(self) -> bool:
        return self.used <= self.capacity

    @property
    def total_bytes(self) -> float:
        return self.used * self.devices

    @property
    def capacity_bytes(self) -> float:
        return self.capacity * self.devices


def activation_bytes(profile: ModelProfile, s: Strategy, concurrency: int, cells: int = 0) -> float:
    """Workspace of one prefill chunk plus the logits of a decode batch (fp32); on llama.cpp its compute
    buffer over `cells` KV cells and its fixed costs (`llamacpp_compute_bytes`)."""
    spec = profile.spec
    chunk = 512 if s.engine == "llamacpp" else 2048
    inter = spec.intermediate_size if profile.count("mlp") else 0
    if spec.moe:
        inter = max(inter, spec.moe.top_k * spec.moe.expert_intermediate_size)
    if s.engine == "llamacpp":
        return llamacpp_compute_bytes(profile, inter, cells) + max(1, concurrency) * spec.vocab_size * 4
    per_token = (12 * spec.hidden_size + 3 * inter / s.tp + 3 * spec.q_size / s.tp) * 2
    return chunk * per_token + max(1, concurrency) * spec.vocab_size * 4


LLAMACPP_UBATCH = 512
LLAMACPP_FIXED = 10e6  # llama.cpp's context, thread pool, kernels' code pages, huge-page rounding: 9-11 MB measured


def llamacpp_compute_bytes(profile: ModelProfile, inter: float, cells: int) -> float:
    """llama.cpp's CPU compute buffer for one 512-token ubatch (flash attention) plus `LLAMACPP_FIXED`: about
    11 bytes a hidden unit and 4.9 an FFN (top-k experts') unit per token, and per KV cell the mask and
    per-head scratch (2 + 0.43 bytes a query head); fit to the buffers llama.cpp reported for Qwen3-MoE at
    hidden 256 and 1,024 and gpt-oss at 2,880, within 10% of each (docs/benchmarks.md)."""
    spec = profile.spec
    per_token = 11.0 * spec.hidden_size + 4.9 * inter
    return LLAMACPP_UBATCH * (per_token + cells * (2 + 0.43 * spec.num_heads)) + LLAMACPP_FIXED


def kv_alloc_per_token(profile: ModelProfile, s: Strategy, context: int) -> float:
    """KV bytes the runner allocates per token of `context` (what a decode step reads may be less)."""
    window_context = None if s.engine in FULL_LENGTH_KV else context
    return profile.spec.kv_bytes_per_token(s.kv.bits_at(profile.spec.head_dim) / 8, window_context)


def memory_for(profile: ModelProfile, cluster: Cluster, s: Strategy, concurrency: int, context: int) -> Memory:
    """Per-device memory of `concurrency` sequences at `context` tokens under strategy `s`."""
    weights = profile.weight_bytes(s.mix)
    routed = profile.expert_bytes(s.mix) * profile.moe_layers * (profile.moe.num_experts if profile.moe else 0)
    streamed = routed * s.stream_fraction
    shard = s.tp * s.pp
    resident = (weights - streamed) / shard
    seqs = math.ceil(max(1, concurrency) / s.dp)
    kv_tok = kv_alloc_per_token(profile, s, context)
    state = profile.spec.state_bytes_per_seq()  # linear-attention layers: a fixed state per sequence, not per token
    cells = _cells(s, context)
    kv = seqs * (kv_tok * cells + state) / kv_shard(profile, s)
    image_kv = seqs * kv_tok * (_cells(s, context + profile.image_tokens) - cells) / kv_shard(profile, s)
    dev = cluster.device
    overhead = LOCAL_OVERHEAD if dev.kind in (APPLE, CPU) else RUNTIME_OVERHEAD.get(s.engine, 1.0e9)
    return Memory(
        weights_bytes=weights, resident_weights=resident, streamed_weights=streamed, kv_bytes_per_token=kv_tok,
        kv=kv, activations=activation_bytes(profile, s, seqs, cells), overhead=overhead,
        capacity=cluster.capacity_per_device, devices=s.dp * shard,
        vision_weights=profile.vision_bytes(s.mix, s.engine), image_kv=image_kv,
    )


def _cells(s: Strategy, tokens: int) -> int:
    """KV cells a sequence of `tokens` takes: llama.cpp allocates whole multiples of LLAMACPP_CELLS."""
    return -(-tokens // LLAMACPP_CELLS) * LLAMACPP_CELLS if s.engine == "llamacpp" else tokens


def max_concurrency(profile: ModelProfile, cluster: Cluster, s: Strategy, context: int) -> int:
    """Most sequences of `context` tokens that fit next to the weights (0 if not even one)."""
    one = memory_for(profile, cluster, s, 1, context)
    if not one.fits:
        return 0
    per_seq = one.kv + one.image_kv + profile.spec.vocab_size * 4  # KV shard plus a row of logits, per device
    n = s.dp * (1 + int((one.capacity - one.used) // per_seq))
    while n > 1 and not memory_for(profile, cluster, s, n, context).fits:
        n = max(1, min(n - 1, int(n * 0.98)))
    return n


def max_context(profile: ModelProfile, cluster: Cluster, s: Strategy, concurrency: int) -> int:
    """Longest context (up to the model's limit) at which `concurrency` sequences fit."""
    hi = profile.spec.max_position - profile.image_tokens
    if memory_for(profile, cluster, s, concurrency, hi).fits:
        return hi
    lo = 0
    while hi - lo > 16:
        mid = (lo + hi) // 2
        if memory_for(profile, cluster, s, concurrency, mid).fits:
            lo = mid
        else:
            hi = mid
    return lo
