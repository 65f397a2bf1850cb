"""Where a decode step's time goes on a GPU: device time against wall time, and the kernels by CUDA time.

For each model, format and batch it builds the random-weight runner that `gpu_decode.py` (Llama 8B) or
`gpu_moe.py` (DeepSeek-V3 shape, one EP rank) measures, then reports:

- the step's wall time through `runner.step` (what those benchmarks time);
- with CUDA graphs, one replay's device time alone (CUDA events around `graph.replay()`): the difference
  is the host's share of a step (building the batch, copies in, logits out);
- an eager step under `torch.profiler`: the kernels ranked by CUDA time per step, with launch counts,
  and the sum of kernel time against the eager step's wall time (launch-bound when far below).

    python bench/gpu_profile.py                          # on a GPU: both models, the default cases
    python bench/gpu_profile.py --cases llama:bf16:1,moe:fp8:64 --top 20
    python bench/gpu_profile.py --dry-run                # anywhere: tiny widths on CPU (what CI runs)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_decode  # noqa: E402
import gpu_moe  # noqa: E402

from twinfer.runtime.batch import SeqChunk, StepBatch  # noqa: E402

DEFAULT_CASES = "llama:bf16:1,llama:fp8:1,llama:bf16:64,moe:fp8:1,moe:fp8:64"


def build(model: str, fmt: str, batch: int, context: int, device: torch.device, graphs: bool, tiny: bool,
          layers: int) -> tuple[Any, Any]:
    """(runner, step function) for one case; the step function takes a position."""
    per_seq = -(-(context + 64) // gpu_decode.BLOCK)
    kv_tokens = batch * per_seq * gpu_decode.BLOCK
    if model == "llama":
        spec = gpu_decode.TINY if tiny else gpu_decode.LLAMA_8B
        runner, _ = gpu_decode.random_runner(spec, fmt, device, kv_tokens, "auto", graphs)
    elif model == "moe":
        spec = gpu_moe.deepseek_v3(layers, tiny=tiny)
        runner, _ = gpu_moe.random_runner(spec, fmt, 8, device, kv_tokens, "auto", graphs)
    else:
        raise SystemExit(f"gpu_profile: unknown model {model!r} (llama or moe)")
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]

    def step(pos: int) -> None:
        runner.step(StepBatch([SeqChunk(b, [(7 * b + 1) % spec.vocab_size], pos, tables[b]) for b in range(batch)]))

    return runner, step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_ms(step: Any, start: int, n: int, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    for i in range(n):
        step(start + i)
    sync(device)
    return (time.perf_counter() - t0) / n * 1e3


def replay_ms(runner: Any, n: int) -> float | None:
    """One graph replay's device time (the largest captured bucket), or None without graphs."""
    if not runner.graphs:
        return None
    g = runner.graphs[max(runner.graphs)].graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    start.record()
    for _ in range(n):
        g.replay()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / n


def kernel_table(step: Any, start: int, n: int, device: torch.device, top: int) -> tuple[float, list[tuple]]:
    """Sum of kernel time per eager step (ms) and the top kernels: (name, ms per step, launches per step)."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for i in range(n):
            step(start + i)
        sync(device)
    if device.type == "cuda":  # the kernels themselves (a CPU op's self device time counts its kernels again)
        rows = [(ev.key, ev.self_device_time_total / 1e3 / n, ev.count / n) for ev in prof.key_averages()
                if ev.device_type.name == "CUDA" and ev.self_device_time_total > 0]
    else:
        rows = [(ev.key, ev.self_cpu_time_total / 1e3 / n, ev.count / n) for ev in prof.key_averages()
                if ev.self_cpu_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    return sum(r[1] for r in rows), rows[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=DEFAULT_CASES, help="model:format:batch, comma-separated")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2, help="DeepSeek-V3-shaped layers (moe cases)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--dry-run", action="store_true", help="tiny widths on CPU")
    a = ap.parse_args()
    if not a.dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu_profile: no CUDA device; use --dry-run to check the script on CPU")
    device = torch.device("cpu" if a.dry_run else "cuda")
    context, steps = (32, 2) if a.dry_run else (a.context, a.steps)
    for case in a.cases.split(","):
        model, fmt, batch_s = case.split(":")
        batch = int(batch_s)
        with torch.inference_mode():
            runner, step = build(model, fmt, batch, context, device, True, a.dry_run, a.layers)
            for i in range(3):
                step(context + i)
            graphed = wall_ms(step, context + 3, steps, device)
            replay = replay_ms(runner, steps) if device.type == "cuda" else None
            runner.graphs_off = "profiling eager steps"
            step(context + 3 + steps)
            eager = wall_ms(step, context + 4 + steps, steps, device)
            busy, top = kernel_table(step, context + 4 + 2 * steps, steps, device, a.top)
        print(f"== {case}  ({runner.spec.name}, context {context})")
        print(f"   step wall {graphed:.2f} ms" + (f" with graphs; one replay {replay:.2f} ms on the device"
                                                   if replay is not None else " (no graphs)")
              + f"; eager step wall {eager:.2f} ms, kernels {busy:.2f} ms of it")
        for name, ms, count in top:
            print(f"   {ms:8.3f} ms {count:6.0f}x  {name[:110]}")
        del runner, step
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
