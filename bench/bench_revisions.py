"""`twinfer bench` of several git revisions side by side, interleaved, each as a user runs it (defaults).

    python bench/bench_revisions.py REV [REV ...] [--rounds 3]

Each revision is checked out as a detached worktree in a scratch folder and run from there
(`python -m twinfer.cli.main bench ... --json`, so its own code is imported, against the packages
installed here). Per round, every revision runs the single-stream bench (`-c 1`) and the 16-stream
bench (`-c 16`, 64-token prompts, 64 tokens) back to back, with `--extra` arguments if given; the JSON holds every figure, the median per revision and the
median ratio of each revision to the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"c1": ["-c", "1"], "c16": ["-c", "16", "--prompt-tokens", "64", "--output-tokens", "64"]}
BUILD_KEYS = ("revision", "n_threads", "n_ctx", "n_batch", "repack", "batch_invariant", "unified_kv", "kv_type")


def worktree(rev: str, scratch: Path) -> Path:
    path = scratch / rev
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev], check=True,
                   capture_output=True)
    return path


def bench(tree: Path, args: list[str]) -> tuple[float, dict[str, Any]]:
    """(output tokens/s, the runner settings the revision chose) of one `twinfer bench` run."""
    out = json.loads(subprocess.run([sys.executable, "-m", "twinfer.cli.main", "bench", *args, "--json"], cwd=tree,
                                    capture_output=True, text=True, check=True).stdout)
    return float(out["results"][0]["output_tokens_per_s"]), {k: out["build"].get(k) for k in BUILD_KEYS}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("revisions", nargs="+")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--extra", default="", help="more bench arguments for every run, e.g. '--threads 2'")
    args = ap.parse_args()
    runs: dict[str, dict[str, list[float]]] = {r: {s: [] for s in SHAPES} for r in args.revisions}
    builds: dict[str, dict[str, Any]] = {r: {} for r in args.revisions}
    with tempfile.TemporaryDirectory(prefix="twinfer-revs-") as tmp:
        trees = {r: worktree(r, Path(tmp)) for r in args.revisions}
        try:
            for _ in range(args.rounds):
                for shape, shape_args in SHAPES.items():
                    for rev, tree in trees.items():
                        rate, builds[rev][shape] = bench(tree, shape_args + args.extra.split())
                        runs[rev][shape].append(rate)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                               capture_output=True)
    base = args.revisions[0]
    out: dict[str, Any] = {"extra_args": args.extra, "builds": builds, "runs_tok_s": runs,
                           "median_tok_s": {r: {s: statistics.median(v) for s, v in d.items()} for r, d in runs.items()},
                           "median_ratio_to_first": {
                               r: {s: statistics.median(a / b for a, b in zip(runs[r][s], runs[base][s], strict=True))
                                   for s in SHAPES} for r in args.revisions[1:]}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
