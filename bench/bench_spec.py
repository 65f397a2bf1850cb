"""Speculative decoding on the default model with the llama.cpp runner.

    python bench/bench_spec.py [--threads 2] [--prompts 4] [--prompt-tokens 256] [--output-tokens 128] > spec.json

Single stream, greedy (EOS ignored, loop guard off): for each corpus (code, prose), the same prompts
are decoded without speculation and with each mode in --modes (default: ngram), interleaved prompt
by prompt, best of --rounds. Decode speed excludes the first token (1 / time per output token).
Each mode keeps one engine (and so its measured costs) across prompts, as a server would, after one
warm-up request. The greedy tokens of every speculative run are compared with the plain run's.
Prints one JSON object with the hardware, build and traffic.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from twinfer.app.bench import bench_prompts, build_info, hardware_info
from twinfer.app.models import OpenedModel, open_model
from twinfer.app.speculate import open_proposer
from twinfer.runtime.engine import Engine, EngineConfig, GuardConfig, SamplingParams


def decode_rate(engine: Engine, prompt: list[int], output_tokens: int) -> tuple[float, list[int]]:
    """Decode tokens/s of one request, and its tokens. The engines share one runner: each request
    starts from an empty KV cache (llama.cpp's numerics depend on where a sequence's cells lie)."""
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True, guard=GuardConfig(enabled=False))
    out = engine.generate([prompt], params)[0]
    engine.close()
    return 1.0 / out.metrics["tpot_s"], out.token_ids


def run_corpus(opened: OpenedModel, corpus: str, modes: list[str], args: argparse.Namespace) -> dict[str, Any]:
    prompts = bench_prompts(opened, args.prompts + 1, args.prompt_tokens, 0, corpus)
    warm, prompts = prompts[0], prompts[1:]
    engines = {}
    for mode in ["off", *modes]:
        proposer = open_proposer(mode, opened, max_seqs=1, ctx=args.ctx, threads=args.threads)
        engines[mode] = Engine(opened.runner, opened.tokenizer, EngineConfig(max_seqs=1), proposer)
        decode_rate(engines[mode], warm, args.output_tokens)
    rates: dict[str, list[float]] = {m: [0.0] * len(prompts) for m in engines}
    tokens: dict[str, list[list[int]]] = {m: [[] for _ in prompts] for m in engines}
    for _ in range(args.rounds):
        for i, prompt in enumerate(prompts):
            for mode, engine in engines.items():
                rate, ids = decode_rate(engine, prompt, args.output_tokens)
                rates[mode][i] = max(rates[mode][i], rate)
                tokens[mode][i] = ids
    result: dict[str, Any] = {"plain_tok_s": statistics.mean(rates["off"]), "per_prompt_plain_tok_s": rates["off"]}
    for mode in modes:
        e = engines[mode]
        result[mode] = {
            "tok_s": statistics.mean(rates[mode]),
            "speedup": statistics.mean(rates[mode]) / statistics.mean(rates["off"]),
            "per_prompt_speedup": [s / p for s, p in zip(rates[mode], rates["off"], strict=True)],
            "greedy_identical": [a == b for a, b in zip(tokens[mode], tokens["off"], strict=True)],
            "speculative": e.speculator.snapshot() if e.speculator else None,
        }
    for engine in engines.values():
        engine.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", default="ngram", help="comma-separated --speculate values")
    parser.add_argument("--corpora", default="code,prose")
    args = parser.parse_args()
    args.ctx = args.prompt_tokens + args.output_tokens + 64
    opened = open_model(None, "llamacpp", max_seqs=1, ctx=args.ctx, threads=args.threads)
    modes = [m for m in args.modes.split(",") if m]
    report: dict[str, Any] = {
        "hardware": hardware_info(),
        "build": build_info(opened),
        "traffic": {"streams": 1, "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
                    "output_tokens": args.output_tokens, "rounds": args.rounds, "sampling": "greedy, ignore_eos",
                    "threads": args.threads},
    }
    for corpus in args.corpora.split(","):
        report[corpus] = run_corpus(opened, corpus, modes, args)
        print(f"{corpus}: {json.dumps(report[corpus])}", file=sys.stderr)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
