"""HTTP vs in-process at the same load: 16 clients x 8 requests, 64 prompt + 64 output tokens.

    python bench/bench_http.py [--threads 2] [--clients 16] [--requests 8]

Runs `twinfer bench` in-process, then `twinfer serve` (loop guard off, as the bench disables it
in-process) driven by `twinfer bench --url` with the same shape, alternating twice; prints one JSON
object with both and their ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_engine import twinfer_server  # noqa: E402

from twinfer.app import OpenOptions, open_session  # noqa: E402
from twinfer.app.bench import hardware_info, run_bench  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=8)
    args = ap.parse_args()
    runs = []
    for _ in range(2):
        session = open_session(OpenOptions(None, "llamacpp", max_seqs=args.clients, ctx=4096, threads=args.threads))
        local = run_bench(session, [args.clients], 64, 64, requests_per_client=args.requests)
        session.close()
        http = twinfer_server(args.threads, clients=args.clients, requests=args.requests)
        a = local["results"][0]["output_tokens_per_s"]
        b = http["results"][0]["output_tokens_per_s"]
        runs.append({"in_process_tok_s": a, "http_tok_s": b, "ratio": b / a,
                     "http_requests": http["results"][0]["requests"],
                     "http_output_tokens": http["results"][0]["output_tokens"]})
    print(json.dumps({"hardware": hardware_info(), "build": local["build"], "traffic": local["traffic"],
                      "runs": runs}, indent=1, default=str))


if __name__ == "__main__":
    main()
