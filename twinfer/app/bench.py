"""`twinfer bench`: closed-loop load in-process, reported with its hardware, build and traffic shape.
Each level keeps `c` requests in flight; prompts are cut from a corpus, outputs are exactly `output_tokens`."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from twinfer import __version__
from twinfer.app.models import OpenedModel
from twinfer.app.session import Session
from twinfer.runtime.corpus import corpus_text
from twinfer.runtime.engine import Engine, GuardConfig, SamplingParams
from twinfer.runtime.engine.metrics import percentile
from twinfer.runtime.errors import TwinferError


def hardware_info() -> dict[str, Any]:
    """What the numbers ran on: CPU model and cores, memory, OS (GPU name when torch sees one)."""
    info: dict[str, Any] = {"machine": platform.machine(), "os": platform.platform(), "cpus": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        mem = Path("/proc/meminfo").read_text().split()
        info["memory_gb"] = round(int(mem[1]) / 1024**2, 1)
    except OSError:
        info["cpu"] = platform.processor()
    return info


def build_info(opened: OpenedModel) -> dict[str, Any]:
    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        rev = None
    return {"twinfer": __version__, "revision": rev, "model": opened.name, **opened.runner.describe()}


def bench_prompts(opened: OpenedModel, count: int, prompt_tokens: int, shared_prefix: int,
                  corpus: str = "prose") -> list[list[int]]:
    """`count` distinct prompts of exactly `prompt_tokens` tokens; the first `shared_prefix` are common."""
    if shared_prefix >= prompt_tokens:
        raise TwinferError("--shared-prefix must be smaller than --prompt-tokens")
    tok = opened.tokenizer
    stream = tok.encode(corpus_text(corpus, max_chars=(count + 1) * prompt_tokens * 8 + 20_000),
                        add_special_tokens=False)
    unique = prompt_tokens - shared_prefix - 1
    if len(stream) < shared_prefix + count * unique:
        raise TwinferError(f"corpus {corpus!r} is too short for {count} prompts of {prompt_tokens} tokens")
    bos = [tok.bos_id] if tok.bos_id is not None else [stream[0]]
    head = bos + stream[:shared_prefix]
    body = stream[shared_prefix:]
    return [head + body[i * unique : (i + 1) * unique] for i in range(count)]


def run_level(engine: Engine, prompts: list[list[int]], concurrency: int, params: SamplingParams) -> dict[str, Any]:
    """Closed loop at one concurrency; returns throughput and latency percentiles."""
    queue = list(prompts)
    inflight: set[str] = set()
    ttft: list[float] = []
    tpot: list[float] = []
    tokens = 0
    start = time.perf_counter()
    while queue or inflight:
        while queue and len(inflight) < concurrency:
            inflight.add(engine.add_request(queue.pop(0), params))
        for out in engine.step():
            if out.finished:
                inflight.discard(out.request_id)
                tokens += out.completion_tokens
                ttft.append(out.metrics.get("ttft_s", 0.0))
                if "tpot_s" in out.metrics:
                    tpot.append(out.metrics["tpot_s"])
                engine.requests.pop(out.request_id, None)
    wall = time.perf_counter() - start
    return {
        "concurrency": concurrency, "requests": len(prompts), "output_tokens": tokens, "wall_s": wall,
        "output_tokens_per_s": tokens / wall if wall else 0.0,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
        "speculative": engine.speculator.snapshot() if engine.speculator else None,
    }


def run_bench(session: Session, concurrency: list[int], prompt_tokens: int, output_tokens: int,
              shared_prefix: int = 0, requests_per_client: int = 2, corpus: str = "prose",
              max_batch_tokens: int | None = None) -> dict[str, Any]:
    """Benchmark every concurrency level on a fresh engine of the session (prefix cache warm only across
    shared prefixes); the session's proposer, if any, speculates (its `--speculate` is in the report).
    `max_batch_tokens` is the engine's step (None: the runner's default, as `twinfer serve` runs)."""
    if not concurrency or min(concurrency) < 1 or prompt_tokens < 2 or output_tokens < 1:
        raise TwinferError("need concurrency levels >= 1, --prompt-tokens >= 2 and --output-tokens >= 1")
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True,
                            guard=GuardConfig(enabled=False))
    opened = session.opened
    results = []
    for c in concurrency:
        engine = session.engine(max_seqs=c, max_batch_tokens=max_batch_tokens)
        step_tokens = engine.scheduler.config.max_batch_tokens  # what the engine resolved it to
        warm = bench_prompts(opened, 1, prompt_tokens, 0, corpus)
        engine.generate(warm, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        prompts = bench_prompts(opened, c * requests_per_client, prompt_tokens, shared_prefix, corpus)
        results.append(run_level(engine, prompts, c, params))
        engine.close()
    return {
        "hardware": hardware_info(),
        "build": build_info(opened),
        "traffic": {"prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
                    "shared_prefix": shared_prefix, "requests_per_client": requests_per_client,
                    "corpus": corpus, "sampling": "greedy, ignore_eos", "max_batch_tokens": step_tokens,
                    "speculate": session.options.speculate},
        "results": results,
    }
