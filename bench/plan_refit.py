"""The planner's single-stream predictions for the default model against every recorded `bench_peers.py`
plan-vs-bench run, recomputed with the current cost model (docs/planner-accuracy.md, "Decode attention").

    python bench/plan_refit.py [bandwidth=0.88 tensor=0.6 ...]

Each run is replayed on a pinned description of its host (cores, clock, ISA flags) at the read bandwidth
it measured; for runs whose data file does not record it, the bandwidth is the one their recorded
prediction implies under the model in force when "Decode, refitted" was written (llama.cpp CPU bandwidth
factor 0.79, decode attention inside the matmul term). Arguments override fields of the llama.cpp CPU
calibration, to try a refit. Prints one line per run and the median errors.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import replace

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
# (run, host, GB/s, measured decode tok/s at 64 / 4,096 tokens, measured TTFT s at 64 / 4,096 or None)
RUNS = [
    ("AVX-512 EPYC, 0915c37 (peers-run.json)", "epyc-avx512", 16.35, (54.2, 43.6), (0.138, 10.72)),
    ("AVX2 EPYC c (peers-run-avx2.json)", "epyc-avx2", 12.15, (34.3, 33.1), (0.280, 19.24)),
    ("AVX2 EPYC, fc839ae (peers-run-avx2-validation.json)", "epyc-avx2", 17.25, (44.5, 41.2), (0.254, 15.84)),
    ("SPR, before (peers-run-spr.json)", "spr", 14.65, (37.4, 38.0), (0.199, 14.49)),
    ("SPR, after (planner-run-spr.json)", "spr", 14.75, (41.9, 37.5), (0.143, 11.34)),
    ("SPR, run 6 (peers-run-spr-7bb5e9e.json)", "spr", 9.65, (31.7, 25.9), (0.215, None)),
    ("SPR, run 7 (peers-run-spr-23ab6e1.json)", "spr", 12.25, (46.0, 38.5), (None, None)),
    ("SPR, run 8 (peers-run-spr-322c7d6.json)", "spr", 7.45, (35.3, 29.9), (None, None)),
    ("SPR, rerun (plan-run-spr-median-bandwidth.json)", "spr", 10.0, (37.3, 31.5), (0.210, 15.14)),
    ("AVX-512 EPYC, run 9 (peers-run-epyc-bef0c31.json)", "epyc-avx512", 20.93, (69.16, 49.70), (0.1115, 8.525)),
]


def predict(host: str, gbs: float, context: int, cal: Calibration) -> tuple[float, float]:
    vendor, flags, ghz = HOSTS[host]
    facts = probe.HostFacts(system="Linux", machine="x86_64", model=host, vendor=vendor, flags=frozenset(flags),
                            cpus=2, cores=2, ghz=ghz, memory_bytes=23.5e9, measured_gbs=gbs)
    predicted = make_plan(resolve(None), probe.probe_cpu(facts), Request(context, 1), cal).to_json()["predicted"]
    return predicted["decode_tokens_per_s"], predicted["ttft_s"]


def main() -> None:
    overrides = {k: float(v) for k, v in (a.split("=", 1) for a in sys.argv[1:])}
    table = {**DEFAULTS, "llamacpp/cpu": replace(DEFAULTS["llamacpp/cpu"], **overrides)}
    cal = Calibration(tuple(table.items()))
    decode_err: list[float] = []
    ttft_err: list[float] = []
    for name, host, gbs, decode, ttft in RUNS:
        cells = [f"{name}, {gbs} GB/s"]
        for context, d_measured, t_measured in zip((64, 4096), decode, ttft, strict=True):
            d, t = predict(host, gbs, context, cal)
            decode_err.append(d / d_measured - 1)
            cells.append(f"{context}: decode {d:.1f} vs {d_measured} ({decode_err[-1]:+.0%})")
            if t_measured:
                ttft_err.append(t / t_measured - 1)
                cells.append(f"TTFT {t:.3f} vs {t_measured} ({ttft_err[-1]:+.0%})")
        print(" | ".join(cells))
    for label, errs in (("decode", decode_err), ("TTFT", ttft_err)):
        print(f"{label}: median error {statistics.median(errs):+.1%}, median |error| "
              f"{statistics.median(abs(e) for e in errs):.1%}, {sum(abs(e) > 0.2 for e in errs)} of {len(errs)} outside 20%")


if __name__ == "__main__":
    main()
