"""The planner against `twinfer bench` on this machine: predicted vs measured decode tokens/s.

    python bench/bench_planner.py [MODEL] [--backends llamacpp,torch] [--concurrency 1,16] [--repeats 3] [--fit A,B]

For each backend and repeat: wait until no pytest runs and the 1-minute load average is below 1.0 (the
host is shared; timings move by +-15%; a run during which other processes took more than 0.1 core is
discarded and repeated), measure the CPU's read bandwidth (as `twinfer hw --measure`,
which caches it for `twinfer plan`), then run `twinfer bench MODEL --backend B --concurrency 1,16
--prompt-tokens 64 --output-tokens 64 --threads 2 --json` in its own process. The planner (`make_plan`
with the formats that backend's runner holds, `runner_formats`) predicts the same shape on this CPU at
the median measured bandwidth; measurements are medians over the repeats.

Measured decode tokens/s is `concurrency / TPOT p50` (time between one request's tokens, prefill
excluded), which is what the planner predicts; the bench's headline `output_tokens_per_s` (prefill
included) is reported beside it. `--fit bandwidth,tensor` also solves two of each engine's factors so
that the predictions meet the measurements at the lowest and highest concurrency (the rest kept).
Prints one JSON object, raw bench reports included; `--replay FILE` re-predicts a saved run without
running anything (after a calibration change). docs/planner-accuracy.md ("This machine") records a run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from twinfer.planners import probe
from twinfer.planners.calibration import Calibration, device_class
from twinfer.planners.cost import decode_step
from twinfer.planners.hardware import Cluster
from twinfer.planners.plan import Plan, make_plan, runner_formats
from twinfer.planners.search import Request
from twinfer.planners.source import resolve

TWINFER = [sys.executable, "-c", "from twinfer.cli.main import main; main()"]


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def pytest_running() -> list[str]:
    """Python processes running pytest (not shells whose command line merely mentions it)."""
    pids = subprocess.run(["pgrep", "-f", "pytest"], capture_output=True, text=True).stdout.split()
    running = []
    for pid in pids:
        try:
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if b"python" in os.path.basename(argv0):
            running.append(pid)
    return running


def busy_cpu_s() -> float:
    """CPU seconds every process on the machine has spent busy since boot (/proc/stat)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_quiet(max_load: float, timeout_s: float = 3600.0, poll_s: float = 15.0) -> float:
    """Block until no pytest runs, the 1-minute load average is below `max_load` and the CPUs are idle
    over five seconds; returns the load average."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy, load = pytest_running(), load_average()
        if not busy and load < max_load:
            before = busy_cpu_s()
            time.sleep(5.0)  # the load average lags: also require the CPUs idle right now
            if (busy_cpu_s() - before) / 5.0 < 0.15:
                return load
        if time.monotonic() > deadline:
            sys.exit(f"the CPUs did not go quiet within {timeout_s:.0f} s (pytest pids {busy}, load {load}); "
                     "rerun when nothing else is running")
        print(f"waiting for quiet CPUs: pytest pids {busy}, load {load:.2f}", file=sys.stderr)
        time.sleep(poll_s)


def run_twinfer_bench(model: str | None, backend: str, levels: list[int], prompt: int, output: int,
                      threads: int) -> dict[str, Any]:
    cmd = [*TWINFER, "bench", *([model] if model else []), "--backend", backend,
           "--concurrency", ",".join(map(str, levels)), "--prompt-tokens", str(prompt),
           "--output-tokens", str(output), "--threads", str(threads), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if proc.returncode != 0:
        sys.exit(f"twinfer bench --backend {backend} failed:\n{proc.stderr[-2000:]}")
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return report


def with_bandwidth(cluster: Cluster, gbs: float) -> Cluster:
    return replace(cluster, device=replace(cluster.device, bandwidth_gbs=round(gbs, 2), measured=True))


def plans(model: str | None, backend: str, cluster: Cluster, levels: list[int], context: int,
          cal: Calibration) -> dict[int, Plan]:
    """The planner's plan at each level for the formats `backend`'s runner holds."""
    profile = resolve(model)
    weights, kv = runner_formats(backend, cluster.device.kind)
    out = {c: make_plan(profile, cluster, Request(context, c, weights, kv), cal) for c in levels}
    for c, plan in out.items():
        if plan.chosen is None:
            sys.exit(f"the planner says {backend} does not fit at concurrency {c}: {plan.suggestion}")
    return out


def measured_rates(reports: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Median over repeats of each level's decode rate (concurrency / TPOT p50) and headline output rate."""
    out: dict[int, dict[str, Any]] = {}
    for c in sorted({r["concurrency"] for rep in reports for r in rep["results"]}):
        rows = [r for rep in reports for r in rep["results"] if r["concurrency"] == c]
        decode = [c / r["tpot_p50_s"] for r in rows if r["tpot_p50_s"]]
        out[c] = {"decode": statistics.median(decode), "output": statistics.median(r["output_tokens_per_s"] for r in rows),
                  "decode_runs": [round(x, 1) for x in decode]}
    return out


