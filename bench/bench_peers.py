"""twinfer at its defaults against llama.cpp's own tools, side by side in one run (no --threads anywhere).

    python bench/bench_peers.py --llama-bin /path/to/llama.cpp/build/bin [--only single,batch,serve]

Build the peers from the llama-cpp-python sdist's vendored llama.cpp (docs/benchmarks.md says how).
Three pairs, interleaved `--rounds` times (default 3); the ratios are the median of the per-round
ratios (each round runs both sides back to back; the HTTP pair swaps its order every other round),
with the ratio of the two sides' means and the best-of-each-side ratio beside them:
1. single stream: `twinfer bench -c 1` (64-token prompt, 128 tokens) vs `llama-bench -p 0 -n 128` (tg128);
2. 16 streams: `twinfer bench -c 16 -p 64 -o 64` vs the perfect-batching ceiling (bench_engine.ceiling);
3. HTTP: `twinfer serve` vs `llama-server -np 16`, both driven by `twinfer bench --url` (16 clients,
   ~100-token prompts, 64 streamed tokens, ignore_eos), at the thread count each picks by default.
4. the planner: `twinfer plan` vs `twinfer bench -c 1` at 64- and 4,096-token prompts (decode and TTFT),
   once, or at the start of each of the first `--plan-rounds` rounds with the median errors over them.
Prints one JSON object with every figure, the ratios and the build/hardware context.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from bench_engine import _free_port, bench_prompts, ceiling  # noqa: E402

from twinfer.app import OpenOptions, open_session  # noqa: E402
from twinfer.app.bench import hardware_info  # noqa: E402
from twinfer.backends.llamacpp.amx import amx_verdict  # noqa: E402
from twinfer.runtime.cpu import default_threads  # noqa: E402
from twinfer.runtime.loaders import default_model_path  # noqa: E402


def peer(cmd: list[str]) -> list[str]:
    """A llama.cpp tool's command line, run with AMX requests failing where twinfer found llama.cpp's AMX
    kernels crash on this machine (twinfer/backends/llamacpp/amx.py): the tools built from the same source
    crash there too (SIGILL in `tinygemm_kernel_amx`), and both sides then run the same repacked kernels."""
    if amx_verdict() == "off":
        return [sys.executable, "-m", "twinfer.backends.llamacpp.amx", "--deny", "--", *cmd]
    return cmd


def llama_bench_cmd(bin_dir: Path, model: Path) -> list[str]:
    """`llama-bench` tg128 at its defaults, JSON out."""
    return peer([str(bin_dir / "llama-bench"), "-m", str(model), "-p", "0", "-n", "128", "-o", "json"])


def llama_bench(bin_dir: Path, model: Path) -> float:
    out = subprocess.run(llama_bench_cmd(bin_dir, model), capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    return float(rows[0]["avg_ts"])


def twinfer_cli_bench(*args: str) -> dict[str, Any]:
    """`twinfer bench ARGS --json` exactly as a user types it; its one result row."""
    out = subprocess.run([sys.executable, "-m", "twinfer.cli.main", "bench", *args, "--json"],
                         capture_output=True, text=True, check=True).stdout
    return dict(json.loads(out)["results"][0])


def twinfer_single(model: Path | None = None) -> dict[str, float]:
    r = twinfer_cli_bench(*([str(model)] if model else []), "-c", "1")
    return {"twinfer_bench_c1_tok_s": r["output_tokens_per_s"], "twinfer_bench_c1_decode_tok_s": 1 / r["tpot_p50_s"]}


def perfect_batching_ceiling() -> float:
    """llama.cpp through the low-level API with perfect batching, at the runner's default threads."""
    session = open_session(OpenOptions(None, "llamacpp", max_seqs=16, ctx=16 * 160 + 256))
    try:
        prompts = bench_prompts(session.opened, 16, 64, 0)
        return max(ceiling(session.opened, prompts, 64) for _ in range(2))
    finally:
        session.close()


def _serve(cmd: list[str], port: int, env: dict[str, str] | None = None) -> dict[str, Any]:
    import httpx

    from twinfer.server.http_bench import run_http_bench

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, **env} if env else None)
    try:
        for _ in range(240):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:  # ready, model loaded
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        return run_http_bench(f"http://127.0.0.1:{port}", [16], 100, 64, requests_per_client=2)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def serve_tok_s(result: dict[str, Any]) -> float:
    """Output tokens a second of one `_serve` run (its one concurrency level)."""
    return float(result["results"][0]["output_tokens_per_s"])


