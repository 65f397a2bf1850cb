"""JSON-schema-constrained streams vs unconstrained ones through `twinfer serve` on the default model.

    python bench/bench_structured.py [--threads 2] [--clients 16] [--requests 2] [--rounds 2]

One `twinfer serve` (default model, its defaults, loop guard off); `--clients` closed-loop streaming
clients (64 prompt tokens, up to 64 output tokens, greedy), first unconstrained, then with a JSON
schema on every request (`json_schema`, llama-server's spelling, which /v1/completions takes),
alternating `--rounds` times. Prints one JSON object: each run, the mean ratio of constrained to
unconstrained output tokens/s, and the machine's load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

from twinfer.server.http_bench import HttpTraffic, run_http_bench

# Room for about 64 tokens of output: a list of short strings the grammar keeps open.
SCHEMA = {"type": "object", "properties": {"words": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                     "minItems": 40, "maxItems": 60}},
          "required": ["words"], "additionalProperties": False}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _counters(url: str) -> dict[str, float]:
    """The grammar-mask counters from the server's /metrics (Prometheus text)."""
    import httpx

    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("twinfer_mask_seconds_total", "twinfer_mask_steps_total", "twinfer_engine_steps_total"):
            out[name] = float(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None, help="default: twinfer serve's own default")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    port = _free_port()
    cmd = [sys.executable, "-m", "twinfer.cli.main", "serve", "--port", str(port), "--max-seqs", str(args.clients),
           "--ctx", "4096", "--no-loop-guard"]
    if args.threads is not None:
        cmd += ["--threads", str(args.threads)]
    load_before = os.getloadavg()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import httpx

        url = f"http://127.0.0.1:{port}"
        for _ in range(480):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        runs: list[dict[str, Any]] = []
        for _ in range(args.rounds):
            for name, extra in (("unconstrained", {}), ("json_schema", {"json_schema": SCHEMA})):
                before = _counters(url)
                r = run_http_bench(url, [args.clients], 64, 64, requests_per_client=args.requests, traffic=HttpTraffic(extra_body=extra))
                after = _counters(url)
                delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                masked = delta.get("twinfer_mask_steps_total", 0.0)
                res = r["results"][0]
                runs.append({"mode": name, "output_tokens_per_s": res["output_tokens_per_s"],
                             "output_tokens": res["output_tokens"], "requests": res["requests"],
                             "tpot_p50_s": res["tpot_p50_s"], "ttft_p50_s": res["ttft_p50_s"], "build": r["build"],
                             "engine_steps": delta.get("twinfer_engine_steps_total", 0.0), "masked_steps": masked,
                             "mask_ms_per_masked_step": 1e3 * delta.get("twinfer_mask_seconds_total", 0.0) / masked
                             if masked else 0.0})
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    free = [r["output_tokens_per_s"] for r in runs if r["mode"] == "unconstrained"]
    held = [r["output_tokens_per_s"] for r in runs if r["mode"] == "json_schema"]
    print(json.dumps({"clients": args.clients, "runs": runs,
                      "ratio_constrained_to_unconstrained": (sum(held) / len(held)) / (sum(free) / len(free)),
                      "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "cpus": os.cpu_count()},
                     indent=1))


if __name__ == "__main__":
    main()
