"""`twinfer bench`: in-process (MODEL) or over HTTP (--url)."""

from __future__ import annotations

import json

import typer

from twinfer.runtime.errors import TwinferError


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise TwinferError(f"--concurrency {text!r}: give positive integers separated by commas, e.g. 1,4,16")
    return levels


def run_bench_cmd(model: str | None, concurrency: str, prompt_tokens: int, output_tokens: int, shared_prefix: int,
                  requests_per_client: int, corpus: str, backend: str, threads: int | None, url: str | None,
                  api_key: str | None, json_out: bool, speculate: str = "off",
                  max_batch_tokens: int | None = None) -> None:
    from twinfer.runtime.speculative.options import parse_speculate

    levels = _levels(concurrency)
    if prompt_tokens < 2 or output_tokens < 1:
        raise TwinferError("need --prompt-tokens >= 2 and --output-tokens >= 1")
    if max_batch_tokens is not None and max_batch_tokens < 1:
        raise TwinferError(f"--max-batch-tokens must be >= 1 (got {max_batch_tokens})")
    if url and max_batch_tokens is not None:
        raise TwinferError("--max-batch-tokens applies to in-process runs; start the server with "
                           "`twinfer serve --max-batch-tokens`")
    if url and parse_speculate(speculate)[0] != "off":
        raise TwinferError("--speculate applies to in-process runs; start the server with `twinfer serve --speculate`")
    if url:
        from twinfer.server.http_bench import run_http_bench

        report = run_http_bench(url, levels, prompt_tokens, output_tokens, api_key,
                                requests_per_client=requests_per_client)
    else:
        from twinfer.app import OpenOptions, open_session
        from twinfer.app.bench import run_bench

        ctx = max(levels) * (prompt_tokens + output_tokens + 32) + 256
        session = open_session(OpenOptions(model, backend, max_seqs=max(levels), ctx=ctx, threads=threads,
                                           speculate=speculate))
        report = run_bench(session, levels, prompt_tokens, output_tokens, shared_prefix, requests_per_client, corpus,
                           max_batch_tokens)
    if json_out:
        typer.echo(json.dumps(report))
        return
    build, hw, traffic = report["build"], report["hardware"], report["traffic"]
    typer.echo(f"hardware: {hw.get('cpu', hw.get('machine'))} ({hw.get('cpus')} cpus)")
    typer.echo(f"build:    twinfer {build.get('twinfer')} {build.get('revision') or ''} backend={build.get('backend')}")
    typer.echo(f"traffic:  {traffic}")
    typer.echo(f"{'conc':>5} {'tok/s':>9} {'ttft p50':>9} {'ttft p99':>9} {'tpot p50':>9} {'tpot p99':>9}")
    for r in report["results"]:
        typer.echo(f"{r['concurrency']:>5} {r['output_tokens_per_s']:>9.1f} {r['ttft_p50_s']*1e3:>7.0f}ms "
                   f"{r['ttft_p99_s']*1e3:>7.0f}ms {r['tpot_p50_s']*1e3:>7.1f}ms {r['tpot_p99_s']*1e3:>7.1f}ms")
    for r in report["results"]:
        spec = r.get("speculative")
        if spec:
            typer.echo(f"speculate c={r['concurrency']}: {spec['proposer']} proposed {spec['proposed']}, accepted "
                       f"{spec['accepted']} ({spec['acceptance_rate']:.0%}), est. speedup {spec['speedup_estimate']:.2f}x")
