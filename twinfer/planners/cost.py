"""The cost model: seconds per decode step and per prefill, from bytes, FLOPs, dequantization and links
(the formula: docs/planner-accuracy.md, "The cost model and its calibration")."""

from __future__ import annotations

import math
from dataclasses import dataclass

from twinfer.planners.calibration import Calibration, Efficiency
from twinfer.planners.formats import COMPONENTS, FORMATS, KVFormat, Mix
from twinfer.planners.hardware import CPU, Cluster, Device
from twinfer.planners.model import ModelProfile
from twinfer.runtime.cpu import huge_pages_fit


@dataclass(frozen=True)
class Strategy:
    """One way to run a model: formats, runner, parallel layout, expert streaming, pruning."""

    mix: Mix
    kv: KVFormat
    engine: str
    tp: int = 1
    ep: int = 1
    pp: int = 1
    dp: int = 1
    stream_fraction: float = 0.0  # share of routed-expert bytes not resident, read from slower memory
    prune: float = 0.0  # share of routed experts (MoE) or layers (dense) removed

    @property
    def devices_per_replica(self) -> int:
        return self.tp * self.pp

    def label(self) -> str:
        parts = [self.mix.label or self.mix.name, f"KV {self.kv.label}", self.engine]
        if self.devices_per_replica > 1 or self.dp > 1:
            parts.append(f"TP{self.tp}" + (f" EP{self.ep}" if self.ep > 1 else "") + (f" PP{self.pp}" if self.pp > 1 else "")
                         + (f" x{self.dp} replicas" if self.dp > 1 else ""))
        if self.stream_fraction > 0:
            parts.append(f"stream {self.stream_fraction:.0%} of experts")
        if self.prune > 0:
            parts.append(f"pruned {self.prune:.0%}")
        return ", ".join(parts)


@dataclass(frozen=True)
class StepTime:
    """One decode step of every sequence in flight; times are per pipeline stage pass unless noted."""

    latency_s: float  # time for each sequence to get its next token
    tokens_per_s: float  # all sequences together
    memory_s: float
    compute_s: float
    dequant_s: float
    fixed_s: float
    comm_s: float
    stream_s: float
    kernel_gbs: float = 0.0  # the CPU kernels' weight-streaming rate when it, not the memory, set memory_s

    @property
    def bound(self) -> str:
        memory = "kernel streaming" if self.kernel_gbs else "memory bandwidth"
        parts = {memory: self.memory_s, "compute": self.compute_s, "dequantization": self.dequant_s,
                 "per-layer overhead": self.fixed_s, "interconnect": self.comm_s, "expert streaming": self.stream_s}
        return max(parts, key=lambda k: parts[k])


def _native(device: Device, fmt_name: str) -> bool:
    f = FORMATS[fmt_name]
    if device.kind == CPU:  # no matrix units: only float weights skip an unpacking loop
        return f.family == "float" and f.compute in device.natives
    # weight-only integer formats (W8A16, W4A16) always expand to the activations' dtype first
    return f.family not in ("gguf", "turboquant", "int") and f.compute in device.natives


def kv_native(device: Device, kv: KVFormat) -> bool:
    return kv.family == "float" and kv.compute in device.natives


def _compute_peak(dev: Device, dtype: str) -> float:
    """FLOP/s the matmuls of weights in `dtype` run at: a CPU's int8 dot products for integer formats, f32
    FMAs otherwise; a GPU's tensor peak for a native format, else the activations'."""
    if dev.kind == CPU:
        integer = FORMATS[dtype].family in ("gguf", "int") and "int8" in dev.natives
        return dev.tflops("int8" if integer else "f32") * 1e12
    return dev.tflops(FORMATS[dtype].compute if _native(dev, dtype) else _activation_dtype(dev)) * 1e12


def _unpack_rate(dev: Device, engine: str) -> float:
    """Ops/s of unpacking quantized weights: the int8 rate for llama.cpp on a CPU (it unpacks inside its
    integer dot products), the f32 vector rate elsewhere."""
    if dev.kind == CPU and engine == "llamacpp" and "int8" in dev.natives:
        return dev.tflops("int8") * 1e12
    return dev.vector_tflops * 1e12


