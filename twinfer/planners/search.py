"""Strategy search: enumerate the ways to run a model on a cluster, price each, keep the fastest that fits.
Fidelity first, in passes: good formats without pruning, then lossier ones, pruning last. A datacenter
target considers only native formats and never falls back to dequantizing ones. Within a pass the
fastest plan wins after a KL discount (`score`); a format the user names is honoured wherever a runner
runs it (docs/architecture.md, "The planner's cost model")."""

from __future__ import annotations

import math
from dataclasses import dataclass

from twinfer.planners.calibration import Calibration
from twinfer.planners.cost import StepTime, Strategy, _native, decode_step, kv_native, prefill_time
from twinfer.planners.executable import refusal
from twinfer.planners.formats import (
    EMBED_TYPES,
    FORMATS,
    GOOD,
    KV_FORMATS,
    MIXES,
    VERY_LOSSY,
    KVFormat,
    Mix,
    kv_format,
    mix,
    with_embed,
)
from twinfer.planners.hardware import APPLE, CPU, GPU, Cluster
from twinfer.planners.memory import Memory, memory_for
from twinfer.planners.model import ModelProfile, profile_from_spec
from twinfer.runtime.errors import PlanError

LOCAL_MIXES = ("f16", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0", "iq4_xs", "q3_k_m", "q2_k", "tq4", "tq3")
# Requantizing a file also tries these mixes with each EMBED_TYPES embedding/output: one per size class.
LOCAL_EMBED_BASES = ("q8_0", "q4_k_m", "iq4_xs", "q3_k_m")
DATACENTER_MIXES = ("bf16", "fp8", "nvfp4", "mxfp4", "int8", "int4", "tq4", "tq3")
LLAMACPP_KV = ("f16", "q8_0", "q4_0")
TENSOR_KV = ("bf16", "fp8", "nvfp4", "tq4", "tq3")
STREAM_SHARES = (0.25, 0.5, 0.75, 0.9)
PRUNE_SHARES = (0.25, 0.5)


@dataclass(frozen=True)
class Request:
    """What the user asked for."""

    context: int = 4096
    concurrency: int = 1
    weights_format: str = "auto"
    kv_format: str = "auto"

    def __post_init__(self) -> None:
        if self.context < 1:
            raise PlanError(f"--context must be at least 1, got {self.context}")
        if self.concurrency < 1:
            raise PlanError(f"--concurrency must be at least 1, got {self.concurrency}")


@dataclass(frozen=True)
class Candidate:
    strategy: Strategy
    profile: ModelProfile
    memory: Memory
    step: StepTime  # at the requested concurrency
    single: StepTime  # one sequence
    ttft_s: float = 0.0  # a prompt of the request's context, alone

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def tier(self) -> int:
        s = self.strategy
        return max(self.profile.mix_tier(s.mix), s.kv.tier) + (2 if s.prune else 0)

    @property
    def kl(self) -> float:
        s = self.strategy
        return self.profile.mix_kl(s.mix) + s.kv.kl + s.prune

    @property
    def speed(self) -> float:
        return self.step.tokens_per_s

    @property
    def decode_share(self) -> float:
        """The part of a request's time spent decoding: REPLY_TOKENS after a prompt of the context."""
        if self.single.tokens_per_s <= 0:
            return 0.0
        decode_s = REPLY_TOKENS / self.single.tokens_per_s
        return decode_s / (decode_s + self.ttft_s)


def target_of(cluster: Cluster) -> str:
    """`local` when memory is the scarce resource to fit into, `datacenter` for HBM GPUs or several devices."""
    d = cluster.device
    if d.kind in (APPLE, CPU) or (d.memory_type != "hbm" and cluster.world == 1):
        return "local"
    return "datacenter"


def engine_for(m: Mix, cluster: Cluster, target: str) -> str:
    if "llamacpp" in m.engines and (target == "local" or m.family == "gguf"):
        return "llamacpp"
    return "mlx" if cluster.device.kind == APPLE else "torch"


# The GGUF a local runner would load for a checkpoint published in each format (INT4 experts: Q4_0).
LOCAL_EQUIVALENT = {"bf16": "f16", "fp8": "q8_0", "mxfp4-moe": "gguf-mxfp4", "int4-moe": "q4_0"}


def weight_mixes(profile: ModelProfile, target: str, requested: str, requantize: bool = False,
                 half: str = "bf16") -> list[Mix]:
    """Formats worth trying: the published one (or the file as stored), and anything clearly smaller;
    never an upcast (except FP8/BF16 on a datacenter target) nor a same-size requantization unless the
    file does not fit. `half` is the 16-bit float the GPU multiplies natively."""
    if requested not in ("auto", ""):
        if requested in ("stored", "native"):
            return [profile.stored or mix(profile.native)]
        return [as_published(profile, mix(requested))]
    if profile.stored is not None:  # a file runs as stored; requantized smaller only when that cannot fit
        if not requantize:
            return [profile.stored]
        own = profile.weight_bytes(profile.stored)
        names = LOCAL_MIXES if target == "local" else DATACENTER_MIXES
        mixes = [MIXES[n] for n in names]
        if target == "local":
            mixes += [with_embed(MIXES[n], e) for n in LOCAL_EMBED_BASES for e in EMBED_TYPES]
        return [m for m in mixes if profile.weight_bytes(m) < own]
    native = mix(profile.native)
    if target == "local":
        base = MIXES[LOCAL_EQUIVALENT.get(native.name, native.name)]
        own = profile.weight_bytes(base)
        smaller = [MIXES[n] for n in LOCAL_MIXES if n != base.name and profile.weight_bytes(MIXES[n]) < 0.9 * own]
        return [native, base, *smaller] if base is not native else [native, *smaller]
    limit = profile.weight_bytes(native) * 0.9
    smaller = [MIXES[n] for n in DATACENTER_MIXES if n != native.name and profile.weight_bytes(MIXES[n]) < limit]
    # Upcasts for GPUs without the published format natively, kept only where nothing native and smaller fits
    upcasts = [MIXES[n] for n in ("fp8", half) if n != native.name and MIXES[n] not in smaller]
    return [native, *smaller, *upcasts]


def as_published(profile: ModelProfile, asked: Mix) -> Mix:
    """The published mix where `asked` names its main format (`--format mxfp4` on gpt-oss: its experts)."""
    native = MIXES.get(profile.native)
    if native is None or profile.stored is not None or asked.name == native.name:
        return asked
    main = native.split("experts" if profile.moe else "mlp")[0][0]
    return native if asked.default == main and asked.parts and FORMATS[main].family != "float" else asked


def kv_formats(engine: str, requested: str, device_kind: str = "", half: str = "bf16") -> list[KVFormat]:
    """KV formats the engine's runner can hold (CPU torch: f32; a GPU without BF16: f16)."""
    if requested not in ("auto", ""):
        return [kv_format(requested)]
    if engine == "torch" and device_kind == CPU:
        return [KV_FORMATS["f32"]]
    names = LLAMACPP_KV if engine == "llamacpp" else tuple(half if n == "bf16" else n for n in TENSOR_KV)
    return [KV_FORMATS[n] for n in names]


def half_dtype(cluster: Cluster) -> str:
    """The 16-bit float a GPU's matrix units take: BF16 where they have it, else F16 (V100, T4)."""
    natives = cluster.device.natives
    return "f16" if cluster.device.kind == GPU and "bf16" not in natives and "f16" in natives else "bf16"


def layouts(profile: ModelProfile, cluster: Cluster) -> list[tuple[int, int, int, int]]:
    """(tp, ep, pp, dp): TP and EP inside a node, PP only across nodes, data-parallel replicas of the rest."""
    out = []
    g, nodes = cluster.gpus_per_node, cluster.nodes
    tps = [t for t in range(1, g + 1) if g % t == 0 and profile.spec.num_heads % t == 0]
    for pp in sorted({1, nodes}):
        for tp in tps:
            if pp > 1 and tp != tps[-1]:
                continue  # a multi-node replica uses whole nodes per stage
            dp = (g * nodes) // (tp * pp)
            out.append((tp, 1, pp, dp))
            if profile.moe and tp > 1:
                out.append((tp, tp, pp, dp))
    return out


def pruned(profile: ModelProfile, share: float) -> ModelProfile:
    """The model with `share` of its routed experts (MoE) or of its layers (dense) removed."""
    spec = profile.spec
    if spec.moe:
        moe = spec.moe
        keep = max(moe.top_k, round(moe.num_experts * (1 - share)))
        new = spec.with_(moe=type(moe)(**{**moe.__dict__, "num_experts": keep}))
    else:
        layers = max(1, round(spec.num_layers * (1 - share)))
        types = spec.layer_types[:layers] if spec.layer_types else ()
        new = spec.with_(num_layers=layers, layer_types=types)
    out = profile_from_spec(new, name=profile.name, native=profile.native, source=profile.source,
                            vision=profile.vision)
    return out if profile.stored is None else type(out)(**{**out.__dict__, "stored": profile.stored})


def explicit(request: Request) -> bool:
    """Whether the request names a weight format (anything but `auto`)."""
    return request.weights_format not in ("auto", "")


def runnable_mixes(profile: ModelProfile, cluster: Cluster, request: Request, requantize: bool = False) -> list[Mix]:
    """`weight_mixes`, plus the GGUF conversion (`LOCAL_EQUIVALENT`) of a named format no runner holds."""
    target, half = target_of(cluster), half_dtype(cluster)
    mixes = weight_mixes(profile, target, request.weights_format, requantize, half)
    if not explicit(request):
        return mixes
    out = list(mixes)
    for m in mixes:
        eq = LOCAL_EQUIVALENT.get(m.name)
        if eq and MIXES[eq] not in out and mix_refusal(profile, cluster, request, m):
            out.append(MIXES[eq])
    return out


def mix_refusal(profile: ModelProfile, cluster: Cluster, request: Request, m: Mix) -> str:
    """Why the runner for `m` refuses it here with every KV format asked for ("" when one runs)."""
    engine = engine_for(m, cluster, target_of(cluster))
    kvs = kv_formats(engine, request.kv_format, cluster.device.kind, half_dtype(cluster))
    reasons = [refusal(profile, Strategy(m, kv, engine), cluster.device) for kv in kvs]
    return "" if not all(reasons) else reasons[0]


def enumerate_strategies(profile: ModelProfile, cluster: Cluster, request: Request, target: str,
                         prune: bool = False, requantize: bool = False) -> list[tuple[Strategy, ModelProfile]]:
    out: list[tuple[Strategy, ModelProfile]] = []
    moe = profile.moe
    streamable = (target == "local" and moe is not None
                  and profile.touched_experts(request.concurrency) / moe.num_experts < 0.5)
    shares = [0.0] + (list(STREAM_SHARES) if streamable else [])
    prunes = PRUNE_SHARES if prune else (0.0,)
    half = half_dtype(cluster)
    for m in runnable_mixes(profile, cluster, request, requantize):
        engine = engine_for(m, cluster, target)
        for kv in kv_formats(engine, request.kv_format, cluster.device.kind, half):
            for tp, ep, pp, dp in layouts(profile, cluster):
                for share in shares:
                    for p in prunes:
                        prof = pruned(profile, p) if p else profile
                        s = Strategy(m, kv, engine, tp, ep, pp, dp, share, p)
                        if not refusal(profile, s, cluster.device):  # never a plan the runner refuses
                            out.append((s, prof))
    return out


def first_refusal(profile: ModelProfile, cluster: Cluster, request: Request) -> str:
    """Why the runners refuse the formats asked for ("" when some strategy is one they run)."""
    target, half = target_of(cluster), half_dtype(cluster)
    reasons = []
    for m in runnable_mixes(profile, cluster, request):
        engine = engine_for(m, cluster, target)
        for kv in kv_formats(engine, request.kv_format, cluster.device.kind, half):
            why = refusal(profile, Strategy(m, kv, engine), cluster.device)
            if not why:
                return ""
            reasons.append(why)
    return reasons[0] if reasons else ""


def evaluate(profile: ModelProfile, cluster: Cluster, s: Strategy, request: Request, cal: Calibration) -> Candidate:
    mem = memory_for(profile, cluster, s, request.concurrency, request.context)
    step = decode_step(profile, cluster, s, request.concurrency, request.context, cal)
    single = step if request.concurrency == 1 else decode_step(profile, cluster, s, 1, request.context, cal)
    return Candidate(s, profile, mem, step, single, prefill_time(profile, cluster, s, request.context, cal))


KL_PRICE = 0.1  # the exchange rate of speed for fidelity: 0.01 nats of expected KL costs ~10% of speed
REPLY_TOKENS = 256  # the reply a scored request decodes after its prompt


def score(c: Candidate) -> float:
    """Predicted tokens/s times the share of a request spent decoding (REPLY_TOKENS after the context's
    prompt), discounted by expected KL."""
    return c.speed * c.decode_share * math.exp(-c.kl / KL_PRICE)


def _best(cands: list[Candidate]) -> Candidate | None:
    return max(cands, key=lambda c: (round(score(c), 6), -c.strategy.devices_per_replica), default=None)


def native_everywhere(c: Candidate, cluster: Cluster) -> bool:
    """No dequantization loop: every weight format and the KV format feed the matrix units directly."""
    dev = cluster.device
    return kv_native(dev, c.strategy.kv) and all(_native(dev, f) for f in c.strategy.mix.formats() - {"f32"})


def search(profile: ModelProfile, cluster: Cluster, request: Request, cal: Calibration
           ) -> tuple[Candidate | None, list[Candidate]]:
    """(the chosen candidate or None when nothing fits, every candidate evaluated)."""
    target = target_of(cluster)
    evaluated = [evaluate(p, cluster, s, request, cal)
                 for s, p in enumerate_strategies(profile, cluster, request, target)]
    fitting = [c for c in evaluated if c.fits]
    if target == "datacenter":  # only formats the hardware runs natively; none fitting = no plan
        native = [c for c in fitting if native_everywhere(c, cluster)]
        chosen = _best([c for c in native if c.tier <= GOOD]) or _best(native)
        if chosen is None and explicit(request):  # a named format: wherever llama.cpp runs it
            ran = [c for c in fitting if c.strategy.engine == "llamacpp"]
            chosen = _best([c for c in ran if c.tier <= GOOD]) or _best(ran)
        return chosen, evaluated
    chosen = _best([c for c in fitting if c.tier <= GOOD])
    if chosen is None and profile.stored is not None and request.weights_format in ("auto", ""):
        evaluated += [evaluate(p, cluster, s, request, cal)
                      for s, p in enumerate_strategies(profile, cluster, request, target, requantize=True)]
        fitting = [c for c in evaluated if c.fits]
        chosen = _best([c for c in fitting if c.tier <= GOOD])
    if chosen or target != "local":  # lossy formats and pruning are local last resorts
        return chosen, evaluated
    chosen = _best([c for c in fitting if c.tier <= VERY_LOSSY])
    if chosen:
        return chosen, evaluated
    if target == "local" and request.weights_format in ("auto", ""):  # pruning: the last resort, and it says so
        more = [evaluate(p, cluster, s, request, cal)
                for s, p in enumerate_strategies(profile, cluster, request, target, prune=True)]
        evaluated += more
        chosen = _best([c for c in more if c.fits])
        if chosen:
            return chosen, evaluated
    return None, evaluated
