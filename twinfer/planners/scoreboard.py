"""llama.cpp's CUDA scoreboard as the planner's test: replay it, fit the GPU factors on part of it, score the rest.
Data: docs/data/llamacpp-cuda-scoreboard.json (rows marked `train`, `held_out` or `excluded`); run
`python -m twinfer.planners.scoreboard docs/data/llamacpp-cuda-scoreboard.json`."""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from twinfer.planners.calibration import Calibration, device_class
from twinfer.planners.catalog import find
from twinfer.planners.cost import Strategy, decode_step
from twinfer.planners.formats import kv_format, mix
from twinfer.planners.hardware import GPU, Cluster, Device, lookup
from twinfer.planners.hw_table import DEVICES, NODE_SHAPES
from twinfer.runtime.errors import PlanError

FIT_SPLITS = ("train", "held_out", "excluded")
# the grid `fit` searches: no GPU streams weights above ~92% of its peak bandwidth, so the fit may not
# trade a smaller per-layer cost for a physically impossible bandwidth
BANDWIDTHS = tuple(i / 100 for i in range(70, 93))
LAYER_CYCLES = tuple(float(c) for c in range(20_000, 240_001, 5_000))


@dataclass(frozen=True)
class Row:
    """One measured decode rate (tokens/s) and how to predict it."""

    name: str
    device: Device
    measured: float
    predict: Callable[[Calibration], float]
    split: str = "train"
    why: str = ""

    def error(self, cal: Calibration) -> float:
        """(predicted - measured) / measured."""
        return self.predict(cal) / self.measured - 1.0


def load(path: str | Path) -> list[Row]:
    """The scoreboard's rows, each resolved to its hardware row (a row naming no table entry fails)."""
    doc = json.loads(Path(path).read_text())
    profile = find(doc["model"]).profile()
    strategy = Strategy(mix(doc["weights"]), kv_format(doc["kv"]), doc["engine"])
    context = int(doc["context"])
    rows = []
    for r in doc["rows"]:
        if r["fit"] not in FIT_SPLITS:
            raise PlanError(f"{path}: row {r['device']!r}: fit must be one of {FIT_SPLITS}, not {r['fit']!r}")
        device, _ = lookup(r["hardware"], DEVICES, NODE_SHAPES)

        def predict(cal: Calibration, d: Device = device) -> float:
            return decode_step(profile, Cluster(d), strategy, 1, context, cal).tokens_per_s

        rows.append(Row(r["hardware"], device, float(r["tg128"]), predict, r["fit"], r.get("why", "")))
    return rows


def published_gpu_rows(doc: str | Path) -> list[Row]:
    """The single-GPU llama.cpp rows of docs/planner-accuracy.md that are not copies of a scoreboard row."""
    from twinfer.planners.accuracy import parse

    out = []
    for m in parse(Path(doc).read_text()):
        device, _ = lookup(m.hardware, DEVICES, NODE_SHAPES)
        if m.engine == "llamacpp" and device.kind == GPU and m.gpus == 1 and not m.source.startswith("[L15013"):
            out.append(Row(m.id, device, m.measured, m.predict))
    return out


def with_factors(cal: Calibration, cls: str, bandwidth: float, layer_cycles: float) -> Calibration:
    """`cal` with llama.cpp's bandwidth efficiency and per-layer cycles on device class `cls` replaced."""
    table = dict(cal.table)
    key = f"llamacpp/{cls}"
    table[key] = replace(table[key], bandwidth=bandwidth, layer_cycles=layer_cycles)
    return Calibration(tuple(table.items()))


def loss(rows: Sequence[Row], cal: Calibration) -> float:
    """Mean |log(predicted / measured)|: symmetric in over- and under-prediction, robust to one bad row."""
    return sum(abs(math.log(r.predict(cal) / r.measured)) for r in rows) / len(rows)


def fit(rows: Sequence[Row], cls: str, cal: Calibration | None = None) -> tuple[float, float, float]:
    """(loss, bandwidth, layer_cycles) minimising `loss` over the class's rows on the grid."""
    cal = cal or Calibration()
    mine = [r for r in rows if device_class(r.device) == cls]
    if not mine:
        raise PlanError(f"no rows of device class {cls!r} to fit")
    return min((loss(mine, with_factors(cal, cls, b, c)), b, c) for b in BANDWIDTHS for c in LAYER_CYCLES)


def median_abs_error(rows: Sequence[Row], cal: Calibration | None = None) -> float:
    cal = cal or Calibration()
    return statistics.median(abs(r.error(cal)) for r in rows)


def report(rows: Sequence[Row], cal: Calibration) -> list[str]:
    """One line per row and the median |error| of each split."""
    out = [f"{r.name:<22} {r.split:<9} {r.measured:7.1f} {r.predict(cal):7.1f} {r.error(cal):+6.1%}"
           + (f"  ({r.why})" if r.why else "") for r in rows]
    for split in FIT_SPLITS:
        part = [r for r in rows if r.split == split]
        if part:
            out.append(f"{split}: {len(part)} rows, median |error| {median_abs_error(part, cal):.1%}")
    return out


def main(path: str, doc: str = "docs/planner-accuracy.md") -> None:
    rows = load(path)
    training = [r for r in rows if r.split == "train"] + published_gpu_rows(doc)
    cal = Calibration()
    for cls in ("gddr", "hbm"):
        best, bandwidth, cycles = fit(training, cls, cal)
        print(f"llamacpp/{cls}: bandwidth {bandwidth:.2f}, layer_cycles {cycles:,.0f} (loss {best:.4f})")
        cal = with_factors(cal, cls, bandwidth, cycles)
    print("\n".join(report(rows, cal)))


if __name__ == "__main__":
    main(*sys.argv[1:])
