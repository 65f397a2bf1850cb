"""`twinfer serve` with no flag at all and with the flags bench_peers.py passed before revision fc839ae
(since then a bare serve does the same work: `ignore_eos` turns the loop guard off), beside `llama-server -np 16`,
interleaved under bench_peers' HTTP traffic (16 clients, ~100-token prompts, 64 streamed tokens,
ignore_eos).

    python bench/bench_serve_flags.py --llama-bin /path/to/llama.cpp/build/bin [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_peers import llama_server, serve_tok_s, twinfer_serve  # noqa: E402

from twinfer.runtime.loaders import default_model_path  # noqa: E402

BENCH_FLAGS = ("--max-seqs", "16", "--ctx", "4096", "--no-loop-guard")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-bin", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    rows = []
    for _ in range(args.rounds):
        row = {"twinfer_serve_defaults": serve_tok_s(twinfer_serve()),
               "twinfer_serve_bench_flags": serve_tok_s(twinfer_serve(flags=BENCH_FLAGS)),
               # the same llama-server as bench_peers (AMX kept out where its kernels crash)
               "llama_server_np16": serve_tok_s(llama_server(args.llama_bin, default_model_path()))}
        rows.append(row)
    print(json.dumps({"rounds": rows}, indent=1))


if __name__ == "__main__":
    main()
