"""Where a server's time goes under a 16-client burst: `twinfer serve` with every `llama_decode` timed
inside it, and `llama-server` with its own per-request timings, the same prompts on both.

    python bench/serve_split.py --llama-bin DIR [--model M.gguf] [--runs 4] [--clients 16]

Each run sends one warm-up request, then `--clients` requests at once (20-word prompts, about 100 tokens
with a byte-level tokenizer; 64 tokens, `ignore_eos`): twinfer's runs non-streamed and streamed in turn,
llama-server's non-streamed (its timings come in the response body). For twinfer it prints the share of the run's wall time
spent in llama.cpp's decode calls and the prompt steps' tokens and seconds; for llama-server the longest
`prompt_ms` (the batched prefill, as its slots report it). Prints one JSON object per run.

Run as `python bench/serve_split.py --serve-timed OUT MODEL` it is the timed server itself (internal).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from bench_serve_load import start  # noqa: E402

from twinfer.runtime.loaders import default_model_path  # noqa: E402
from twinfer.server.http_bench import HttpTraffic, bench_prompt, prompt_key, run_http_bench  # noqa: E402

OUTPUT_TOKENS, WORDS = 64, 20


def serve_timed(out: str, argv: list[str]) -> None:
    """`twinfer serve ARGV` with each llama_decode call's (start, seconds, tokens, runs of consecutive sequence
    ids: llama.cpp's ubatches over KV streams) written to `out` at exit."""
    import atexit

    from twinfer.backends.llamacpp import runner
    from twinfer.cli.main import app

    calls: list[tuple[float, float, int, int]] = []
    opened = runner.LlamaCppRunner.__init__

    def timed_init(self: Any, *args: Any, **kwargs: Any) -> None:
        opened(self, *args, **kwargs)
        lib, decode = self._lib, self._lib.llama_decode

        class Timed:
            def __getattr__(self, name: str) -> Any:
                return getattr(lib, name)

            @staticmethod
            def llama_decode(ctx: Any, batch: Any) -> int:
                ids = sorted({batch.seq_id[i][0] for i in range(batch.n_tokens)})
                runs = 1 + sum(b != a + 1 for a, b in zip(ids, ids[1:], strict=False))
                t = time.perf_counter()
                code = decode(ctx, batch)
                calls.append((t, time.perf_counter() - t, int(batch.n_tokens), runs))
                return int(code)

        self._lib = Timed()

    runner.LlamaCppRunner.__init__ = timed_init  # type: ignore[method-assign]
    atexit.register(lambda: Path(out).write_text(json.dumps(calls)))
    sys.argv = ["twinfer", "serve", *argv]
    app()


def twinfer_runs(model: Path, runs: int, clients: int, folder: Path) -> list[dict[str, Any]]:
    out = folder / "decode-calls.json"
    proc, url = start("twinfer", model, Path(), serve=(sys.executable, __file__, "--serve-timed", str(out)))
    windows = []
    try:
        for i in range(runs):
            stream = i % 2 == 1
            r = run_http_bench(url, [clients], WORDS, OUTPUT_TOKENS, requests_per_client=1,
                               traffic=HttpTraffic(stream=stream, greedy=False, prompt_seed=11 + i))["results"][0]
            windows.append((time.perf_counter(), stream, r))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    calls = json.loads(out.read_text())
    rows = []
    for end, stream, r in windows:
        inside = [c for c in calls if end - r["wall_s"] <= c[0] <= end]  # the level, after its warm-up
        prompt = [c for c in inside if c[2] > clients]  # steps carrying prompt tokens
        rows.append({"side": "twinfer", "stream": stream, "tok_s": r["output_tokens_per_s"], "wall_s": r["wall_s"],
                     "decode_share": sum(c[1] for c in inside) / r["wall_s"], "decode_calls": len(inside),
                     "prompt_steps": len(prompt), "prompt_step_tokens": sum(c[2] for c in prompt),
                     "prompt_step_s": sum(c[1] for c in prompt)})
    return rows


def llama_server_runs(model: Path, bin_dir: Path, runs: int, clients: int) -> list[dict[str, Any]]:
    import httpx

    proc, url = start("llama-server", model, bin_dir)

    async def one(client: httpx.AsyncClient, prompt: str, tokens: int) -> dict[str, Any]:
        body = {"model": "m", "prompt": prompt, "max_tokens": tokens, "ignore_eos": True}
        return dict((await client.post(url + "/v1/completions", json=body)).json())

    async def level(seed: int) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=600) as client:
            await one(client, bench_prompt(WORDS, -1 - seed), 4)
            started = time.perf_counter()
            prompts = [bench_prompt(WORDS, prompt_key(clients, w, 0, seed)) for w in range(clients)]
            outs = await asyncio.gather(*(one(client, p, OUTPUT_TOKENS) for p in prompts))
            wall = time.perf_counter() - started
        timings = [o["timings"] for o in outs]
        return {"side": "llama-server", "stream": False, "tok_s": clients * OUTPUT_TOKENS / wall, "wall_s": wall,
                "prompt_ms_max": max(t["prompt_ms"] for t in timings), "prompt_tokens": sum(t["prompt_n"] for t in timings)}

    try:
        return [asyncio.run(level(11 + i)) for i in range(runs)]
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-timed":
        serve_timed(sys.argv[2], sys.argv[3:])
        return
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", type=Path, required=True)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--clients", type=int, default=16)
    args = ap.parse_args()
    model = args.model or Path(default_model_path())
    with tempfile.TemporaryDirectory() as folder:
        rows = twinfer_runs(model, args.runs, args.clients, Path(folder))
        rows += llama_server_runs(model, args.llama_bin, args.runs, args.clients)
    print(json.dumps({"model": str(model), "clients": args.clients, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
