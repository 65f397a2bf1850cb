"""The planner against llama.cpp's CUDA scoreboard (docs/data/llamacpp-cuda-scoreboard.json): every GPU on it is
in the hardware table, the fitted llama.cpp GPU factors are the fit's optimum, and held-out rows land close."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from twinfer.planners.calibration import Calibration, device_class
from twinfer.planners.catalog import find
from twinfer.planners.hardware import Cluster, lookup
from twinfer.planners.hw_table import DEVICES, NODE_SHAPES
from twinfer.planners.plan import make_plan
from twinfer.planners.scoreboard import (
    BANDWIDTHS,
    LAYER_CYCLES,
    load,
    loss,
    median_abs_error,
    published_gpu_rows,
    with_factors,
)
from twinfer.planners.search import Request

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data" / "llamacpp-cuda-scoreboard.json"
DOC = ROOT / "docs" / "planner-accuracy.md"


def test_every_nvidia_gpu_on_the_scoreboard_is_in_the_table() -> None:
    doc = json.loads(DATA.read_text())
    assert doc["source"] == "https://github.com/ggml-org/llama.cpp/discussions/15013"
    rows = load(DATA)  # fails loudly on a row that names no hardware
    assert len(rows) == 31 and len({r.name for r in rows}) == 31


def test_held_out_rows_land_within_15_percent_median() -> None:
    rows = load(DATA)
    held = [r for r in rows if r.split == "held_out"]
    assert len(held) >= 9 and {device_class(r.device) for r in held} == {"gddr", "hbm"}
    assert median_abs_error(held) <= 0.15, sorted((r.name, round(r.error(Calibration()), 3)) for r in held)
    assert median_abs_error([r for r in rows if r.split == "train"]) <= 0.10


@pytest.mark.parametrize("cls", ["gddr", "hbm"])
def test_committed_factors_are_the_fits_optimum(cls: str) -> None:
    # the full grid search is `python -m twinfer.planners.scoreboard`; here: no neighbour on its grid does better
    training = [r for r in load(DATA) if r.split == "train"] + published_gpu_rows(DOC)
    mine = [r for r in training if device_class(r.device) == cls]
    cal = Calibration()
    eff = cal.get("llamacpp", mine[0].device)
    assert eff.bandwidth in BANDWIDTHS and eff.layer_cycles in LAYER_CYCLES
    here = loss(mine, cal)
    for b, c in ((eff.bandwidth + 0.01, eff.layer_cycles), (eff.bandwidth - 0.01, eff.layer_cycles),
                 (eff.bandwidth, eff.layer_cycles + 5e3), (eff.bandwidth, eff.layer_cycles - 5e3)):
        if min(BANDWIDTHS) <= round(b, 2) <= max(BANDWIDTHS):
            assert loss(mine, with_factors(cal, cls, round(b, 2), c)) >= here - 1e-12, (b, c)


def test_plan_names_every_scoreboard_gpu_and_predicts_the_replayed_rate() -> None:
    profile = find("llama-2-7b").profile()
    request = Request(context=128, weights_format="q4_0", kv_format="f16")
    for row in load(DATA):
        device, _ = lookup(row.name, DEVICES, NODE_SHAPES)
        plan = make_plan(profile, Cluster(device), request)
        assert plan.fits and plan.strategy is not None and plan.strategy.engine == "llamacpp", row.name
        assert 1 / plan.chosen.single.latency_s == pytest.approx(row.predict(Calibration()), rel=1e-9), row.name


@pytest.mark.parametrize("typed,row", [("RTX 4050 Laptop GPU", "rtx-4050-laptop"), ("3050-laptop", "rtx-3050-laptop"),
                                       ("Tesla P40", "p40"), ("Quadro RTX 8000", "quadro-rtx-8000"),
                                       ("RTX PRO 4000 Blackwell", "rtx-pro-4000"), ("RTX 4090 D", "rtx-4090-d"),
                                       ("rtx-5060-ti@16", "rtx-5060-ti"), ("v100-pcie@32", "v100-pcie")])
def test_owned_and_laptop_parts_are_named(typed: str, row: str) -> None:
    device, _ = lookup(typed, DEVICES, NODE_SHAPES)
    assert device.name == row and device.source


def test_laptop_parts_are_their_own_rows() -> None:
    # a laptop GPU shares its number with a desktop card but not its chip or memory bus (the 4090 Laptop is an AD103)
    for n, gb, bw in (("3050", 4, 192), ("4050", 6, 192), ("4060", 8, 256), ("4090", 16, 576)):
        laptop = DEVICES[f"rtx-{n}-laptop"]
        assert (laptop.memory_gb, laptop.bandwidth_gbs) == (gb, bw) and laptop.label.endswith("Laptop GPU"), n
