"""The llama.cpp runner's two KV layouts side by side in one process, alternating step by step: a unified
cache all sequences share (`twinfer serve`'s default) and a stream per sequence (`--kv-layout streams`).

Each wave prefills 16 prompts of 101 random tokens in one step on both runners, then runs 64 greedy
decode steps of 16 rows, the two runners taking turns every step (the order flips every step and
every wave), so both see the same moments of a noisy host. Prints one JSON object: per-wave prefill
seconds, per-step decode seconds, and the streams / unified ratios.

    python bench/bench_kv_layout.py [--waves 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from twinfer.app.models import open_model
from twinfer.runtime.batch import SeqChunk, StepBatch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--waves", type=int, default=6)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=101)
    ap.add_argument("--decode-steps", type=int, default=64)
    args = ap.parse_args()
    n, p = args.seqs, args.prompt_tokens
    runners = {name: open_model(None, "llamacpp", max_seqs=n, ctx=4096,
                                kv_layout="unified" if unified else "streams", mode="fast").runner
               for name, unified in (("unified", True), ("streams", False))}
    rng = np.random.default_rng(0)
    prefill: dict[str, list[float]] = {k: [] for k in runners}
    decode: dict[str, list[float]] = {k: [] for k in runners}
    for w in range(args.waves):
        seqs = [w * 1000 + i for i in range(n)]
        prompts = [rng.integers(1000, 200_000, p).tolist() for _ in seqs]
        names = list(runners) if w % 2 == 0 else list(runners)[::-1]
        last = {}
        for name in names:
            t = time.perf_counter()
            out = runners[name].step(StepBatch([SeqChunk(s, q, 0) for s, q in zip(seqs, prompts, strict=True)]))
            prefill[name].append(time.perf_counter() - t)
            last[name] = out.argmax(-1).tolist()
        for i in range(args.decode_steps):
            for name in names if i % 2 == 0 else names[::-1]:
                batch = StepBatch([SeqChunk(s, [int(last[name][j])], p + i) for j, s in enumerate(seqs)])
                t = time.perf_counter()
                out = runners[name].step(batch)
                decode[name].append(time.perf_counter() - t)
                last[name] = out.argmax(-1).tolist()
        for runner in runners.values():
            for s in seqs:
                runner.release(s)
    step_ratio = [s / u for s, u in zip(decode["streams"], decode["unified"], strict=True)]
    print(json.dumps({
        "traffic": {"seqs": n, "prompt_tokens": p, "decode_steps": args.decode_steps, "waves": args.waves},
        "runner": {k: r.describe() for k, r in runners.items()},
        "prefill_s": prefill,
        "decode_step_median_s": {k: [statistics.median(v[w * args.decode_steps:(w + 1) * args.decode_steps])
                                     for w in range(args.waves)] for k, v in decode.items()},
        "prefill_ratio_streams_vs_unified": [s / u for s, u in zip(prefill["streams"], prefill["unified"], strict=True)],
        "decode_step_ratio_streams_vs_unified_median": statistics.median(step_ratio),
    }, indent=1))


if __name__ == "__main__":
    main()
