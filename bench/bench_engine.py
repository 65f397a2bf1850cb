"""Engine benchmarks on the default model with the llama.cpp runner: single stream and continuous batching.

    python bench/bench_engine.py [--threads 2] [--skip-server] > result.json

1. single stream: `twinfer generate`'s path (engine + llama.cpp runner) vs llama-cpp-python's `Llama`
   on the same file, prompt, length and threads; torch and MLX backends' tokens/s alongside.
2. 16 streams, 64 prompt + 64 output tokens: `twinfer bench` vs the ceiling (the 16 prompts
   prefilled in one llama_decode, then one llama_decode per step for all 16, argmax in numpy).
3. the same load against llama-cpp-python's bundled server (`python -m llama_cpp.server`).
4. time to first token of a 1,600-token prompt whose first 1,536 tokens were already served.
Prints one JSON object with the hardware, build and traffic of each measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from typing import Any

import numpy as np

from twinfer.app import OpenOptions, open_session
from twinfer.app.bench import bench_prompts, build_info, hardware_info, run_bench
from twinfer.app.models import open_model
from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch
from twinfer.runtime.engine import Engine, EngineConfig, GuardConfig, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True, guard=GuardConfig(enabled=False))


def single_stream(threads: int, prompt_tokens: int = 64, gen: int = 128) -> dict[str, Any]:
    import llama_cpp

    out: dict[str, Any] = {"traffic": {"prompt_tokens": prompt_tokens, "output_tokens": gen, "threads": threads}}
    opened = open_model(None, "llamacpp", max_seqs=1, ctx=1024, threads=threads)
    prompt = bench_prompts(opened, 1, prompt_tokens, 0)[0]
    llm = llama_cpp.Llama(str(opened.path), n_ctx=1024, n_threads=threads, n_threads_batch=threads,
                          verbose=False, flash_attn=True)
    ours, theirs = [], []
    for _ in range(3):  # interleaved, best of three
        engine = Engine(opened.runner, opened.tokenizer, EngineConfig(max_seqs=1))
        r = engine.generate([prompt], SamplingParams(max_tokens=gen, **GREEDY))[0]
        ours.append((gen - 1) / (r.metrics["latency_s"] - r.metrics["ttft_s"]))
        engine.close()
        llm.reset()
        t1 = 0.0
        for n, _tok in enumerate(llm.generate(prompt, temp=0.0, reset=True), start=1):
            if n == 1:
                t1 = time.perf_counter()
            if n == gen:
                break
        theirs.append((gen - 1) / (time.perf_counter() - t1))
    out["twinfer_llamacpp_tok_s"] = max(ours)
    out["llama_cpp_python_tok_s"] = max(theirs)
    out["ratio"] = max(ours) / max(theirs)
    for backend in ("torch", "mlx"):
        try:
            ob = open_model(None, backend, max_seqs=1, ctx=1024, threads=threads)
            e = Engine(ob.runner, ob.tokenizer, EngineConfig(max_seqs=1))
            r = e.generate([prompt], SamplingParams(max_tokens=32, **GREEDY))[0]
            out[f"twinfer_{backend}_tok_s"] = 31 / (r.metrics["latency_s"] - r.metrics["ttft_s"])
            del ob, e
        except Exception as exc:  # noqa: BLE001 - report, don't stop the other measurements
            out[f"twinfer_{backend}_tok_s"] = f"failed: {exc}"
    out["build"] = build_info(opened)
    return out


def ceiling(opened: Any, prompts: list[list[int]], gen: int) -> float:
    """Perfect batching through the low-level API: one decode for all prefills, then one per step."""
    runner = opened.runner
    n = len(prompts)
    chunks = [SeqChunk(1000 + i, p, 0, logits=LogitsWanted.LAST) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()  # the same work as the engine: prefill included
    last = runner.step(StepBatch(chunks)).argmax(axis=1)
    for step in range(gen - 1):
        batch = StepBatch([SeqChunk(1000 + i, [int(last[i])], len(prompts[i]) + step) for i in range(n)])
        last = runner.step(batch).argmax(axis=1)
    rate = n * gen / (time.perf_counter() - t0)
    for i in range(n):
        runner.release(1000 + i)
    return rate


def concurrency16(threads: int) -> dict[str, Any]:
    session = open_session(OpenOptions(None, "llamacpp", max_seqs=16, ctx=16 * 160 + 256, threads=threads))
    opened = session.opened
    report = run_bench(session, [16], 64, 64, requests_per_client=2)
    prompts = bench_prompts(opened, 16, 64, 0)
    report["ceiling_tok_s"] = max(ceiling(opened, prompts, 64) for _ in range(2))
    report["ratio_to_ceiling"] = report["results"][0]["output_tokens_per_s"] / report["ceiling_tok_s"]
    return report


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def llama_cpp_server(threads: int, path: str) -> dict[str, Any]:
    """llama-cpp-python's bundled server at 16 concurrent clients, 64/64 tokens, completions API."""
    from twinfer.server.http_bench import HttpTraffic, run_http_bench

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", path, "--port", str(port),
                             "--n_threads", str(threads), "--n_ctx", "2048", "--interrupt_requests", "False"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import httpx

        for _ in range(120):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        # it knows no ignore_eos: ban Gemma's EOS (1) and <end_of_turn> (106) so every reply is 64 tokens
        ban = {"logit_bias": {"1": -100.0, "106": -100.0}}
        return run_http_bench(f"http://127.0.0.1:{port}", [16], 64, 64, requests_per_client=1, traffic=HttpTraffic(extra_body=ban))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def twinfer_server(threads: int, clients: int = 16, requests: int = 2) -> dict[str, Any]:
    """`twinfer serve` on the default model at `clients` concurrent HTTP clients, 64/64 tokens."""
    from twinfer.server.http_bench import run_http_bench

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "twinfer.cli.main", "serve", "--port", str(port),
                             "--threads", str(threads), "--max-seqs", str(clients), "--ctx", "4096", "--no-loop-guard"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import httpx

        for _ in range(240):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        return run_http_bench(f"http://127.0.0.1:{port}", [clients], 64, 64, requests_per_client=requests)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def prefix_ttft(threads: int) -> dict[str, Any]:
    opened = open_model(None, "llamacpp", max_seqs=4, ctx=4096, threads=threads)
    e = Engine(opened.runner, opened.tokenizer, EngineConfig(max_seqs=4, max_batch_tokens=512))
    shared = bench_prompts(opened, 1, 1537, 0)[0]
    tails = bench_prompts(opened, 3, 65, 0, corpus="code")
    params = SamplingParams(max_tokens=1, **GREEDY)
    cold = e.generate([shared + tails[0][1:]], params)[0]
    warm = e.generate([shared + tails[1][1:]], params)[0]
    return {"prompt_tokens": len(shared) + 64, "cached_tokens": warm.cached_tokens,
            "ttft_cold_s": cold.metrics["ttft_s"], "ttft_warm_s": warm.metrics["ttft_s"],
            "speedup": cold.metrics["ttft_s"] / warm.metrics["ttft_s"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-server", action="store_true")
    args = ap.parse_args()
    result: dict[str, Any] = {"hardware": hardware_info()}
    result["single_stream"] = single_stream(args.threads)
    result["concurrency16"] = concurrency16(args.threads)
    result["prefix_ttft"] = prefix_ttft(args.threads)
    result["twinfer_server"] = twinfer_server(args.threads)
    if not args.skip_server:
        from twinfer.runtime.loaders import default_model_path

        result["llama_cpp_server"] = llama_cpp_server(args.threads, str(default_model_path()))
        ours = result["concurrency16"]["results"][0]["output_tokens_per_s"]
        result["ratio_to_llama_cpp_server"] = ours / result["llama_cpp_server"]["results"][0]["output_tokens_per_s"]
    print(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    np.seterr(all="ignore")
    main()
