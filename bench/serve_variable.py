"""`twinfer serve` against `llama-server -np 16` under variable-length traffic: NVIDIA's AIPerf, closed-loop
clients, ~100-token prompts, 64 +- 32 new tokens with `ignore_eos` (requests finish at different steps, so
sequences come and go in the KV streams), each server at its defaults.

    python bench/serve_variable.py --llama-bin DIR --aiperf PATH --tokenizer DIR [--model M.gguf]
        [--clients 8] [--requests 32] [--rounds 2] [--stream] [--before CHECKOUT]

`--before` also runs the twinfer of another checkout (a `git worktree` of an earlier revision), imported
from there. Twinfer's servers run with each `llama_decode` call recorded (`serve_split.py`), so each run
also reports the share of calls llama.cpp split over more than one run of consecutive KV streams (one
ubatch, one pass over the weights, each). Servers start fresh for each run; the order rotates by round.
Prints one JSON object per run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from bench_serve_load import aiperf, start  # noqa: E402

from twinfer.runtime.loaders import default_model_path  # noqa: E402

SPLIT = str(Path(__file__).parent / "serve_split.py")


def one(side: str, args: argparse.Namespace, seed: int, folder: Path) -> dict[str, Any]:
    import httpx

    calls = folder / f"{side}-{seed}.json"
    timed = (sys.executable, SPLIT, "--serve-timed", str(calls))
    serve = ("env", f"PYTHONPATH={args.before}", *timed) if side == "twinfer-before" else timed
    proc, url = start("llama-server" if side == "llama-server" else "twinfer", args.model, args.llama_bin,
                      serve=serve)
    try:
        name = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        got = aiperf(args.aiperf, args.tokenizer, url, name, args.clients, args.stream, seed, requests=args.requests,
                     output_stddev=32, warmup=False)
        row = {"side": side, "seed": seed, "stream": args.stream, "tok_s": got["tok_s"],
               "latency_p50_s": got["latency_p50_ms"] / 1e3}
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    if side != "llama-server":
        steps = json.loads(calls.read_text())
        decode = [c for c in steps if c[2] <= args.clients]  # no prompt tokens in the call
        row.update(calls=len(steps), split_share=sum(c[3] > 1 for c in steps) / max(len(steps), 1),
                   decode_ms_mean=1e3 * statistics.mean(c[1] for c in decode) if decode else None)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", type=Path, required=True)
    ap.add_argument("--aiperf", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--stream", action="store_true", help="streamed requests (default: non-streamed)")
    ap.add_argument("--before", type=Path, default=None, help="another checkout's twinfer, run beside this one")
    args = ap.parse_args()
    args.model = args.model or Path(default_model_path())
    sides = ["twinfer", "llama-server", *(["twinfer-before"] if args.before else [])]
    with tempfile.TemporaryDirectory() as folder:
        for rnd in range(args.rounds):
            for side in sides[rnd % len(sides):] + sides[: rnd % len(sides)]:
                print(json.dumps(one(side, args, 7 + rnd, Path(folder))), flush=True)


if __name__ == "__main__":
    main()
