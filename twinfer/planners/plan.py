"""`make_plan`: the planner's entry point. Numbers in, a `Plan` with its reasons out; no device is touched."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from twinfer.planners.calibration import Calibration
from twinfer.planners.cost import Strategy, kv_shard
from twinfer.planners.explain import closest, explain, runners_up, smallest_change
from twinfer.planners.hardware import GPU, Cluster
from twinfer.planners.memory import max_concurrency, max_context
from twinfer.planners.model import ModelProfile
from twinfer.planners.placement import Placement, build_refusal, placement_for
from twinfer.planners.search import Candidate, Request, search, target_of
from twinfer.runtime.errors import PlanError


@dataclass(frozen=True)
class Plan:
    """The chosen way to run a model, what it costs in memory, how fast it should go, and why."""

    model: ModelProfile
    cluster: Cluster
    request: Request
    target: str
    chosen: Candidate | None
    max_concurrency: int = 0
    max_context: int = 0
    ttft_s: float = 0.0
    reasons: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    alternatives: tuple[dict[str, Any], ...] = ()
    suggestion: str = ""
    closest: Candidate | None = None  # when nothing fits: the faithful plan nearest to fitting
    notes: tuple[str, ...] = field(default_factory=tuple)
    placement: Placement | None = None  # a llama.cpp plan's layers, experts and KV type, as llama.cpp takes them

    @property
    def fits(self) -> bool:
        return self.chosen is not None

    @property
    def strategy(self) -> Strategy | None:
        return self.chosen.strategy if self.chosen else None

    def to_json(self) -> dict[str, Any]:
        c, s, m = self.chosen, self.strategy, self.model
        out: dict[str, Any] = {
            "fits": self.fits,
            "target": self.target,
            "model": {"name": m.name, "source": m.source, "params": m.total_params, "active_params": m.active_params,
                      "layers": m.spec.num_layers, "experts": m.moe.num_experts if m.moe else None,
                      "vision": _vision_json(m)},
            "hardware": {"name": self.cluster.device.name, "label": self.cluster.device.label,
                         "gpus_per_node": self.cluster.gpus_per_node, "nodes": self.cluster.nodes,
                         "bandwidth_gbs": self.cluster.device.bandwidth_gbs,
                         "memory_gb": self.cluster.device.memory_gb, "measured": self.cluster.device.measured},
            "context": self.request.context,
            "concurrency": self.request.concurrency,
            "reasons": list(self.reasons),
            "warnings": list(self.warnings),
            "runners_up": list(self.alternatives),
            "llamacpp": self.placement.to_json() if self.placement else None,
            "llamacpp_build": self.cluster.llamacpp_build.to_json() if self.cluster.llamacpp_build else None,
        }
        if c is None or s is None:
            near = self.closest
            out.update(weights_format=None, kv_format=None, engine=None, suggestion=self.suggestion,
                       parallelism={"tp": 0, "ep": 0, "pp": 0, "dp": 0}, predicted=None,
                       closest_strategy=near.strategy.label() if near else None,
                       memory=_memory_json(near) if near else None)
            return out
        out.update(
            weights_format=s.mix.name,
            kv_format=s.kv.name,
            engine=s.engine,
            parallelism={"tp": s.tp, "ep": s.ep, "pp": s.pp, "dp": s.dp},
            moe={"mode": "stream" if s.stream_fraction else "full", "streamed_share": s.stream_fraction,
                 "resident_bytes": c.memory.resident_weights * s.tp * s.pp,
                 "streamed_bytes": c.memory.streamed_weights} if m.moe else None,
            pruned_share=s.prune,
            memory=_memory_json(c),
            max_concurrency=self.max_concurrency,
            max_context=self.max_context,
            predicted={
                "decode_tokens_per_s": 1.0 / c.single.latency_s,
                "decode_tokens_per_s_at_concurrency": c.step.tokens_per_s,
                "per_stream_tokens_per_s_at_concurrency": 1.0 / c.step.latency_s,
                "ttft_s": self.ttft_s,
                "bound": c.single.bound,
            },
        )
        return out


def _vision_json(m: ModelProfile) -> dict[str, Any] | None:
    v = m.vision
    if v is None:
        return None
    return {"params": v.params, "tokens_per_image": v.tokens_per_image, "images_per_request": v.images,
            "source": v.source}


def _memory_json(c: Candidate) -> dict[str, Any]:
    mem = c.memory
    return {
        "weights_bytes": mem.weights_bytes,
        "vision_weights_bytes_per_device": mem.vision_weights,
        "image_kv_bytes_per_device": mem.image_kv,
        "resident_weights_bytes_per_device": mem.resident_weights,
        "kv_bytes_per_token": mem.kv_bytes_per_token,
        "kv_bytes_per_device": mem.kv,
        "kv_split_ways": kv_shard(c.profile, c.strategy),  # KV heads over TP (an MLA latent: replicated), layers over PP
        "mla_latent_cache": ("replicated" if c.strategy.tp > 1 else "whole") if c.profile.spec.mla else None,
        "activation_bytes_per_device": mem.activations,
        "overhead_bytes_per_device": mem.overhead,
        "total_bytes": mem.total_bytes,
        "capacity_bytes": mem.capacity_bytes,
        "devices": mem.devices,
    }


def runner_formats(backend: str, device_kind: str) -> tuple[str, str]:
    """(weights format, KV format) that twinfer's runner for `backend` holds, as `Request` fields: llama.cpp
    the file with an F16 cache, torch and MLX bfloat16 on a GPU and float32 on a CPU."""
    if backend == "llamacpp":
        return "stored", "f16"
    if backend == "torch" and device_kind == GPU:
        return "bf16", "bf16"
    if backend in ("torch", "mlx"):
        return "f32", "f32"
    raise PlanError(f"unknown backend {backend!r}: choose llamacpp, torch or mlx")


def make_plan(model: ModelProfile, cluster: Cluster, request: Request, cal: Calibration | None = None) -> Plan:
    """Choose how to run `model` on `cluster` for `request`, predict its speed, and explain the choice."""
    cal = cal or Calibration()
    if request.context + model.image_tokens > model.spec.max_position:
        images = f" plus {model.image_tokens} image tokens" if model.image_tokens else ""
        raise PlanError(f"--context {request.context}{images} exceeds {model.name}'s limit of "
                        f"{model.spec.max_position} tokens")
    target = target_of(cluster)
    chosen, evaluated = search(model, cluster, request, cal)
    notes = model.notes + cluster.notes
    if chosen is None:
        return Plan(model, cluster, request, target, None, reasons=(), notes=notes,
                    suggestion=smallest_change(model, cluster, request, evaluated, cal),
                    closest=closest(evaluated, cluster),
                    alternatives=tuple(runners_up(None, evaluated)))
    s = chosen.strategy
    prof = chosen.profile
    reasons, warnings = explain(chosen, evaluated, cluster, request, cal)
    placement = placement_for(prof, s, cluster.device)
    refused = build_refusal(cluster.llamacpp_build, placement, cluster.device)
    return Plan(
        model, cluster, request, target, chosen,
        max_concurrency=max_concurrency(prof, cluster, s, request.context),
        max_context=max_context(prof, cluster, s, request.concurrency),
        ttft_s=chosen.ttft_s, reasons=tuple(reasons), warnings=(*warnings, *([refused] if refused else [])),
        alternatives=tuple(runners_up(chosen, evaluated)), notes=notes, placement=placement,
    )
