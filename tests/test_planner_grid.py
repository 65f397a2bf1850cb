"""The planner never ends in a traceback: every plan `twinfer plan` can ask for either fits, or doesn't and
says what to change, or raises a `TwinferError` whose message the CLI prints as one line.

The grid is the whole catalog x every device and node shape in the table (plus CPUs and described
devices, never the probed host) x weight formats x KV formats x contexts x concurrency x GPU and node
counts x memory budgets. Walking all of it would take hours, so a fixed-seed sample visits every
hardware row `PER_ROW` times, rotating the models, and checks that every value of every axis was
exercised (`-m slow` walks twenty times as many). The plan, its JSON (strict: no NaN or infinity) and
its report are all built, as the CLI does.
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twinfer.planners import catalog
from twinfer.planners.describe import resolve_cluster
from twinfer.planners.formats import KV_FORMATS, MIXES
from twinfer.planners.hardware import APPLE, CPU, GPU, Cluster, Device
from twinfer.planners.hw_table import DEVICES, NODE_SHAPES
from twinfer.planners.plan import make_plan
from twinfer.planners.report import render_plan
from twinfer.planners.search import Request
from twinfer.runtime.errors import TwinferError


def _cpu(label: str, memory: float, bandwidth: float, f32: float, int8: float, ghz: float) -> Device:
    return Device(name="cpu", label=label, vendor="cpu", kind=CPU, memory_gb=memory, bandwidth_gbs=bandwidth,
                  memory_type="ddr", interconnect_gbs=0.0, link="none",
                  tensor_tflops=(("f32", f32), ("int8", int8)), vector_tflops=f32, clock_ghz=ghz,
                  source="test shape", storage_gbs=2.0)


CPUS = [
    _cpu("2-core AVX2 laptop", 8, 20, 0.19, 0.38, 3.0),
    _cpu("16-core AVX-512 server", 128, 120, 2.4, 9.6, 2.4),
    _cpu("8-core ARM dotprod", 16, 60, 0.4, 1.6, 3.2),
    _cpu("1-core 1 GB box", 1, 5, 0.05, 0.05, 2.0),
]
DESCRIBED = [
    "gpu:memory=24GB,bandwidth=1008GB/s,bf16=165TFLOPS,link=pcie4",
    "gpu:memory=8GB,bandwidth=200GB/s,vector=10TFLOPS",
    "gpu:memory=16GB,bandwidth=320GB/s,f16=65TFLOPS,int8=130TOPS,link=pcie3",  # no bf16, as on Turing
    "gpu:memory=192GB,bandwidth=8TB/s,fp4=10PFLOPS,memory_type=hbm,link=nvlink5,max_per_node=8",
    "gpu:memory=1GB,bandwidth=10GB/s,bf16=1TFLOPS",
    "apple:memory=32GB,bandwidth=400GB/s,vector=13.6TFLOPS",
    "cpu:memory=4GB,bandwidth=2GB/s,vector=0.01TFLOPS",
]
HARDWARE: list[str | Device] = [*DEVICES, *NODE_SHAPES, *CPUS, *DESCRIBED]
WEIGHTS = ("auto", "stored", *MIXES, "q4_k_m+embed_q4_0")
KVS = ("auto", *KV_FORMATS)
CONTEXTS = (1, 2, 512, 4096, 32768, 131072, 1_000_000)
CONCURRENCY = (1, 3, 64, 1024)
GPUS = (None, 1, 2, 3, 4, 8, 72)
NODES = (None, 1, 2, 4)
BUDGETS = (None, "100MB", "2GB", "40GB")
PER_ROW = 4


@dataclass(frozen=True)
class Case:
    model: str
    hardware: str | Device
    weights: str
    kv: str
    context: int
    concurrency: int
    gpus: int | None
    nodes: int | None
    budget: str | None

    def __str__(self) -> str:
        hw = self.hardware if isinstance(self.hardware, str) else self.hardware.label
        return (f"twinfer plan {self.model} --hardware {hw!r} --gpus {self.gpus} --nodes {self.nodes} "
                f"--format {self.weights} --kv-format {self.kv} --context {self.context} "
                f"--concurrency {self.concurrency} --memory-budget {self.budget}")


def _single(hw: str | Device) -> bool:
    """A CPU or a Mac: asking it for several GPUs is refused every time, so only one case per row asks."""
    if isinstance(hw, Device):
        return hw.kind != GPU
    return hw.startswith(("cpu:", "apple:")) or (hw in DEVICES and DEVICES[hw].kind != GPU)


def _pick(rng: random.Random, axis: tuple[Any, ...]) -> Any:
    """The axis' default (what most users run) half the time, any value otherwise."""
    return axis[0] if rng.random() < 0.5 else rng.choice(axis)


