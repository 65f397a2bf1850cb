"""A GGUF MoE bigger than its GPU memory budget, run by llama.cpp with the plan's placement, at batch 1.

Writes a random Qwen3-MoE GGUF of about `--gb` GB (Q8_0, 64 experts top 4, width 2048; tests/random_moe_gguf.py),
plans it under `--memory-budget` on this GPU, planned as one local card (a budget to fit, so experts
may stay in host memory; the card's own numbers), opens it through `open_session` the way `twinfer generate
--memory-budget` does, and measures the process's GPU memory (nvidia-smi) and decode tokens/s. Beside it, in
the same run: every layer and expert on the GPU (over the budget: the upper bound), every expert in host
memory (`--cpu-moe`), and, with `--cpu`, no GPU at all. Each case prints its llama.cpp flags.

Needs a llama-cpp-python built with CUDA (`pip install llama-cpp-python` builds the CPU alone); without
one it says so and exits 0. Build one (a few minutes on 16 cores) with
    CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native" pip install --force-reinstall \\
        --no-cache-dir --no-binary llama-cpp-python llama-cpp-python

    python bench/gpu_placement.py --gb 12 --memory-budget 6GB     # on a GPU
    python bench/gpu_placement.py --dry-run                       # anywhere: a tiny model, a described GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.random_moe_gguf import MoEShape, write_random_moe_gguf  # noqa: E402
from twinfer.planners.placement import ALL_LAYERS, GPU_BUILD_HINT, Placement  # noqa: E402

DRY_GPU = "gpu:memory=8GB,bandwidth=400GB/s,bf16=100,label=described GPU (dry run)"


def shape_for(gb: float) -> MoEShape:
    """Width 2048, 64 experts of 768 top 4 (about 0.33 GB a layer in Q8_0), as many layers as `gb` holds."""
    one = MoEShape(hidden=2048, expert_ffn=768, layers=1, experts=64, top_k=4, heads=16, kv_heads=4, head_dim=128)
    return dataclasses.replace(one, layers=max(2, round(gb * 1e9 / one.nbytes)))


def _smi(query: str) -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return out.splitlines()


def device_used_mib() -> float | None:
    """GPU 0's memory in use, MiB (None without nvidia-smi)."""
    lines = _smi("gpu=memory.used")
    return float(lines[0]) if lines else None


def gpu_mib(baseline: float | None) -> float | None:
    """GPU memory this process holds: nvidia-smi's per-process figure, or, where it lists no such pid (a
    container's own pid namespace), the device's use above `baseline`, read before anything loaded."""
    for line in _smi("compute-apps=pid,used_memory"):
        pid, _, used = line.partition(",")
        if pid.strip() == str(os.getpid()):
            return float(used)
    now = device_used_mib()
    return now - baseline if now is not None and baseline is not None else None


