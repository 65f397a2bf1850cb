"""`twinfer plan`: resolve the model and the hardware, plan, print the report or JSON."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from twinfer.planners.calibration import Calibration
from twinfer.planners.describe import resolve_cluster
from twinfer.runtime.errors import PlanError

__all__ = ["PlanOptions", "resolve_cluster", "run_plan"]


@dataclass(frozen=True)
class PlanOptions:
    """`twinfer plan`'s flags: the model (a file, a catalog name, or a size), the hardware and the request."""

    model: str | None = None
    hardware: str = "auto"
    gpus: int | None = None
    nodes: int | None = None
    fmt: str = "auto"  # --format
    kv_format: str = "auto"
    context: int | None = None  # None: 4,096 within the model's window
    concurrency: int = 1
    memory_budget: str | None = None
    params: str | None = None  # a model known only by size: 2.8T
    active_params: str | None = None
    layers: int | None = None
    experts: int | None = None
    top_k: int | None = None
    calibration: str | None = None
    images: int | None = None  # per request; None: one for a model with a vision encoder, else none
    json_out: bool = False
    list_models: bool = False

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise PlanError(f"--concurrency must be at least 1, got {self.concurrency}", field="concurrency")
        if self.images is not None and self.images < 0:
            raise PlanError(f"--images must be 0 or more, got {self.images}", field="images")
        if self.context is not None and self.context < 1:
            raise PlanError(f"--context must be at least 1, got {self.context}", field="context")
        if self.params is not None and self.model is not None:
            raise PlanError("give either MODEL or --params, not both", field="params")
        if self.params is None and (self.active_params or self.layers or self.experts or self.top_k):
            raise PlanError("--active-params, --layers, --experts and --top-k describe a --params model",
                            field="params")


def run_plan(options: PlanOptions) -> None:
    from twinfer.planners import catalog
    from twinfer.planners.model import parametric
    from twinfer.planners.plan import make_plan
    from twinfer.planners.report import render_plan
    from twinfer.planners.search import Request
    from twinfer.planners.source import resolve
    from twinfer.planners.units import parse_count

    o = options
    if o.list_models:
        rows = [{"name": e.name, "repo": e.repo, "params": e.profile().total_params, "native": e.native}
                for e in catalog.ENTRIES]
        print(json.dumps(rows, indent=1) if o.json_out else "\n".join(f"{r['name']:<18} {r['repo']}" for r in rows))
        return
    if o.params is not None:
        profile = parametric(parse_count(o.params, "--params"),
                             parse_count(o.active_params, "--active-params") if o.active_params else None,
                             layers=o.layers, experts=o.experts, top_k=o.top_k)
    else:
        profile = resolve(o.model)
    profile = profile.with_images(o.images)
    room = profile.spec.max_position - profile.image_tokens
    ctx = o.context if o.context is not None else min(4096, room)
    if ctx > room:
        images = f" plus {profile.image_tokens} image tokens" if profile.image_tokens else ""
        raise PlanError(f"--context {ctx}{images} exceeds {profile.name}'s limit of {profile.spec.max_position} "
                        "tokens", field="context")
    cluster = resolve_cluster(o.hardware, o.gpus, o.nodes, o.memory_budget)
    cal = Calibration.load(o.calibration) if o.calibration else Calibration()
    plan = make_plan(profile, cluster, Request(ctx, o.concurrency, o.fmt, o.kv_format), cal)
    if o.json_out:
        print(json.dumps(plan.to_json(), indent=1))
    else:
        print(render_plan(plan))
    if not plan.fits:
        sys.exit(1)