def cases(seed: int = 19, per_row: int = PER_ROW) -> list[Case]:
    rng = random.Random(seed)
    out = []
    for i, hw in enumerate(HARDWARE):
        for k in range(per_row):
            model = catalog.ENTRIES[(i * per_row + k) % len(catalog.ENTRIES)].name
            fixed = _single(hw) and k > 0
            out.append(Case(model, hw, _pick(rng, WEIGHTS), _pick(rng, KVS), rng.choice(CONTEXTS),
                            rng.choice(CONCURRENCY), None if fixed else rng.choice(GPUS),
                            None if fixed else rng.choice(NODES), _pick(rng, BUDGETS)))
    return out


def _cluster(case: Case) -> Cluster:
    if isinstance(case.hardware, str):
        return resolve_cluster(case.hardware, case.gpus, case.nodes, case.budget)
    from twinfer.planners.units import parse_bytes

    return Cluster(case.hardware, case.gpus or 1, case.nodes or 1,
                   memory_budget_bytes=parse_bytes(case.budget) if case.budget else None)


def run_case(case: Case) -> str:
    """'fits', 'no plan' or 'refused' -- any other exception propagates and fails the test."""
    try:
        profile = catalog.find(case.model).profile()
        plan = make_plan(profile, _cluster(case), Request(case.context, case.concurrency, case.weights, case.kv))
        out = plan.to_json()
        json.dumps(out, allow_nan=False)  # what `--json` prints must be JSON
        text = render_plan(plan)
    except TwinferError as e:
        assert str(e).strip(), f"{case}: {type(e).__name__} with no message"
        return "refused"
    assert text and (plan.fits or plan.suggestion), case
    for flag, asked in (("--context", case.context), ("--concurrency", case.concurrency)):
        m = re.match(rf"lower {flag} to (\d+)", plan.suggestion)
        assert m is None or int(m.group(1)) < asked, f"{case}: suggests {plan.suggestion!r}"
    if plan.fits:
        predicted = out["predicted"]
        assert all(math.isfinite(v) and v > 0 for v in (predicted["decode_tokens_per_s"], predicted["ttft_s"])), case
        assert out["memory"]["total_bytes"] <= out["memory"]["capacity_bytes"] * 1.000001, case
    return "fits" if plan.fits else "no plan"


def test_grid_of_catalog_hardware_formats_and_shapes_never_raises_anything_else() -> None:
    check_grid(cases())


@pytest.mark.slow
def test_a_grid_twenty_times_larger() -> None:
    check_grid(cases(seed=4, per_row=20 * PER_ROW))


