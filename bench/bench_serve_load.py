"""`twinfer serve` against `llama-server -np 16` as users drive them: both at their defaults, an established
load generator (NVIDIA's AIPerf) and the repository's own light client, streamed and non-streamed, at
1, 16 and 64 closed-loop clients, ~100-token prompts, 64 new tokens with `ignore_eos`, no sampling
parameters (each server's own defaults).

    python bench/bench_serve_load.py --llama-bin DIR [--model M.gguf] [--rounds 3] [--aiperf PATH]
        [--tokenizer DIR] [--clients 16] [--once-clients 1,64] [--prompt-words 100] [--out FILE.json]
        [--generators light,aiperf] [--modes plain,stream]

Each round starts both servers fresh and runs every shape on one and then on the other, back to back
(the first alternates by shape and round), so each pair is measured within a minute. `--clients` run every round, `--once-clients` in the first round only. AIPerf runs
in its own virtual environment (`python -m venv V && V/bin/pip install aiperf`), with a Hugging Face
tokenizer folder for token counts (`--tokenizer`; `transformers` writes one from the GGUF:
`AutoTokenizer.from_pretrained(dir, gguf_file=name).save_pretrained(out)`). Prints one JSON object:
every run, and per shape the median over rounds of twinfer / llama-server.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from bench_engine import _free_port  # noqa: E402
from bench_peers import peer  # noqa: E402

from twinfer.app.bench import hardware_info  # noqa: E402
from twinfer.runtime.loaders import default_model_path  # noqa: E402
from twinfer.server.http_bench import HttpTraffic, run_http_bench  # noqa: E402

PROMPT_TOKENS, OUTPUT_TOKENS = 100, 64


TWINFER_SERVE = (sys.executable, "-m", "twinfer.cli.main", "serve")


def start(side: str, model: Path, bin_dir: Path,
          serve: tuple[str, ...] = TWINFER_SERVE) -> tuple[subprocess.Popen[bytes], str]:
    """One server at its defaults (llama-server: 16 slots of 4,096 tokens, as `twinfer serve`); `serve`:
    the command that starts twinfer's, before its model and port."""
    import httpx

    port = _free_port()
    if side == "twinfer":
        cmd = [*serve, str(model), "--port", str(port)]
    else:
        cmd = peer([str(bin_dir / "llama-server"), "-m", str(model), "--port", str(port), "-np", "16",
                    "-c", str(16 * 4096), "--no-webui"])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"{side} exited with {proc.returncode} before it served")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"{side} did not come up")


TOTAL_REQUESTS = 64  # --requests


def set_total(requests: int) -> None:
    global TOTAL_REQUESTS
    TOTAL_REQUESTS = requests


