"""Steady closed-loop traffic in process at two KV-cache sizes, one process per run, alternating.

Each run opens the default model's llama.cpp runner with `--ctx` cells for 16 sequences (the unified
cache, as `twinfer serve` opens it) and runs `twinfer bench`'s closed loop on it (`app.bench.run_bench`:
a warm-up, then 16 requests in flight until 64 are done, 101-token prompts, 64 new tokens each,
greedy): arrivals never stop, so the cache's used cells do not drain between waves. Prints one JSON line per run (docs/benchmarks.md, "The cache's high-water mark").

    python bench/bench_cache_cells.py --ctx 4096,2560 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def one(ctx: int) -> dict[str, float]:
    from twinfer.app.bench import run_bench
    from twinfer.app.session import OpenOptions, open_session

    session = open_session(OpenOptions(max_seqs=16, ctx=ctx))
    r = run_bench(session, [16], prompt_tokens=101, output_tokens=64, requests_per_client=4)["results"][0]
    return {"ctx": ctx, "tok_s": r["output_tokens_per_s"], "tpot_p50_ms": r["tpot_p50_s"] * 1e3,
            "ttft_p50_s": r["ttft_p50_s"], "wall_s": r["wall_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", default="4096,2560", help="cache sizes, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child run
    a = ap.parse_args()
    if a.one is not None:
        print(json.dumps(one(a.one)))
        return
    for _ in range(a.rounds):
        for ctx in (int(c) for c in a.ctx.split(",")):
            out = subprocess.run([sys.executable, __file__, "--one", str(ctx)], capture_output=True, text=True,
                                 check=True).stdout
            print(out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