def check_grid(grid: list[Case]) -> None:
    outcomes: dict[str, int] = {}
    failures: list[str] = []
    for case in grid:
        try:
            verdict = run_case(case)
        except Exception as e:  # noqa: BLE001 - the point is to collect every traceback the grid finds
            failures.append(f"{case}: {type(e).__name__}: {e}")
            continue
        outcomes[verdict] = outcomes.get(verdict, 0) + 1
    assert not failures, f"{len(failures)} of {len(grid)} plans ended in a traceback:\n" + "\n".join(failures[:20])
    # The sample is only worth its time if it exercised every value of every axis and all three outcomes.
    for axis, values in (("weights", WEIGHTS), ("kv", KVS), ("context", CONTEXTS), ("concurrency", CONCURRENCY),
                         ("gpus", GPUS), ("nodes", NODES), ("budget", BUDGETS)):
        seen = {getattr(c, axis) for c in grid}
        assert seen == set(values), f"axis {axis} missed {set(values) - seen}"
    assert {c.model for c in grid} == set(catalog.CATALOG)
    assert set(outcomes) == {"fits", "no plan", "refused"} and outcomes["fits"] > len(grid) // 8, outcomes


def test_a_refused_plan_names_the_real_obstacle() -> None:
    h100 = run_case_plan("llama-3.1-8b", "h100", "auto", "q8_0")
    # the GPU engine (torch) holds no Q8_0 KV at all, which comes before whether H100 runs it natively
    assert h100.suggestion.startswith("no runner runs what was asked: the torch runner keeps KV in its dtype")
    assert "Q8_0" in h100.suggestion
    fp4_only = run_case_plan("llama-3.1-8b", "gpu:memory=192GB,bandwidth=8TB/s,fp4=10PFLOPS,memory_type=hbm")
    assert fp4_only.suggestion.startswith("no runner runs what was asked: the torch runner does not hold")
    assert "on described gpu" in fp4_only.suggestion
    tiny = run_case_plan("llama-3.1-70b", "h100")
    assert tiny.suggestion.startswith("use --gpus 2")


def run_case_plan(model: str, hardware: str, weights: str = "auto", kv: str = "auto") -> Any:
    return make_plan(catalog.find(model).profile(), resolve_cluster(hardware), Request(4096, 1, weights, kv))


_KINDS = st.sampled_from([GPU, GPU, APPLE, CPU])


@st.composite
def devices(draw: Any) -> Device:
    """Any device a description could name: memory 0.5 GB-2 TB, bandwidth 1 GB/s-20 TB/s, any mix of dtypes."""
    kind = draw(_KINDS)
    vector = draw(st.floats(0.005, 500))
    dtypes = draw(st.sets(st.sampled_from(["bf16", "f16", "fp8", "int8", "fp4"]), max_size=5)) if kind == GPU else set()
    tensor = tuple((d, vector * draw(st.floats(0.5, 64))) for d in sorted(dtypes)) or (("f32", vector),)
    link = draw(st.sampled_from(["pcie4", "nvlink4"])) if kind == GPU else "none"
    return Device(
        name="any", label=f"any {kind}", vendor="test", kind=kind, memory_gb=draw(st.floats(0.5, 2000)),
        bandwidth_gbs=draw(st.floats(1, 20000)), memory_type=draw(st.sampled_from(["hbm", "gddr", "lpddr", "ddr"])),
        interconnect_gbs=draw(st.floats(1, 2000)) if kind == GPU else 0.0, link=link, tensor_tflops=tensor,
        vector_tflops=vector, clock_ghz=draw(st.floats(0.3, 4)), source="hypothesis",
        storage_gbs=draw(st.sampled_from([0.0, 2.0, 7.0])), max_per_node=8 if kind == GPU else 1,
    )


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(device=devices(), model=st.sampled_from(sorted(catalog.CATALOG)), gpus=st.sampled_from([1, 2, 8]),
       context=st.sampled_from(CONTEXTS), concurrency=st.sampled_from(CONCURRENCY),
       weights=st.sampled_from(["auto", "auto", *MIXES]), kv=st.sampled_from(["auto", "auto", *KV_FORMATS]))
def test_any_device_plans_or_refuses(device: Device, model: str, gpus: int, context: int, concurrency: int,
                                     weights: str, kv: str) -> None:
    run_case(Case(model, device, weights, kv, context, concurrency, gpus if device.kind == GPU else 1, 1, None))
