"""The planner's single-stream predictions for the default model against every recorded `bench_peers.py`
plan-vs-bench comparison (docs/data), recomputed with the current cost model (docs/planner-accuracy.md,
"Decode attention").

    python bench/plan_refit.py [--reported-clock] [bandwidth=0.82 tensor=0.5 ...]

Each comparison is replayed on a pinned description of its host (cores, clock, ISA flags) at the read
bandwidth it measured (`hw_measured`, recorded from run 10 on); for earlier runs, the bandwidth their
recorded prediction implies under the model in force when "Decode, refitted" was written (llama.cpp CPU
bandwidth factor 0.79, decode attention inside the matmul term). Measured figures come from the data
files. Arguments override fields of the llama.cpp CPU calibration, to try a refit. Prints one line per
comparison and the median errors: over the first ten runs (those the 0.88 bandwidth factor of "Decode
attention" was chosen on) and over all, which the current factors (0.82, tensor 0.5) were chosen on.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from twinfer.planners import probe
from twinfer.planners.calibration import DEFAULTS, Calibration
from twinfer.planners.plan import make_plan
from twinfer.planners.search import Request
from twinfer.planners.source import resolve

_AVX512 = ["avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"]
HOSTS = {  # the three 2-core VMs of docs/benchmarks.md, as /proc/cpuinfo described them
    "epyc-avx512": ("AuthenticAMD", _AVX512, 2.596),
    "epyc-avx2": ("AuthenticAMD", ["avx", "avx2", "fma", "f16c"], 2.45),
    "spr": ("GenuineIntel", [*_AVX512, "amx_tile"], 2.0),
}
DATA = Path(__file__).parent.parent / "docs" / "data"
# (data file, host, bandwidth in GB/s, or None where the file records it[, weights on huge pages]); the first\n# ten set the bandwidth factor
RUNS = [
    ("peers-run.json", "epyc-avx512", 16.35),
    ("peers-run-avx2.json", "epyc-avx2", 12.15),
    ("peers-run-avx2-validation.json", "epyc-avx2", 17.25),
    ("peers-run-spr.json", "spr", 14.65),
    ("planner-run-spr.json", "spr", 14.75),
    ("peers-run-spr-7bb5e9e.json", "spr", 9.65),
    ("peers-run-spr-23ab6e1.json", "spr", 12.25),
    ("peers-run-spr-322c7d6.json", "spr", 7.45),
    ("plan-run-spr-median-bandwidth.json", "spr", 10.0),
    ("peers-run-epyc-bef0c31.json", "epyc-avx512", 20.93),
    ("peers-run-epyc-4efb467.json", "epyc-avx512", None),
    ("peers-run-epyc-da171a6-plan-serve.json", "epyc-avx512", None),
    ("peers-run-epyc-3cbd267.json", "epyc-avx512", None),
    ("peers-run-epyc-77212ab.json", "epyc-avx512", None),
    ("peers-run-epyc-8adb2e3.json", "epyc-avx512", None),
    ("peers-run-epyc-rotated-full.json", "epyc-avx512", None),
    ("peers-run-epyc-78b0b83.json", "epyc-avx512", None),
    ("peers-run-epyc-f5c8a66.json", "epyc-avx512", None),  # runs 18, 19 and 21: out of sample for the kernel bound
    ("peers-run-epyc-f5c8a66-b.json", "epyc-avx512", None),
    ("peers-run-epyc-8294db8.json", "epyc-avx512", None),
    # the runner's weights on huge pages from here on (a fourth field: True)
    ("peers-run-epyc-hugepages.json", "epyc-avx512", None, True),
    ("plan-run-epyc-hugepages-b.json", "epyc-avx512", None, True),
    ("plan-run-epyc-hugepages-c.json", "epyc-avx512", None, True),
    ("peers-run-epyc-hugepages-b.json", "epyc-avx512", None, True),  # run 24: out of sample for the factor
]
FITTED_ON = 10


def comparisons(name: str) -> list[list[dict]]:
    """The file's plan-vs-bench rows, one list per comparison (a `--plan-rounds` run holds several)."""
    data = json.loads((DATA / name).read_text())
    return data.get("plan_rounds") or [data["plan_vs_bench"]]


def predict(host: str, gbs: float, context: int, cal: Calibration, gflops: float | None = None,
            huge: bool = False) -> tuple[float, float]:
    vendor, flags, ghz = HOSTS[host]
    facts = probe.HostFacts(system="Linux", machine="x86_64", model=host, vendor=vendor, flags=frozenset(flags),
                            cpus=2, cores=2, ghz=ghz, memory_bytes=23.5e9, measured_gbs=gbs, measured_gflops=gflops,
                            huge_pages=huge)
    predicted = make_plan(resolve(None), probe.probe_cpu(facts), Request(context, 1), cal).to_json()["predicted"]
    return predicted["decode_tokens_per_s"], predicted["ttft_s"]


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--reported-clock"]
    reported_clock = len(args) < len(sys.argv) - 1  # price every run at /proc's clock, as before the measured clock
    overrides = {k: float(v) for k, v in (a.split("=", 1) for a in args)}
    table = {**DEFAULTS, "llamacpp/cpu": replace(DEFAULTS["llamacpp/cpu"], **overrides)}
    cal = Calibration(tuple(table.items()))
    errors: dict[str, list[tuple[int, float]]] = {"decode": [], "TTFT": []}  # (run index, error)
    for index, (name, host, recorded_gbs, *huge) in enumerate(RUNS):
        for rows in comparisons(name):
            gbs = recorded_gbs or rows[0]["hw_measured"]["cpu read bandwidth"]
            gflops = None if reported_clock else rows[0].get("hw_measured", {}).get("cpu f32 gemm")  # from run 10 on
            cells = [f"{name}, {gbs:.2f} GB/s" + (f", {gflops:.0f} GFLOP/s" if gflops else "")]
            for row in rows:
                d, t = predict(host, gbs, row["context"], cal, gflops, bool(huge))
                for label, ours, theirs in (("decode", d, row["measured_decode_tok_s"]),
                                            ("TTFT", t, row["measured_ttft_s"])):
                    errors[label].append((index, ours / theirs - 1))
                    cells.append(f"{row['prompt_tokens']}: {label} {ours:.3g} vs {theirs:.3g} ({ours / theirs - 1:+.0%})")
            print(" | ".join(cells))
    for label, errs in errors.items():
        for scope, chosen in (("the fitted runs", [e for i, e in errs if i < FITTED_ON]), ("all", [e for _, e in errs])):
            print(f"{label}, {scope}: median error {statistics.median(chosen):+.1%}, median |error| "
                  f"{statistics.median(abs(e) for e in chosen):.1%}, "
                  f"{sum(abs(e) > 0.2 for e in chosen)} of {len(chosen)} outside 20%")


if __name__ == "__main__":
    main()
