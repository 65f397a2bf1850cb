"""The planner against the published measurements recorded in docs/planner-accuracy.md."""

from __future__ import annotations

import statistics
from pathlib import Path

from twinfer.planners.accuracy import parse

DOC = Path(__file__).resolve().parents[1] / "docs" / "planner-accuracy.md"


def test_median_error_on_published_decode_measurements_is_at_most_20_percent() -> None:
    rows = parse(DOC.read_text())
    assert len(rows) >= 30
    errors = {r.id: r.error() for r in rows}
    median = statistics.median(abs(e) for e in errors.values())
    assert median <= 0.20, sorted(errors.items(), key=lambda kv: -abs(kv[1]))[:8]


def test_every_source_and_engine_family_is_represented() -> None:
    rows = parse(DOC.read_text())
    assert {"llamacpp", "vllm", "sglang"} <= {r.engine for r in rows}
    text = DOC.read_text()
    for r in rows:
        assert r.source in text.split("## Sources", 1)[1], f"{r.id}: source {r.source} is not described"


def test_batch_one_llama_cpp_rows_are_each_within_25_percent() -> None:
    # the bandwidth-bound single-stream regime is what the cost model is built on: no row may be far off
    rows = [r for r in parse(DOC.read_text()) if r.engine == "llamacpp" and r.batch == 1]
    worst = max(rows, key=lambda r: abs(r.error()))
    assert abs(worst.error()) <= 0.25, (worst.id, worst.error())
