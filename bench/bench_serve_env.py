"""`twinfer serve` with and without an environment setting, against `llama-server -np 16`, in one run.

    python bench/bench_serve_env.py --llama-bin BUILD/bin --env OMP_WAIT_POLICY=PASSIVE [--rounds 3]

The HTTP traffic of bench_peers.py (16 clients, ~100-token prompts, 64 streamed tokens, ignore_eos);
each round runs the bare server, the server with `--env` set, and `llama-server` (reversed every
other round). Prints one JSON object: every round and each twinfer variant's median ratio to the peer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import bench_peers  # noqa: E402

from twinfer.app.bench import hardware_info  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bin", type=Path, required=True)
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the second twinfer variant")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    variants: dict[str, dict[str, str]] = {"default": {}, "env": dict(e.split("=", 1) for e in args.env)}
    model = bench_peers.default_model_path()
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = [*variants, "llama_server"]
        if r % 2:
            order.reverse()
        row = {name: bench_peers.serve_tok_s(bench_peers.llama_server(args.llama_bin, model) if name == "llama_server"
                           else bench_peers.twinfer_serve(variants[name])) for name in order}
        rounds.append(row)
    ratios = {name: statistics.median(row[name] / row["llama_server"] for row in rounds) for name in variants}
    print(json.dumps({"hardware": hardware_info(), "env": variants["env"], "rounds": rounds,
                      "median_ratio_to_llama_server": ratios}, indent=1))


if __name__ == "__main__":
    main()