def _activation_dtype(device: Device) -> str:
    return "bf16" if "bf16" in device.natives else "f16"


def kv_shard(profile: ModelProfile, s: Strategy) -> int:
    """How many ways a replica's KV cache is split: heads over TP (MLA's latent is replicated), layers over PP."""
    heads = 1 if profile.spec.mla is not None else min(s.tp, profile.spec.num_kv_heads)
    return heads * s.pp


def kv_bytes_per_seq(profile: ModelProfile, kv: KVFormat, context: int) -> float:
    """KV bytes one sequence holds at `context` tokens (sliding-window layers hold at most the window)."""
    return profile.spec.kv_bytes_per_token(kv.bits_at(profile.spec.head_dim) / 8, context) * context


def _ep_max_load(touched: float, ep: int) -> float:
    """Experts the busiest of `ep` devices serves when `touched` experts spread at random."""
    mean = touched / ep
    return min(touched, mean + math.sqrt(2 * max(mean, 1e-9) * math.log(ep)))


def _step_share(profile: ModelProfile, comp: str, touched: float) -> float:
    """The share of a component's weights one decode step reads (routed experts: `touched` of E)."""
    if comp == "embed":
        return 1.0 if profile.tied else 0.0
    if comp in ("experts", "experts_down") and profile.moe:
        return touched / profile.moe.num_experts
    return 1.0


def _dequant_elems(profile: ModelProfile, device: Device, mix: Mix, touched: float) -> tuple[float, float]:
    """(weights that need a dequantization loop, their ops per weight) read in one step."""
    elems, ops = 0.0, 0.0
    for comp in COMPONENTS:
        if comp in ("norm", "router"):
            continue
        n = profile.count(comp) * _step_share(profile, comp, touched)
        for fname, share in profile.split(mix, comp):
            if not _native(device, fname):
                elems += n * share
                ops += n * share * FORMATS[fname].dequant_ops
    return elems, (ops / elems if elems else 0.0)


def _kernel_stream_s(profile: ModelProfile, dev: Device, eff: Efficiency, mix: Mix, touched: float) -> float:
    """Seconds a CPU's matmul kernels take to stream one decode step's weights, one row: `stream_repacked`
    bytes a cycle a core for formats llama.cpp repacks, `stream_plain` for the rest. Where DRAM outruns
    the kernels this, not bandwidth, sets decode (docs/planner-accuracy.md, "Kernels, not DRAM")."""
    if dev.kind != CPU or not dev.cores or not eff.stream_plain:
        return 0.0
    plain = repacked = 0.0
    for comp in COMPONENTS:
        read = profile.bytes_of(mix, comp) * _step_share(profile, comp, touched)
        parts = [(f, w * FORMATS[f].bits) for f, w in profile.split(mix, comp)]  # each format's share of the bytes
        total = sum(w for _, w in parts) or 1.0
        for fname, weight in parts:
            if fname in dev.repacks:
                repacked += read * weight / total
            else:
                plain += read * weight / total
    cycles = plain / eff.stream_plain + repacked / (eff.stream_repacked or eff.stream_plain)
    return cycles / (dev.cores * dev.clock_ghz * 1e9)


def on_huge_pages(profile: ModelProfile, dev: Device, mix: Mix) -> bool:
    """Whether the llama.cpp runner puts these weights on huge pages (the kernel's mode, `huge_pages_fit`)."""
    return dev.kind == CPU and dev.huge_pages and huge_pages_fit(profile.weight_bytes(mix), dev.memory_gb * 1e9)


def _fixed_cycles(profile: ModelProfile, eff: Efficiency, layers: float) -> float:
    moe_share = profile.moe_layers / profile.spec.num_layers
    return layers * eff.layer_cycles * (1 + moe_share * (eff.moe_layer_factor - 1))


