"""`twinfer plan`: resolve the model and the hardware, plan, print the report or JSON."""

from __future__ import annotations

import json
import sys

from twinfer.planners.calibration import Calibration
from twinfer.planners.describe import resolve_cluster
from twinfer.runtime.errors import PlanError

__all__ = ["resolve_cluster", "run_plan"]


def run_plan(model: str | None, hardware: str, gpus: int | None, nodes: int | None, fmt: str, kv_format: str,
             context: int | None, concurrency: int, memory_budget: str | None, params: str | None,
             active_params: str | None, layers: int | None, experts: int | None, top_k: int | None,
             calibration: str | None, json_out: bool, list_models: bool) -> None:
    from twinfer.planners import catalog
    from twinfer.planners.model import parametric
    from twinfer.planners.plan import make_plan
    from twinfer.planners.report import render_plan
    from twinfer.planners.search import Request
    from twinfer.planners.source import resolve
    from twinfer.planners.units import parse_count

    if list_models:
        rows = [{"name": e.name, "repo": e.repo, "params": e.profile().total_params, "native": e.native}
                for e in catalog.ENTRIES]
        print(json.dumps(rows, indent=1) if json_out else "\n".join(f"{r['name']:<18} {r['repo']}" for r in rows))
        return
    if concurrency < 1:
        raise PlanError(f"--concurrency must be at least 1, got {concurrency}")
    if params is not None:
        if model is not None:
            raise PlanError("give either MODEL or --params, not both")
        profile = parametric(parse_count(params, "--params"),
                             parse_count(active_params, "--active-params") if active_params else None,
                             layers=layers, experts=experts, top_k=top_k)
    else:
        if active_params or layers or experts or top_k:
            raise PlanError("--active-params, --layers, --experts and --top-k describe a --params model")
        profile = resolve(model)
    ctx = context if context is not None else min(4096, profile.spec.max_position)
    if ctx < 1:
        raise PlanError(f"--context must be at least 1, got {ctx}")
    if ctx > profile.spec.max_position:
        raise PlanError(f"--context {ctx} exceeds {profile.name}'s limit of {profile.spec.max_position} tokens")
    cluster = resolve_cluster(hardware, gpus, nodes, memory_budget)
    cal = Calibration.load(calibration) if calibration else Calibration()
    plan = make_plan(profile, cluster, Request(ctx, concurrency, fmt, kv_format), cal)
    if json_out:
        print(json.dumps(plan.to_json(), indent=1))
    else:
        print(render_plan(plan))
    if not plan.fits:
        sys.exit(1)
