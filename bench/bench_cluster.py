"""`twinfer cluster` under two workloads, through the real gateway (smg) on loopback.

    python bench/bench_cluster.py [--tenants 8] [--turns 4] [--system-tokens 1000] [--clients 32]
                                  [--out docs/data/cluster-run.json]

1. Shared-prefix tenants: each tenant has its own ~1,000-token system prompt (text of the stdlib's
   language reference) and talks for `--turns` turns; within a turn the tenants' requests come in a
   shuffled order (fixed seed), one at a time, so a round-robin gateway sends a tenant to either
   replica. Mean TTFT of turns 2.. with `cache_aware` vs `round_robin` through `twinfer cluster
   --replicas 2`, with the prompt tokens served from the prefix cache
   (`usage.prompt_tokens_details.cached_tokens`, read from each streamed response's usage chunk).
2. Aggregate throughput: `--clients` concurrent clients, short distinct prompts, `--max-tokens` each,
   through 1 replica (all cores) and 2 replicas (the cores split between them).

Prints one JSON object (hardware, engine build, traffic shape, results) and writes it to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from twinfer.app.cluster import Cluster, ClusterConfig, http_status

MODEL = "gemma-3-270m-q4_k_m"


def system_prompts(n: int, approx_tokens: int) -> list[str]:
    """`n` distinct system prompts of about `approx_tokens` tokens (about 4 characters a token)."""
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics))
    size = approx_tokens * 4
    return [f"You are assistant {i} for tenant {i}. Reference manual follows.\n" + text[i * size:(i + 1) * size]
            for i in range(n)]


def stream_chat(url: str, messages: list[dict[str, str]], max_tokens: int, timeout_s: float = 300) -> dict[str, Any]:
    """One streamed chat completion: TTFT, the reply, and usage (with cached tokens)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    with urllib.request.urlopen(req, timeout=timeout_s) as r:  # noqa: S310 - loopback
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(piece)
            usage = chunk.get("usage") or usage
    return {"ttft_s": ttft, "latency_s": time.perf_counter() - t0, "text": "".join(text), "usage": usage}


def replica_counters(cluster: Cluster) -> list[dict[str, float]]:
    out = []
    for r in cluster.replicas:
        body = http_status(f"{r.url}/metrics")[1].decode()
        row = {}
        for name in ("twinfer_prompt_tokens_total", "twinfer_prompt_cached_tokens_total"):
            line = next((x for x in body.splitlines() if x.startswith(name + " ")), None)
            row[name] = float(line.split()[1]) if line else 0.0
        out.append(row)
    return out


def tenants_run(cluster: Cluster, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    systems = system_prompts(args.tenants, args.system_tokens)
    history = [[{"role": "system", "content": s}] for s in systems]
    rows = []
    for turn in range(args.turns):
        order = list(range(args.tenants))
        rng.shuffle(order)
        for t in order:
            history[t].append({"role": "user", "content": f"Turn {turn + 1}: summarize section {turn + 1} briefly."})
            res = stream_chat(cluster.url, history[t], args.reply_tokens)
            history[t].append({"role": "assistant", "content": res["text"]})
            usage = res["usage"] or {}
            rows.append({"turn": turn + 1, "tenant": t, "ttft_s": res["ttft_s"],
                         "prompt_tokens": usage.get("prompt_tokens"),
                         "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")})
    later = [r for r in rows if r["turn"] > 1 and r["ttft_s"] is not None]
    return {"requests": rows, "mean_ttft_after_first_turn_s": statistics.fmean(r["ttft_s"] for r in later),
            "mean_ttft_first_turn_s": statistics.fmean(r["ttft_s"] for r in rows if r["turn"] == 1 and r["ttft_s"]),
            "cached_tokens_after_first_turn": sum(r["cached_tokens"] or 0 for r in later),
            "prompt_tokens_after_first_turn": sum(r["prompt_tokens"] or 0 for r in later),
            "replica_metrics": replica_counters(cluster)}