def decode_step(profile: ModelProfile, cluster: Cluster, s: Strategy, batch: int, context: int,
                cal: Calibration) -> StepTime:
    """Time for every one of `batch` sequences (at `context` cached tokens) to decode one token."""
    dev = cluster.device
    eff = cal.get(s.engine, dev)
    b = max(1, math.ceil(batch / s.dp))
    micro = min(b, s.pp)
    mb = b / micro  # sequences per microbatch
    shard = s.tp * s.pp
    touched = profile.touched_experts(mb)
    dense = profile.step_bytes(s.mix, 0.0) / shard
    expert_layer = profile.expert_bytes(s.mix) * profile.moe_layers / s.pp
    share = _ep_max_load(touched, s.ep) if s.ep > 1 else touched / s.tp  # experts' bytes on the busiest device
    experts = share * expert_layer
    streamed = experts * s.stream_fraction
    kv = mb * kv_bytes_per_seq(profile, s.kv, context) / kv_shard(profile, s)
    bw = dev.bandwidth_gbs * 1e9 * eff.bandwidth * (eff.dual_die if dev.dies > 1 else 1.0)
    # weights stream at the slower of memory and the kernels reading them; both faster on huge pages
    huge = eff.huge_pages if on_huge_pages(profile, dev, s.mix) else 1.0
    dram_s = (dense + experts - streamed) / bw / huge
    kernel_s = _kernel_stream_s(profile, dev, eff, s.mix, touched) / shard / huge
    memory_s = max(dram_s, kernel_s) + kv / bw
    kernel_gbs = (dense + experts) / kernel_s / 1e9 if kernel_s > dram_s else 0.0

    attention = mb * profile.attention_flops_per_token(context) / shard
    # llama.cpp on a CPU attends in a separate op on its one-row f32 path, after the matmuls, not inside them
    row_path = dev.kind == CPU and s.engine == "llamacpp"
    attention_s = cpu_attention_s(dev, eff, attention, tiled=False) if row_path else 0.0
    flops = mb * 2 * profile.active_params / shard + (0.0 if row_path else attention)
    dtype = s.mix.split("mlp")[0][0] if profile.count("mlp") else s.mix.default
    peak = _compute_peak(dev, dtype)
    compute_s = flops / (peak * eff.tensor)
    elems, ops = _dequant_elems(profile, dev, s.mix, touched)
    passes = math.ceil(mb / (4 if dev.kind == CPU else 32))  # weights expanded once per tile of tokens
    kv_ops = 0.0 if kv_native(dev, s.kv) else kv * 8 / s.kv.bits_at(profile.spec.head_dim) * s.kv.dequant_ops
    dequant_s = (elems / shard * ops * passes / _unpack_rate(dev, s.engine) + kv_ops / (dev.vector_tflops * 1e12)
                 ) / eff.vector
    alu = compute_s + dequant_s
    kernel_s = max(memory_s, alu) + eff.overlap_loss * min(memory_s, alu) + attention_s

    layers = profile.spec.num_layers / s.pp
    fixed_s = _fixed_cycles(profile, eff, layers) / (dev.clock_ghz * 1e9)
    comm_s = 0.0
    if s.tp > 1:
        per_dir = dev.interconnect_gbs / 2 * 1e9
        size = mb * profile.spec.hidden_size * 2
        comm_s = 2 * layers * (eff.collective_s + 2 * (s.tp - 1) / s.tp * size / per_dir)
    stream_s = streamed / (dev.stream_gbs * 1e9) if streamed else 0.0
    stage_s = kernel_s + fixed_s + comm_s + stream_s
    hop_s = eff.hop_s + mb * profile.spec.hidden_size * 2 / (cluster.scale_out_gbs * 1e9)
    latency = s.pp * stage_s + (s.pp - 1) * hop_s + eff.step_s
    return StepTime(
        latency_s=latency, tokens_per_s=batch / latency, memory_s=memory_s, compute_s=compute_s + attention_s,
        dequant_s=dequant_s, fixed_s=fixed_s + eff.step_s, comm_s=comm_s, stream_s=stream_s, kernel_gbs=kernel_gbs,
    )


# llama.cpp's CPU flash attention (ggml-cpu/ops.cpp) computes 64x64 tiles whole, skipping masked ones
CPU_ATTENTION_TILE = 64
# its one-row path multiplies one K/V row at a time, at about half the tiled FMA rate
CPU_ROW_PATH_SLOWDOWN = 2.0


