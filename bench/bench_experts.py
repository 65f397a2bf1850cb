"""Batch-1 MoE expert streaming: a synthetic qwen3_moe under --memory-budget at a share of its weights.

    python bench/bench_experts.py [--size small|2gb] [--budget-share 0.5] [--steps 8] [--backends torch,mlx]

Writes the synthetic model (random weights, seed 0, tensor by tensor) into --dir, then for each
backend runs two child processes: every expert resident, and experts streamed through a cache sized
so weights + KV + cache + staging fit the budget. Each child reports decode tokens/s, the greedy
tokens, cache statistics (decode steps only), and its peak RSS from the OS (VmHWM) minus its RSS before loading
after a warm-up run of a tiny MoE (interpreter, libraries and their code pages: the documented
overhead outside the budget). torch runs one thread. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SIZES = {
    "small": dict(hidden=256, intermediate=256, layers=16, experts=16, top_k=4),  # 201 MB of experts
    "2gb": dict(hidden=1024, intermediate=512, layers=12, experts=28, top_k=4),  # 2.11 GB of experts
}
PROMPT = [1, 5, 9, 200, 3, 77, 8, 100]
ROOT = Path(__file__).resolve().parents[1]


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def decode_greedy(runner: Any, context: list[int], steps: int, on_prefill: Any = None, seq_id: int = 1) -> list[int]:
    """Prefill all but the last token of `context`, call `on_prefill`, then decode `steps` tokens greedily."""
    from twinfer.runtime.batch import SeqChunk, StepBatch

    table = list(range(-(-(len(context) + steps) // runner.kv.block_size)))
    runner.step(StepBatch([SeqChunk(seq_id, context[:-1], 0, table)]))
    if on_prefill is not None:
        on_prefill()
    out: list[int] = []
    token, pos = context[-1], len(context) - 1
    for _ in range(steps):
        logits = runner.step(StepBatch([SeqChunk(seq_id, [token], pos, table)]))
        token, pos = int(logits[-1].argmax()), pos + 1
        out.append(token)
    runner.release(seq_id)
    return out


def _warm_up(load_full: Any) -> None:
    """Run a tiny MoE once, so the libraries' code pages and thread pools are part of the baseline."""
    import gc

    from twinfer.runtime.loaders import load_model
    from twinfer.runtime.synthetic import SyntheticMoE, greedy_tokens, write_synthetic_moe

    tiny = SyntheticMoE(hidden=64, intermediate=32, layers=2, experts=4, top_k=2, vocab=512, heads=2, kv_heads=1,
                        head_dim=32)
    with tempfile.TemporaryDirectory() as tmp:
        runner = load_full(load_model(write_synthetic_moe(Path(tmp), tiny)), kv_tokens=256)
        greedy_tokens(runner, PROMPT, 2)
        del runner
    gc.collect()


def child(folder: str, backend: str, budget: int, steps: int, prefetch: bool) -> dict[str, Any]:
    """One run in this process: budget 0 means every expert resident."""
    from twinfer.runtime.experts import ExpertStats, plan_expert_budget
    from twinfer.runtime.loaders import load_model
    from twinfer.runtime.synthetic import greedy_tokens

    if backend == "torch":
        import torch

        from twinfer.backends.cuda.experts import load_streaming_torch_runner as stream
        from twinfer.backends.cuda.runner import load_torch_runner as full

        torch.set_num_threads(1)  # batch-1 expert matmuls are too small to split; 2 threads stall under load
    else:
        from twinfer.backends.metal.experts import load_streaming_mlx_runner as stream  # type: ignore[assignment]
        from twinfer.backends.metal.runner import load_mlx_runner as full  # type: ignore[assignment]
    _warm_up(full)
    baseline = _status("VmRSS")
    loaded = load_model(folder)
    kv_tokens = 256
    if budget:
        split = plan_expert_budget(loaded.weights, budget, 4, kv_tokens)
        runner = stream(loaded, cache_bytes=split.cache_bytes, kv_tokens=kv_tokens, prefetch=prefetch)
    else:
        runner = full(loaded, kv_tokens=kv_tokens)
    greedy_tokens(runner, PROMPT, 1, seq_id=99)  # warm-up: first-touch costs out of the timing
    cache = runner.ops.cache if budget else None  # type: ignore[attr-defined]
    first = greedy_tokens(runner, PROMPT, 1, seq_id=98)
    t0 = [0.0]

    def decode_starts() -> None:  # statistics and timing cover decode steps only
        if cache is not None:
            cache.stats = ExpertStats()
        t0[0] = time.perf_counter()

    tokens = first + decode_greedy(runner, PROMPT + first, steps, decode_starts)
    elapsed = time.perf_counter() - t0[0]
    out: dict[str, Any] = {"backend": backend, "budget": budget, "tokens": tokens, "seconds": elapsed,
                           "tokens_per_s": steps / elapsed, "baseline_rss": baseline,
                           "peak_rss": _status("VmHWM"), "peak_over_baseline": _status("VmHWM") - baseline}
    if cache is not None:
        out["cache_bytes"] = split.cache_bytes
        out["resident_bytes"] = split.resident_bytes
        out["stats"] = cache.stats.as_dict()
        cache.close()
    return out


def run_child(folder: Path, backend: str, budget: int, steps: int, prefetch: bool = True) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", str(folder), "--backend", backend, "--budget", str(budget),
           "--steps", str(steps)] + ([] if prefetch else ["--no-prefetch"])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"child failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _build() -> dict[str, str]:
    import importlib.metadata as md

    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    out = {"python": sys.version.split()[0], "twinfer_git": rev.stdout.strip()}
    for pkg in ("torch", "mlx", "numpy"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[pkg] = md.version(pkg)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--budget-share", type=float, default=0.5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--backends", default="torch,mlx")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--child", default=None)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--budget", type=int, default=0)
    ap.add_argument("--no-prefetch", action="store_true")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.backend, args.budget, args.steps, not args.no_prefetch)))
        return
    from twinfer.app.bench import hardware_info
    from twinfer.runtime.synthetic import SyntheticMoE, write_synthetic_moe

    shape = SyntheticMoE(**SIZES[args.size])  # type: ignore[arg-type]
    folder = Path(args.dir or tempfile.mkdtemp(prefix="twinfer-moe-")) / args.size
    if not (folder / "config.json").is_file():
        write_synthetic_moe(folder, shape)
    weight_bytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    budget = int(weight_bytes * args.budget_share)
    rows = []
    for backend in args.backends.split(","):
        full = run_child(folder, backend, 0, args.steps)
        streamed = run_child(folder, backend, budget, args.steps)
        rows.append({"backend": backend, "full": full, "streamed": streamed,
                     "greedy_equal": full["tokens"] == streamed["tokens"]})
    print(json.dumps({"hardware": hardware_info(), "build": _build(), "model": shape.__dict__,
                      "weight_bytes": weight_bytes, "expert_bytes": shape.expert_bytes, "budget": budget,
                      "traffic": {"batch": 1, "prompt_tokens": len(PROMPT), "decode_steps": args.steps},
                      "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
