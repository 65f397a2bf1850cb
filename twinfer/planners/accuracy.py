"""The planner against published measurements: docs/planner-accuracy.md's table between
`<!-- measurements:start -->` and `<!-- measurements:end -->` is the data set; running
`python -m twinfer.planners.accuracy docs/planner-accuracy.md` rewrites its predictions and errors."""

from __future__ import annotations

import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from twinfer.planners.calibration import Calibration
from twinfer.planners.catalog import find
from twinfer.planners.cost import Strategy, decode_step
from twinfer.planners.formats import kv_format, mix
from twinfer.planners.hardware import Cluster, lookup
from twinfer.planners.hw_table import DEVICES, NODE_SHAPES
from twinfer.runtime.errors import PlanError

START, END = "<!-- measurements:start -->", "<!-- measurements:end -->"
COLUMNS = ("id", "model", "weights", "hardware", "gpus", "engine", "batch", "context", "measured", "predicted",
           "error", "source")


@dataclass(frozen=True)
class Measurement:
    """One published decode measurement: aggregate tokens/s of `batch` streams at `context` tokens."""

    id: str
    model: str
    weights: str
    hardware: str
    gpus: int
    engine: str
    batch: int
    context: int
    measured: float
    source: str

    def predict(self, cal: Calibration | None = None) -> float:
        cal = cal or Calibration()
        profile = find(self.model).profile()
        device, _ = lookup(self.hardware, DEVICES, NODE_SHAPES)
        cluster = Cluster(device, gpus_per_node=self.gpus)
        kv = kv_format("f16" if self.engine == "llamacpp" else "bf16")
        strategy = Strategy(mix(self.weights), kv, self.engine, tp=self.gpus)
        return decode_step(profile, cluster, strategy, self.batch, self.context, cal).tokens_per_s

    def error(self, cal: Calibration | None = None) -> float:
        """Signed relative error of the prediction: (predicted - measured) / measured."""
        return self.predict(cal) / self.measured - 1.0


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse(text: str) -> list[Measurement]:
    """The measurements table of the accuracy document."""
    if START not in text or END not in text:
        raise PlanError(f"no {START} ... {END} table in the accuracy document")
    body = text.split(START, 1)[1].split(END, 1)[0]
    rows = [line for line in body.splitlines() if line.strip().startswith("|")]
    header = [h.lower() for h in _cells(rows[0])]
    out = []
    for line in rows[2:]:
        cell = dict(zip(header, _cells(line), strict=False))
        out.append(Measurement(
            id=cell["id"], model=cell["model"], weights=cell["weights"], hardware=cell["hardware"],
            gpus=int(cell["gpus"]), engine=cell["engine"], batch=int(cell["batch"]), context=int(cell["context"]),
            measured=float(cell["measured"]), source=cell["source"],
        ))
    return out


def render(rows: list[Measurement], cal: Calibration | None = None) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for r in rows:
        p = r.predict(cal)
        lines.append(f"| {r.id} | {r.model} | {r.weights} | {r.hardware} | {r.gpus} | {r.engine} | {r.batch} | "
                     f"{r.context} | {r.measured:g} | {p:.1f} | {p / r.measured - 1:+.0%} | {r.source} |")
    return "\n".join(lines)


def median_abs_error(rows: list[Measurement], cal: Calibration | None = None) -> float:
    return statistics.median(abs(r.error(cal)) for r in rows)


def update(path: Path) -> float:
    """Rewrite the table's predicted/error columns and the median line; return the median |error|."""
    text = path.read_text()
    rows = parse(text)
    med = median_abs_error(rows)
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    text = f"{head}{START}\n{render(rows)}\n{END}{tail}"
    text = re.sub(r"Median absolute error: \*\*[^*]*\*\*", f"Median absolute error: **{med:.1%}**", text)
    path.write_text(text)
    return med


if __name__ == "__main__":
    doc = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/planner-accuracy.md")
    print(f"median absolute error over {len(parse(doc.read_text()))} measurements: {update(doc):.1%}")