def cpu_attention_s(dev: Device, eff: Efficiency, flops: float, tiled: bool) -> float:
    """Seconds of `flops` of attention on llama.cpp's CPU flash attention: a fitted share `attention` of
    the f32 peak when tiled, half that on the one-row path."""
    return flops / (dev.tflops("f32") * 1e12 * eff.attention) * (1.0 if tiled else CPU_ROW_PATH_SLOWDOWN)


def attended_pairs(tokens: int, window: int | None, tile: int = 1) -> float:
    """(query, key) pairs one head computes over a causal prompt when whole `tile` x `tile` blocks run
    and only fully masked ones are skipped (`window`: sliding)."""
    n = math.ceil(tokens / tile)  # query tiles; query tile i needs key tiles i - m .. i
    m = math.ceil((window - 1) / tile) if window else n
    tiles = n * (n + 1) / 2 if n <= m + 1 else (m + 1) * (m + 2) / 2 + (n - m - 1) * (m + 1)
    return tiles * tile * tile


def prefill_attention_s(profile: ModelProfile, dev: Device, s: Strategy, tokens: int, eff: Efficiency) -> float:
    """Seconds of QK^T and PV over one prompt, on one device of a replica: a GPU's tensor peak; a CPU's
    f32 FMAs at share `attention`, a quantized cache on the one-row path that re-expands K/V rows."""
    spec = profile.spec
    per_head = (2 * spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim) if spec.mla else 2 * spec.head_dim
    quantized = s.kv.family == "gguf"
    cpu = dev.kind == CPU
    tile = CPU_ATTENTION_TILE if cpu and s.engine == "llamacpp" and not quantized and tokens >= CPU_ATTENTION_TILE else 1
    pairs = spec.num_heads * sum(attended_pairs(tokens, spec.window(layer), tile) for layer in range(spec.num_layers))
    flops = 2.0 * per_head * pairs / (s.tp * s.pp)
    if not cpu:
        dtype = s.mix.split("mlp")[0][0] if profile.count("mlp") else s.mix.default
        return flops / (_compute_peak(dev, dtype) * eff.tensor)
    seconds = cpu_attention_s(dev, eff, flops, tiled=tile > 1)
    if quantized:
        expanded = per_head * pairs / (s.tp * s.pp)
        seconds += expanded * s.kv.dequant_ops / (dev.vector_tflops * 1e12 * eff.vector)
    return seconds


def prefill_time(profile: ModelProfile, cluster: Cluster, s: Strategy, tokens: int, cal: Calibration) -> float:
    """Seconds to process one prompt of `tokens` tokens (time to first token, without queueing)."""
    dev = cluster.device
    eff = cal.get(s.engine, dev)
    tokens = max(1, tokens)
    shard = s.tp * s.pp
    spec = profile.spec
    dtype = s.mix.split("mlp")[0][0] if profile.count("mlp") else s.mix.default
    compute_s = 2 * tokens * profile.active_params / shard / (_compute_peak(dev, dtype) * eff.tensor)
    compute_s += prefill_attention_s(profile, dev, s, tokens, eff)
    touched = profile.touched_experts(tokens)
    weights = profile.step_bytes(s.mix, touched) / shard
    memory_s = weights / (dev.bandwidth_gbs * 1e9 * eff.bandwidth)
    elems, ops = _dequant_elems(profile, dev, s.mix, touched)
    tile = 16 if dev.kind == CPU else 64
    dequant_s = elems / shard * ops * math.ceil(tokens / tile) / (_unpack_rate(dev, s.engine) * eff.vector)
    chunk = 512 if s.engine == "llamacpp" else 2048
    chunks = math.ceil(tokens / chunk)
    fixed_s = chunks * _fixed_cycles(profile, eff, spec.num_layers) / (dev.clock_ghz * 1e9)
    comm_s = 0.0
    if s.tp > 1:
        size = tokens * spec.hidden_size * 2
        comm_s = 2 * spec.num_layers * (chunks * eff.collective_s
                                        + 2 * (s.tp - 1) / s.tp * size / (dev.interconnect_gbs / 2 * 1e9))
    hops = (s.pp - 1) * (eff.hop_s + tokens * spec.hidden_size * 2 / (cluster.scale_out_gbs * 1e9))
    alu = compute_s + dequant_s
    return max(alu, memory_s) + eff.overlap_loss * min(alu, memory_s) + fixed_s + comm_s + hops