def decode(runner: Any, prompt: int, steps: int) -> dict[str, float]:
    """Prefill `prompt` tokens, then `steps` greedy tokens one step each; seconds and tokens/s."""
    import numpy as np

    from twinfer.runtime.batch import SeqChunk, StepBatch

    table = list(range(-(-(prompt + steps) // runner.kv.block_size)))
    tokens = [3 + (i * 7) % 250 for i in range(prompt)]
    t0 = time.perf_counter()
    logits = runner.step(StepBatch([SeqChunk(1, tokens, 0, table)]))
    t1 = time.perf_counter()
    pos = prompt
    for _ in range(steps):
        nxt = int(np.argmax(logits[-1]))
        logits = runner.step(StepBatch([SeqChunk(1, [nxt], pos, table)]))
        pos += 1
    t2 = time.perf_counter()
    runner.release(1)
    return {"prefill_s": t1 - t0, "decode_tokens_per_s": steps / (t2 - t1)}


def measure(name: str, runner: Any, placement: Placement | None, a: argparse.Namespace) -> dict[str, Any]:
    decode(runner, 8, 2)  # warm: first kernels, first expert pages
    row: dict[str, Any] = {"case": name, "llama.cpp": placement.args() if placement else "(llama.cpp defaults)",
                           "applied": runner.describe()["placement"],
                           "gpu_mib": gpu_mib(a.baseline_mib) if not a.dry_run else None}
    row.update(decode(runner, a.prompt, a.steps))
    print(json.dumps(row), flush=True)
    return row


def plan_case(path: Path, cluster: Any, budget: str, a: argparse.Namespace) -> tuple[dict[str, Any], Placement]:
    """The plan's own run: `open_session` with the budget, as `twinfer generate --memory-budget` opens it."""
    from twinfer.app.session import OpenOptions, open_session

    session = open_session(OpenOptions(str(path), "llamacpp", ctx=a.ctx, memory_budget=budget, hardware=cluster))
    try:
        assert session.strategy is not None and session.strategy.placement is not None
        placement = session.strategy.placement
        print(session.strategy.summary(), flush=True)
        applied = session.opened.runner.describe()["placement"]
        wanted = {"n_gpu_layers": placement.n_gpu_layers, "tensor_overrides": [f"{p}=CPU" for p in placement.overrides()]}
        assert applied == wanted, f"the runner got {applied}, the plan says {wanted}"
        row = measure("plan", session.opened.runner, placement, a)
        row["budget_mib"] = (session.strategy.budget) / 2**20
        return row, placement
    finally:
        session.close()


def fixed_case(name: str, path: Path, placement: Placement, a: argparse.Namespace) -> dict[str, Any]:
    from twinfer.backends.llamacpp.options import options_for_mode
    from twinfer.backends.llamacpp.runner import LlamaCppRunner

    # the options the plan's session got ("fast": generate's mode), another placement
    options = options_for_mode("fast", n_ctx=a.ctx, max_seqs=1, placement=placement)
    with LlamaCppRunner(path, options) as runner:
        return measure(name, runner, placement, a)


def local_gpu() -> Any:
    """This machine's GPU as one local card: its numbers, planned as a device to fit (gddr: not a datacenter
    target, whose plans never keep weights off the card)."""
    from twinfer.planners.describe import resolve_cluster, with_build

    found = resolve_cluster("auto", follow_build=False)
    if found.device.kind != "gpu":
        raise SystemExit(f"gpu_placement: no GPU found ({found.device.label}); use --dry-run on a CPU")
    one = dataclasses.replace(found, gpus_per_node=1, device=dataclasses.replace(found.device, memory_type="gddr"))
    return with_build(one)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=12.0, help="model size in GB (default 12)")
    ap.add_argument("--memory-budget", default="6GB", help="the GPU memory the plan may use (default 6GB)")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--cpu", action="store_true", help="also run with no GPU layer (slow: the experts on the CPU)")
    ap.add_argument("--dir", default=None, help="where the GGUF is written (default: a temp dir)")
    ap.add_argument("--dry-run", action="store_true", help="a tiny model on a described GPU, on any build (CI)")
    a = ap.parse_args()
    if a.dry_run:
        os.environ["TWINFER_LLAMACPP_BUILD"] = "CPU,CUDA"  # plan as a GPU build would; this one ignores the layers
        a.prompt, a.steps, a.ctx = 16, 4, 256
    from twinfer.planners.describe import resolve_cluster
    from twinfer.planners.llamacpp_build import read_build

    cluster = resolve_cluster(DRY_GPU) if a.dry_run else local_gpu()
    build = read_build()
    print(build.describe() if build else "llama-cpp-python is not installed", flush=True)
    if build is None or build.backend_for(cluster.device) is None:
        print(f"SKIP gpu_placement: this llama-cpp-python cannot offload to {cluster.device.label}. {GPU_BUILD_HINT}")
        return
    a.baseline_mib = None if a.dry_run else device_used_mib()
    shape = MoEShape() if a.dry_run else shape_for(a.gb)
    folder = Path(a.dir or tempfile.mkdtemp(prefix="gpu-placement-"))
    t0 = time.perf_counter()
    path = write_random_moe_gguf(folder / f"moe-{shape.layers}x{shape.experts}-q8_0.gguf", shape)
    print(f"{path}: {path.stat().st_size / 1e9:.2f} GB, {shape.layers} layers ({time.perf_counter() - t0:.0f} s)")
    try:
        run_cases(path, cluster, dry_budget(path, cluster) if a.dry_run else a.memory_budget, a)
    finally:
        if a.dir is None:
            path.unlink()


def run_cases(path: Path, cluster: Any, budget: str, a: argparse.Namespace) -> None:
    """The plan's run, then the fixed placements beside it, and the table."""
    rows = []
    row, placement = plan_case(path, cluster, budget, a)
    rows.append(row)
    every = dataclasses.replace(placement, cpu_moe_layers=0)
    rows.append(fixed_case("every layer and expert on the GPU (over the budget)", path, every, a))
    rows.append(fixed_case("every expert in host memory (--cpu-moe)", path, dataclasses.replace(
        placement, cpu_moe_layers=placement.num_layers), a))
    if a.cpu:
        cpu = Placement("cpu", 0, placement.num_layers, kv_type=placement.kv_type)
        rows.append(fixed_case("no GPU layer", path, cpu, a))
    print(f"{'case':<52} {'GPU MiB':>8} {'decode tok/s':>12} {'prefill s':>9}  llama.cpp")
    for r in rows:
        mib = f"{r['gpu_mib']:.0f}" if r["gpu_mib"] is not None else "-"
        print(f"{r['case']:<52} {mib:>8} {r['decode_tokens_per_s']:>12.1f} {r['prefill_s']:>9.2f}  {r['llama.cpp']}")
    if rows[0]["gpu_mib"] is not None:
        print(f"the plan's run held {rows[0]['gpu_mib']:.0f} MiB of the GPU under a {rows[0]['budget_mib']:.0f} MiB budget")
    assert placement.n_gpu_layers == ALL_LAYERS and placement.cpu_moe_layers > 0, placement


def dry_budget(path: Path, cluster: Any) -> str:
    """A budget below the tiny model's whole plan, at which its plan keeps some experts in host memory."""
    from twinfer.app.budget import llamacpp_strategy
    from twinfer.runtime.loaders import load_model

    loaded = load_model(path)
    budget = llamacpp_strategy(loaded, 10**12, 256, 1, False, cluster).predicted_bytes
    for _ in range(40):
        budget -= 20_000
        s = llamacpp_strategy(loaded, budget, 256, 1, False, cluster)
        if s.placement is not None and s.placement.cpu_moe_layers:
            return str(budget)
    raise SystemExit("gpu_placement: no budget made the tiny plan keep experts in host memory")


if __name__ == "__main__":
    main()