def compare(predicted: dict[int, Plan], measured: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for c, plan in predicted.items():
        assert plan.chosen is not None
        step, m = plan.chosen.step, measured[c]
        pred = step.tokens_per_s
        rows.append({
            "concurrency": c, "predicted_tokens_per_s": round(pred, 1),
            "measured_decode_tokens_per_s": round(m["decode"], 1), "error": round(pred / m["decode"] - 1, 3),
            "measured_output_tokens_per_s": round(m["output"], 1), "error_vs_output": round(pred / m["output"] - 1, 3),
            "decode_runs": m["decode_runs"], "bound": step.bound,
            "predicted_ms": {k: round(getattr(step, k) * 1e3, 2)
                             for k in ("latency_s", "memory_s", "compute_s", "dequant_s", "fixed_s")},
        })
    return rows


def fit(predicted: dict[int, Plan], measured: dict[int, dict[str, Any]], cal: Calibration, context: int,
        names: tuple[str, str] = ("bandwidth", "tensor")) -> dict[str, float]:
    """Two factors of the plans' engine (by default `bandwidth` and `tensor`) chosen so the predictions
    meet the measured decode rates at the lowest (bandwidth-bound) and highest (compute-bound)
    concurrency; the other factors keep their values. A log-spaced grid, narrowed four times."""
    lo, hi = min(predicted), max(predicted)
    plan = predicted[lo]
    assert plan.chosen is not None
    s, profile, cluster = plan.chosen.strategy, plan.chosen.profile, plan.cluster
    base = cal.get(s.engine, cluster.device)
    key = f"{s.engine}/{device_class(cluster.device)}"  # the entry `cal.get` resolves for this engine here

    def loss(a: float, b: float) -> float:
        eff = replace(base, **{names[0]: a, names[1]: b})
        c = Calibration(tuple({**dict(cal.table), key: eff}.items()))
        return sum(math.log(decode_step(profile, cluster, s, n, context, c).tokens_per_s / measured[n]["decode"]) ** 2
                   for n in (lo, hi))

    best = (getattr(base, names[0]), getattr(base, names[1]))
    span = 4.0
    for _ in range(4):
        steps = [span ** (i / 10 - 1) for i in range(21)]
        best = min(((best[0] * a, best[1] * b) for a in steps for b in steps), key=lambda p: loss(*p))
        span = span ** 0.3
    return {names[0]: round(best[0], 3), names[1]: round(best[1], 3),
            "rms_log_error": round(math.sqrt(loss(*best) / 2), 4)}


def measure(args: argparse.Namespace, backend: str, levels: list[int]) -> dict[str, Any]:
    """`args.repeats` clean bench runs of `backend`, each after a quiet check and a bandwidth measurement."""
    runs: list[dict[str, Any]] = []
    discarded = 0
    while len(runs) < args.repeats:
        load = wait_quiet(args.max_load)
        bandwidth = probe.measure_cpu_bandwidth()  # cached: `twinfer plan --hardware cpu` uses it from now on
        busy, ours, start = busy_cpu_s(), children_cpu_s(), time.monotonic()
        report = run_twinfer_bench(args.model, backend, levels, args.prompt_tokens, args.output_tokens, args.threads)
        # CPU time other processes took during the run, in cores: above a tenth, the timings are not ours alone
        foreign = ((busy_cpu_s() - busy) - (children_cpu_s() - ours)) / (time.monotonic() - start)
        rates = {r["concurrency"]: round(r["concurrency"] / r["tpot_p50_s"], 1) for r in report["results"]}
        print(f"{backend}: decode tok/s {rates}, bandwidth {bandwidth:.1f} GB/s, load {load:.2f}, "
              f"foreign CPU {foreign:.2f} cores", file=sys.stderr)
        if foreign > args.max_foreign or pytest_running():
            discarded += 1
            if discarded > 3 * args.repeats:
                sys.exit("other work kept running during the benchmarks; rerun when the machine is idle")
            continue
        runs.append({"load_before": load, "foreign_cpu_cores": round(foreign, 3), "bandwidth_gbs": round(bandwidth, 2),
                     "report": report})
    return {"discarded_runs": discarded, "runs": runs}


def analyze(args: argparse.Namespace, backend: str, levels: list[int], context: int, cal: Calibration,
            raw: dict[str, Any]) -> dict[str, Any]:
    reports = [r["report"] for r in raw["runs"]]
    cluster = with_bandwidth(probe.probe_cpu(), statistics.median(r["bandwidth_gbs"] for r in raw["runs"]))
    predicted = plans(args.model, backend, cluster, levels, context, cal)
    measured = measured_rates(reports)
    first = predicted[levels[0]].to_json()
    entry: dict[str, Any] = {
        "bandwidth_gbs": cluster.device.bandwidth_gbs,
        "planned": {k: first[k] for k in ("engine", "weights_format", "kv_format")}
                   | {k: first["memory"][k] for k in ("weights_bytes", "kv_bytes_per_token")},
        "build": reports[-1]["build"], "rows": compare(predicted, measured),
    }
    if args.fit:
        a, b = args.fit.split(",")
        key = f"{first['engine']}/{device_class(cluster.device)}"
        entry["fit"] = {key: fit(predicted, measured, cal, context, (a, b))}
    return entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="GGUF file (default: the embedded model)")
    ap.add_argument("--backends", default="llamacpp,torch")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calibration", default=None, help="JSON of factor overrides (as `twinfer plan --calibration`)")
    ap.add_argument("--max-load", type=float, default=1.0)
    ap.add_argument("--max-foreign", type=float, default=0.1, help="cores other processes may use during a run")
    ap.add_argument("--fit", default="", help="two Efficiency fields to fit per engine, e.g. bandwidth,tensor")
    ap.add_argument("--replay", default=None, help="a previous run's JSON: re-predict its measurements, run nothing")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    context = args.prompt_tokens + args.output_tokens // 2  # decode runs from prompt to prompt + output tokens
    cal = Calibration.load(args.calibration) if args.calibration else Calibration()
    old = json.loads(Path(args.replay).read_text()) if args.replay else None
    out: dict[str, Any] = {"date": old["date"] if old else time.strftime("%Y-%m-%d"), "traffic": {
        "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "threads": args.threads,
        "repeats": args.repeats, "planned_context": context}, "backends": {}}
    for backend in args.backends.split(","):
        raw = old["backends"][backend]["raw"] if old else measure(args, backend, levels)
        out["backends"][backend] = {**analyze(args, backend, levels, context, cal, raw), "raw": raw}
        out["hardware"] = raw["runs"][-1]["report"]["hardware"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