def warm_up(cluster: Cluster) -> None:
    """One short request to each replica directly, so no timed request pays for a cold start."""
    for r in cluster.replicas:
        stream_chat(r.url, [{"role": "user", "content": "Warm up."}], 4)


def throughput_run(cluster: Cluster, args: argparse.Namespace) -> dict[str, Any]:
    warm_up(cluster)
    per_client = max(1, args.requests // args.clients)
    tokens = [0] * args.clients
    errors: list[str] = []

    def client(i: int) -> None:
        for j in range(per_client):
            msgs = [{"role": "user", "content": f"Client {i} request {j}: write a few sentences about rivers."}]
            try:
                res = stream_chat(cluster.url, msgs, args.max_tokens)
                tokens[i] += (res["usage"] or {}).get("completion_tokens", 0)
            except Exception as e:  # noqa: BLE001 - reported in the result
                errors.append(f"{type(e).__name__}: {e}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    wall = time.perf_counter() - t0
    return {"clients": args.clients, "requests": per_client * args.clients, "completion_tokens": sum(tokens),
            "wall_s": wall, "tokens_per_s": sum(tokens) / wall, "errors": errors[:5], "num_errors": len(errors)}


def start(args: argparse.Namespace, replicas: int, policy: str, threads: int) -> Cluster:
    cfg = ClusterConfig(args.model, replicas=replicas, policy=policy, port=0, threads=threads, ctx=args.ctx,
                        max_seqs=args.max_seqs, log_dir=Path(args.log_dir))
    return Cluster(cfg)  # started by `with`


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--reply-tokens", type=int, default=16)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--cores", type=int, default=2, help="compute threads in all (split among the replicas)")
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--max-seqs", type=int, default=16)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--log-dir", default="/tmp/twinfer-bench-cluster")
    ap.add_argument("--out", default="docs/data/cluster-run.json")
    args = ap.parse_args()
    import llama_cpp

    result: dict[str, Any] = {
        "hardware": {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
                     "cpus": os.cpu_count(), "load_before": os.getloadavg()},
        "engine": {"twinfer_runner": "llamacpp", "llama_cpp_python": llama_cpp.__version__,
                   "gateway": "smg " + _version("smg"), "python": sys.version.split()[0]},
        "traffic": {k: v for k, v in vars(args).items() if k not in ("out", "log_dir")},
    }
    partial = Path(args.out).with_suffix(".partial.json")
    for policy in ("cache_aware", "round_robin"):
        with start(args, 2, policy, max(1, args.cores // 2)) as cluster:
            result[f"tenants_{policy}"] = tenants_run(cluster, args)
            if policy == "round_robin" and not args.skip_throughput:
                result["throughput_2_replicas"] = throughput_run(cluster, args)
        partial.write_text(json.dumps(result, indent=1) + "\n")  # a later failure keeps what was measured
    if not args.skip_throughput:
        with start(args, 1, "round_robin", args.cores) as cluster:
            result["throughput_1_replica"] = throughput_run(cluster, args)
    ca, rr = result["tenants_cache_aware"], result["tenants_round_robin"]
    result["ttft_ratio_round_robin_over_cache_aware"] = (rr["mean_ttft_after_first_turn_s"]
                                                          / ca["mean_ttft_after_first_turn_s"])
    if not args.skip_throughput:
        result["throughput_ratio_2_over_1"] = (result["throughput_2_replicas"]["tokens_per_s"]
                                               / result["throughput_1_replica"]["tokens_per_s"])
    result["hardware"]["load_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    summary = {k: v for k, v in result.items() if not k.startswith(("tenants_", "throughput_"))}
    for policy in ("cache_aware", "round_robin"):
        t = result[f"tenants_{policy}"]
        summary[policy] = {k: t[k] for k in t if k not in ("requests", "replica_metrics")}
    for k in ("throughput_1_replica", "throughput_2_replicas"):
        if k in result:
            summary[k] = {x: result[k][x] for x in ("tokens_per_s", "completion_tokens", "wall_s", "num_errors")}
    print(json.dumps(summary, indent=1))


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    main()