def serve_rounds(sides: dict[str, Callable[[], dict[str, Any]]], rounds: int) -> list[dict[str, Any]]:
    """`rounds` rounds of `_serve` runs, one per side, in an order that rotates every round (drift in the
    host's speed during a round then does not always favour the same side): each side's output tok/s
    and TTFT p50, and the order; each round is printed to stderr as it ends."""
    names, rows = list(sides), []
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        row: dict[str, Any] = {"order": order}
        for name in order:
            result = sides[name]()
            row[name] = serve_tok_s(result)
            row[name + "_ttft_p50_s"] = result["results"][0]["ttft_p50_s"]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def twinfer_serve(env: dict[str, str] | None = None, flags: tuple[str, ...] = ()) -> dict[str, Any]:
    """The HTTP traffic through `twinfer serve` with no flag but the port (16 sequences and 4,096 tokens
    are serve's defaults, and the loop guard is off for this ignore-EOS traffic as EOS is), in `env`;
    `flags` are for scripts that compare a flag against the defaults."""
    port = _free_port()
    return _serve([sys.executable, "-m", "twinfer.cli.main", "serve", "--port", str(port), *flags], port, env)


def llama_server(bin_dir: Path, model: Path, flags: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> dict[str, Any]:
    """The same traffic through `llama-server` with 16 slots of 4,096 tokens (`flags` and `env` for
    scripts that tune it)."""
    port = _free_port()
    return _serve(peer([str(bin_dir / "llama-server"), "-m", str(model), "--port", str(port), "-np", "16",
                        "-c", str(16 * 4096), "--no-webui", *flags]), port, env)


def serve_pair(bin_dir: Path, model: Path, theirs_first: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """One round of the HTTP pair; `theirs_first` swaps the order (rounds alternate, so drift in the
    host's speed during a round does not always favour the same side)."""
    if theirs_first:
        b = llama_server(bin_dir, model)
        return twinfer_serve(), b
    a = twinfer_serve()
    return a, llama_server(bin_dir, model)


def plan_vs_bench(model: str | None = None, prompts: tuple[int, ...] = (64, 4096)) -> list[dict[str, Any]]:
    """`twinfer plan` (this machine, bandwidth measured once) against `twinfer bench` at the same shape:
    by default the default model at a 64-token prompt (the bench default) and a 4,096-token one (the
    plan default); `model` (a GGUF path) and `prompts` for another model."""
    hw = json.loads(subprocess.run([sys.executable, "-m", "twinfer.cli.main", "hw", "--measure", "--json"], check=True,
                                   capture_output=True, text=True).stdout)
    rows = []
    named = [model] if model else []
    for prompt in prompts:  # the plan prices a prompt of `context` tokens
        context = prompt
        plan = json.loads(subprocess.run([sys.executable, "-m", "twinfer.cli.main", "plan", *named, "--context",
                                          str(context), "--json"], capture_output=True, text=True, check=True).stdout)
        # a 64-token prefill takes ~0.2 s, so its median needs more requests than the 4,096-token one
        r = twinfer_cli_bench(*named, "-c", "1", "-p", str(prompt), "-o", "64", "--requests-per-client",
                              "6" if prompt < 1024 else "2")
        rows.append({"prompt_tokens": prompt, "context": context, "kv_format": plan["kv_format"],
                     "predicted_decode_tok_s": plan["predicted"]["decode_tokens_per_s"],
                     "measured_decode_tok_s": 1 / r["tpot_p50_s"],
                     "predicted_ttft_s": plan["predicted"]["ttft_s"], "measured_ttft_s": r["ttft_p50_s"],
                     "hw_measured": hw["measured"]})  # the read bandwidth the plan used, the f32 GEMM rate
    return rows


def plan_error_medians(rounds: list[list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per prompt length, the plan's decode and TTFT errors (predicted / measured - 1) round by round,
    and their medians."""
    out: dict[str, dict[str, Any]] = {}
    for i, row in enumerate(rounds[0]):
        for what in ("decode_tok_s", "ttft_s"):
            errors = [r[i]["predicted_" + what] / r[i]["measured_" + what] - 1 for r in rounds]
            out[f"{row['prompt_tokens']}:{what}"] = {"per_round": errors, "median": statistics.median(errors)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-bin", type=Path, required=True, help="folder holding llama-bench and llama-server")
    ap.add_argument("--only", default="plan,single,batch,serve")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of each pair")
    ap.add_argument("--plan-rounds", type=int, default=1,
                    help="plan-vs-bench comparisons, each with a fresh bandwidth measurement, at the start of "
                         "the first rounds (the median error over them is reported)")
    ap.add_argument("--plan-model", default=None,
                    help="plan and bench this GGUF instead of the default model (e.g. bench/make_random_gguf.py's)")
    ap.add_argument("--plan-prompts", default="64,4096", help="prompt lengths of the plan comparison")
    ap.add_argument("--model", type=Path, default=None, help="the single-stream pair's GGUF (default: the embedded model)")
    args = ap.parse_args()
    model = args.model or default_model_path()
    parts = set(args.only.split(","))
    out: dict[str, Any] = {"hardware": hardware_info(), "default_threads": default_threads(),
                           "model": model.name, "llamacpp_amx": amx_verdict(),
                           "plan_model": Path(args.plan_model).name if args.plan_model else model.name}
    plan_rounds: list[list[dict[str, Any]]] = []
    for round_no in range(max(args.rounds, args.plan_rounds if "plan" in parts else 0)):
        if "plan" in parts and round_no < args.plan_rounds:
            plan_rounds.append(plan_vs_bench(args.plan_model,
                                             tuple(int(p) for p in args.plan_prompts.split(","))))
        if round_no >= args.rounds:
            continue
        if "single" in parts:  # the two sides swap places every other round, as the HTTP pair does
            sides = [lambda: twinfer_single(args.model),
                     lambda: {"llama_bench_tg128_tok_s": llama_bench(args.llama_bin, model)}]
            row: dict[str, Any] = {"twinfer_first": round_no % 2 == 0}
            for side in sides if round_no % 2 == 0 else sides[::-1]:
                row.update(side())
            out.setdefault("single", []).append(row)
        if "batch" in parts:
            ours = twinfer_cli_bench("-c", "16", "-p", "64", "-o", "64")["output_tokens_per_s"]
            out.setdefault("batch", []).append({"twinfer_bench_c16_tok_s": ours,
                                                "ceiling_tok_s": perfect_batching_ceiling()})
        if "serve" in parts:
            ours, theirs = serve_pair(args.llama_bin, model, theirs_first=round_no % 2 == 1)
            out.setdefault("serve", []).append({"twinfer_serve_tok_s": serve_tok_s(ours),
                                                "llama_server_tok_s": serve_tok_s(theirs),
                                                "twinfer_server": ours.get("server"),
                                                "llama_server": theirs.get("server")})
    if plan_rounds:
        out["plan_vs_bench"] = plan_rounds[0]
        out["plan_rounds"] = plan_rounds
        out["plan_error_medians"] = plan_error_medians(plan_rounds)
    best = {k: {f: max(r[f] for r in rows if isinstance(r[f], float)) for f in rows[0] if isinstance(rows[0][f], float)}
            for k, rows in out.items() if k in ("single", "batch", "serve")}
    out["best"] = best
    pairs = {"bench_c1_decode_vs_llama_bench": ("single", "twinfer_bench_c1_decode_tok_s", "llama_bench_tg128_tok_s"),
             "bench_c1_output_vs_llama_bench": ("single", "twinfer_bench_c1_tok_s", "llama_bench_tg128_tok_s"),
             "bench_c16_vs_ceiling": ("batch", "twinfer_bench_c16_tok_s", "ceiling_tok_s"),
             "serve_vs_llama_server": ("serve", "twinfer_serve_tok_s", "llama_server_tok_s")}
    ratios: dict[str, Any] = {}
    for name, (part, ours_key, theirs_key) in pairs.items():
        if part in best:
            per_round = [r[ours_key] / r[theirs_key] for r in out[part]]  # in round order
            ratios[name] = {"median": statistics.median(per_round), "per_round": per_round,
                            "mean_vs_mean": statistics.mean(r[ours_key] for r in out[part])
                            / statistics.mean(r[theirs_key] for r in out[part]),
                            "best_vs_best": best[part][ours_key] / best[part][theirs_key]}
    out["ratios"] = ratios
    print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
