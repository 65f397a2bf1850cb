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

from bench_peers import _free_port, _serve  # noqa: E402

from twinfer.runtime.loaders import default_model_path  # noqa: E402

SERVE = [sys.executable, "-m", "twinfer.cli.main", "serve", "--port"]
BENCH_FLAGS = ["--max-seqs", "16", "--ctx", "4096", "--no-loop-guard"]


def rate(cmd: list[str], port: int) -> float:
    return float(_serve(cmd, port)["results"][0]["output_tokens_per_s"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-bin", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    rows = []
    for _ in range(args.rounds):
        row = {}
        p = _free_port()
        row["twinfer_serve_defaults"] = rate([*SERVE, str(p)], p)
        p = _free_port()
        row["twinfer_serve_bench_flags"] = rate([*SERVE, str(p), *BENCH_FLAGS], p)
        p = _free_port()
        row["llama_server_np16"] = rate([str(args.llama_bin / "llama-server"), "-m", str(default_model_path()),
                                         "--port", str(p), "-np", "16", "-c", str(16 * 4096), "--no-webui"], p)
        rows.append(row)
    print(json.dumps({"rounds": rows}, indent=1))


if __name__ == "__main__":
    main()
