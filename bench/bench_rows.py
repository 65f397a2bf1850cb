"""What one llama.cpp step costs by rows: the price of verifying k drafted tokens.

    python bench/bench_rows.py [--threads 2] [--context 300] [--kv-type f16]

One sequence of `--context` tokens of the default model; then steps of 1..8 new rows of that
sequence, with logits for every row (a verification), for the last only (a prompt chunk) and for
none (the 18 layers alone, without the 262k-row output matrix), best of 8 each, the rows rolled back
after every step. Prints one JSON object with hardware and build.
"""

from __future__ import annotations

import argparse
import json
import time

from twinfer.app.bench import hardware_info
from twinfer.backends.llamacpp import LlamaCppOptions, LlamaCppRunner
from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch
from twinfer.runtime.loaders import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--kv-type", default="f16")
    args = ap.parse_args()
    runner = LlamaCppRunner(default_model_path(), LlamaCppOptions(n_ctx=1024, max_seqs=1, n_threads=args.threads,
                            kv_type=args.kv_type))
    ctx = args.context
    runner.step(StepBatch([SeqChunk(0, list(range(1000, 1000 + ctx)), 0, logits=LogitsWanted.LAST)]))
    ms: dict[str, dict[int, float]] = {"all_logits": {}, "last_logit": {}, "no_logits": {}}
    for rows in range(1, 9):
        for key, want in (("all_logits", LogitsWanted.ALL), ("last_logit", LogitsWanted.LAST),
                          ("no_logits", LogitsWanted.NONE)):
            best = float("inf")
            for _ in range(8):
                t = time.perf_counter()
                runner.step(StepBatch([SeqChunk(0, list(range(2000, 2000 + rows)), ctx, logits=want)]))
                best = min(best, time.perf_counter() - t)
                runner.truncate(0, ctx)
            ms[key][rows] = round(best * 1e3, 2)
    print(json.dumps({"hardware": hardware_info(), "build": runner.describe(),
                      "traffic": {"context": ctx, "threads": args.threads, "best_of": 8}, "step_ms": ms}))
    runner.close()


if __name__ == "__main__":
    main()
