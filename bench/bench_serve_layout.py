"""`twinfer serve` with `--kv-layout unified` (one llama.cpp KV cache all sequences share) and with `--kv-layout
streams` (a stream of --ctx cells per sequence, llama-server's layout with -np; what `auto`, the default,
takes where 16 streams fit in an eighth of memory), beside `llama-server -np 16`, under bench_peers' HTTP
traffic (16 clients, ~100-token prompts, 64 streamed tokens, ignore_eos). The three go in a rotating
order every round; ratios are per round against `llama-server`.

    python bench/bench_serve_layout.py --llama-bin /path/to/llama.cpp/build/bin [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_peers import llama_server, serve_rounds, twinfer_serve  # noqa: E402

from twinfer.runtime.loaders import default_model_path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-bin", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    sides = {
        "twinfer_serve_unified": lambda: twinfer_serve(flags=("--kv-layout", "unified")),
        "twinfer_serve_streams": lambda: twinfer_serve(flags=("--kv-layout", "streams")),
        "llama_server_np16": lambda: llama_server(args.llama_bin, default_model_path()),
    }
    names = list(sides)
    rows = serve_rounds(sides, args.rounds)
    ratios = {name: [row[name] / row["llama_server_np16"] for row in rows] for name in names[:2]}
    print(json.dumps({"rounds": rows, "per_round_vs_llama_server": ratios,
                      "median_vs_llama_server": {k: statistics.median(v) for k, v in ratios.items()}}, indent=1))


if __name__ == "__main__":
    main()
