"""Single-stream greedy decode speed: LlamaCppRunner vs llama-cpp-python's high-level `Llama`.

Same GGUF, prompt, generation length and thread count; prints one JSON line with the hardware and
build context. The runner returns full-vocabulary logits to Python every step (as the engine needs)
and takes the argmax in numpy; `Llama.generate` samples inside llama.cpp.

    PYTHONPATH=. python bench/bench_llamacpp_runner.py [--model PATH] [--threads N] [--gen 64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

from twinfer.backends.llamacpp import LlamaCppOptions, LlamaCppRunner
from twinfer.backends.llamacpp.runner import default_threads
from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch
from twinfer.runtime.cpu import cpu_model
from twinfer.runtime.loaders import default_model_path

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 4


def bench_runner(path: Path, prompt: list[int], gen: int, threads: int, **kw: Any) -> dict[str, Any]:
    with LlamaCppRunner(path, LlamaCppOptions(n_ctx=2048, max_seqs=1, n_threads=threads, **kw)) as runner:
        t0 = time.perf_counter()
        logits = runner.step(StepBatch([SeqChunk(0, prompt, 0, logits=LogitsWanted.LAST)]))
        out = [int(logits[0].argmax())]
        t1 = time.perf_counter()
        for i in range(gen - 1):
            logits = runner.step(StepBatch([SeqChunk(0, [out[-1]], len(prompt) + i)]))
            out.append(int(logits[0].argmax()))
        t2 = time.perf_counter()
        desc = runner.describe()
    return {
        "prefill_tok_s": len(prompt) / (t1 - t0),
        "decode_tok_s": (gen - 1) / (t2 - t1),
        "tokens": out,
        "settings": {k: desc[k] for k in ("flash_attn", "repack", "n_batch")},
    }


def bench_llama(path: Path, prompt: list[int], gen: int, threads: int, flash_attn: bool) -> dict[str, Any]:
    import llama_cpp

    llm = llama_cpp.Llama(
        str(path),
        n_ctx=2048,
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=flash_attn,
        verbose=False,
    )
    try:
        t0 = time.perf_counter()
        out: list[int] = []
        for tok in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0):
            out.append(int(tok))
            if len(out) == 1:
                t1 = time.perf_counter()
            if len(out) == gen:
                break
        t2 = time.perf_counter()
    finally:
        llm.close()
    return {
        "prefill_tok_s": len(prompt) / (t1 - t0),
        "decode_tok_s": (gen - 1) / (t2 - t1),
        "tokens": out,
        "settings": {"flash_attn": flash_attn, "repack": True, "n_batch": 512},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3, help="runs per config; the median is reported")
    ap.add_argument("--repack", action="store_true", help="also time the runner with CPU weight repacking")
    args = ap.parse_args()
    path = args.model or default_model_path()

    import llama_cpp

    from twinfer.backends.llamacpp._lib import load_llama_cpp, set_quiet

    set_quiet(load_llama_cpp(), True)  # the tokenizer-only Llama below would log a context warning
    vocab = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    prompt = vocab.tokenize(PROMPT.encode(), add_bos=True)
    vocab.close()

    configs = {
        "runner": lambda: bench_runner(path, prompt, args.gen, args.threads),
        "llama_high_level": lambda: bench_llama(path, prompt, args.gen, args.threads, flash_attn=True),
    }
    if args.repack:
        configs["runner_repack"] = lambda: bench_runner(path, prompt, args.gen, args.threads, repack=True)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    for _ in range(args.repeat):  # interleaved, so background load hits every config alike
        for name, fn in configs.items():
            runs[name].append(fn())
    reference_tokens = runs["llama_high_level"][0]["tokens"]
    results = {
        name: {
            "prefill_tok_s": round(float(np.median([r["prefill_tok_s"] for r in rs])), 1),
            "decode_tok_s": round(float(np.median([r["decode_tok_s"] for r in rs])), 2),
            "decode_tok_s_runs": [round(r["decode_tok_s"], 2) for r in rs],
            "settings": rs[0]["settings"],
            "same_tokens_as_llama": all(r["tokens"] == reference_tokens for r in rs),
        }
        for name, rs in runs.items()
    }

    record = {
        "bench": "llamacpp_runner_single_stream_decode",
        "model": str(path),
        "prompt_tokens": len(prompt),
        "gen_tokens": args.gen,
        "repeat": args.repeat,
        "threads": args.threads,
        "hardware": {"cpu": cpu_model(), "cpus": os.cpu_count(), "machine": platform.machine()},
        "build": {"llama_cpp_python": llama_cpp.__version__, "numpy": np.__version__},
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "results": results,
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
