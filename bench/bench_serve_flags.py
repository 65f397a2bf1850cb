"""`twinfer serve` with no flag at all against `twinfer serve FLAGS`, beside `llama-server -np 16`,
interleaved under bench_peers' HTTP traffic (16 clients, ~100-token prompts, 64 streamed tokens,
ignore_eos). The order of the three rotates every round, so drift in the host's speed during a round
does not always favour the same side; the summary gives the median per-round ratio of each twinfer
side to `llama-server` and of flags to defaults.

    python bench/bench_serve_flags.py --llama-bin /path/to/llama.cpp/build/bin [--rounds 4] [--flags "..."]

The default FLAGS are the ones bench_peers.py passed before revision fc839ae (since then a bare serve
does the same work: `ignore_eos` turns the loop guard off).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from bench_peers import llama_server, serve_rounds, twinfer_serve  # noqa: E402

from twinfer.runtime.loaders import default_model_path  # noqa: E402

BENCH_FLAGS = "--max-seqs 16 --ctx 4096 --no-loop-guard"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-bin", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--flags", default=BENCH_FLAGS, help="the flags to compare against a bare `twinfer serve`")
    ap.add_argument("--json", type=Path, help="also write the rounds and the summary here")
    args = ap.parse_args()
    flags = tuple(shlex.split(args.flags))
    sides: dict[str, Callable[[], dict[str, Any]]] = {
        "twinfer_serve_defaults": twinfer_serve,
        "twinfer_serve_flags": lambda: twinfer_serve(flags=flags),
        # the same llama-server as bench_peers (AMX kept out where its kernels crash)
        "llama_server_np16": lambda: llama_server(args.llama_bin, default_model_path()),
    }
    rows = serve_rounds(sides, args.rounds)
    summary = {
        "flags": args.flags,
        "median_defaults_vs_llama_server": statistics.median(r["twinfer_serve_defaults"] / r["llama_server_np16"] for r in rows),
        "median_flags_vs_llama_server": statistics.median(r["twinfer_serve_flags"] / r["llama_server_np16"] for r in rows),
        "median_flags_vs_defaults": statistics.median(r["twinfer_serve_flags"] / r["twinfer_serve_defaults"] for r in rows),
    }
    out = {"rounds": rows, "summary": summary}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