def per_client(clients: int) -> int:
    """Requests each client sends: at most 4, about TOTAL_REQUESTS in all, at least one."""
    return max(1, min(4, TOTAL_REQUESTS // clients))


def light(url: str, clients: int, stream: bool, words: int, seed: int) -> dict[str, Any]:
    traffic = HttpTraffic(stream=stream, greedy=False, prompt_seed=seed)
    r = run_http_bench(url, [clients], words, OUTPUT_TOKENS, requests_per_client=per_client(clients),
                       traffic=traffic)["results"][0]
    return {"tok_s": r["output_tokens_per_s"], "client_cpu_s": r["client_cpu_s"], "wall_s": r["wall_s"],
            "ttft_p50_s": r["ttft_p50_s"], "requests": r["requests"], "prompt_tokens": r["prompt_tokens_mean"]}


def aiperf(exe: str, tokenizer: str, url: str, model: str, clients: int, stream: bool, seed: int, *,
           requests: int | None = None, output_stddev: int = 0, warmup: bool = True) -> dict[str, Any]:
    """One AIPerf run: `requests` (default: per_client each) of 100-token prompts, 64 +- `output_stddev` tokens."""
    left = set(Path(tempfile.gettempdir()).glob("aiperf_mmap_*"))  # AIPerf leaves these behind
    with tempfile.TemporaryDirectory() as out:
        cmd = [exe, "profile", "--model-names", model, "--url", url, "--endpoint-type", "completions",
               "--concurrency", str(clients), "--request-count", str(requests or clients * per_client(clients)),
               *(["--warmup-request-count", str(min(clients, 4))] if warmup else []),
               "--prompt-input-tokens-mean", str(PROMPT_TOKENS), "--prompt-input-tokens-stddev", "0",
               "--prompt-output-tokens-mean", str(OUTPUT_TOKENS), "--prompt-output-tokens-stddev", str(output_stddev),
               "--extra-inputs", "ignore_eos:true", "--use-server-token-count", "--tokenizer", tokenizer, "--output-artifact-dir", out,
               "--ui-type", "none", "--random-seed", str(seed), "--no-server-metrics", "--no-gpu-telemetry",
               *(["--streaming"] if stream else [])]
        started = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        files = list(Path(out).rglob("profile_export_aiperf.json"))
        if done.returncode != 0 or not files:
            raise SystemExit(f"aiperf failed ({done.returncode}): {done.stderr[-2000:]}")
        stats = json.loads(files[0].read_text())
    for folder in set(Path(tempfile.gettempdir()).glob("aiperf_mmap_*")) - left:
        shutil.rmtree(folder, ignore_errors=True)
    throughput = stats.get("output_token_throughput") or {}
    ttft, latency = stats.get("time_to_first_token") or {}, stats.get("request_latency") or {}
    return {"tok_s": throughput.get("avg"), "ttft_p50_ms": ttft.get("p50"), "latency_p50_ms": latency.get("p50"),
            "requests": (stats.get("request_count") or {}).get("avg"), "run_s": time.perf_counter() - started}


def shapes(clients: list[int], with_aiperf: bool, generators: str = "light,aiperf",
           modes: str = "plain,stream") -> list[tuple[int, bool, str]]:
    """(clients, streamed, generator) of one round, in the order they run."""
    gens = [g for g in generators.split(",") if g == "light" or (g == "aiperf" and with_aiperf)]
    streams = [m == "stream" for m in modes.split(",")]
    return [(c, stream, g) for c in clients for stream in streams for g in gens]


def measure(side: str, url: str, args: argparse.Namespace, shape: tuple[int, bool, str], model: str,
            rnd: int) -> dict[str, Any]:
    c, stream, generator = shape
    seed = 1 + rnd * 1000 + c * 2 + stream  # each shape its own prompts, the same for both servers
    if generator == "light":
        got = light(url, c, stream, args.prompt_words, seed)
    else:
        got = aiperf(args.aiperf, args.tokenizer, url, model, c, stream, seed)
    row = {"side": side, "clients": c, "stream": stream, "generator": generator, "round": rnd, **got}
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def serve_round(args: argparse.Namespace, clients: list[int], rnd: int) -> list[dict[str, Any]]:
    """Both servers started fresh and left up for the round; every shape runs on one then at once on the
    other (which goes first alternates by shape and round), so a pair is seconds apart, not the minutes a
    round takes: this host's speed drifts by a fifth within minutes."""
    import httpx

    servers = {side: start(side, args.model, args.llama_bin) for side in ("twinfer", "llama-server")}
    rows = []
    try:
        model = {side: httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
                 for side, (_, url) in servers.items()}
        for i, shape in enumerate(shapes(clients, bool(args.aiperf) and rnd < args.aiperf_rounds,
                                          args.generators, args.modes)):
            order = ("twinfer", "llama-server") if (i + rnd) % 2 == 0 else ("llama-server", "twinfer")
            rows += [measure(side, servers[side][1], args, shape, model[side], rnd) for side in order]
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    return rows


def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per shape (generator, clients, stream): every round's twinfer / llama-server, and their median."""
    out: dict[str, Any] = {}
    keys = {(r["generator"], r["clients"], r["stream"], r["round"]) for r in rows}
    for g, c, s, rnd in sorted(keys):
        pair = {r["side"]: r["tok_s"] for r in rows if (r["generator"], r["clients"], r["stream"], r["round"]) == (g, c, s, rnd)}
        if pair.get("twinfer") and pair.get("llama-server"):
            out.setdefault(f"{g} c={c} {'stream' if s else 'plain'}", []).append(pair["twinfer"] / pair["llama-server"])
    return {k: {"rounds": [round(x, 3) for x in v], "median": round(statistics.median(v), 3)} for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", type=Path, required=True)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", default="16")
    ap.add_argument("--once-clients", default="1,64")
    ap.add_argument("--aiperf", default=None, help="the aiperf executable (omit: the light client only)")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--aiperf-rounds", type=int, default=1_000_000, help="AIPerf runs in the first N rounds only")
    ap.add_argument("--prompt-words", type=int, default=PROMPT_TOKENS,
                    help="the light client's prompt length in words (about a token each with a real tokenizer)")
    ap.add_argument("--generators", default="light,aiperf", help="which of light,aiperf run (aiperf needs --aiperf)")
    ap.add_argument("--modes", default="plain,stream", help="which of plain (non-streamed),stream run")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--requests", type=int, default=TOTAL_REQUESTS, help="about this many requests a shape")
    args = ap.parse_args()
    for flag, given, known in (("--generators", args.generators, {"light", "aiperf"}),
                               ("--modes", args.modes, {"plain", "stream"})):
        if not set(given.split(",")) <= known:
            ap.error(f"{flag} takes a comma-separated subset of {','.join(sorted(known))}, not {given!r}")
    set_total(args.requests)
    args.model = args.model or Path(default_model_path())
    every = [int(c) for c in args.clients.split(",") if c]
    once = [int(c) for c in args.once_clients.split(",") if c]
    rows: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        rows += serve_round(args, sorted(set(every + (once if rnd == 0 else []))), rnd)
    report = {"hardware": hardware_info(), "model": str(args.model), "prompt_tokens": PROMPT_TOKENS,
              "output_tokens": OUTPUT_TOKENS, "runs": rows, "ratios": ratios(rows)}
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
