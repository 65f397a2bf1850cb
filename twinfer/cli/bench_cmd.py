"""`twinfer bench`: in-process (MODEL) or over HTTP (--url)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import typer

from twinfer.runtime.errors import OptionError

if TYPE_CHECKING:
    from twinfer.app import OpenOptions


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise OptionError(f"--concurrency {text!r}: give positive integers separated by commas, e.g. 1,4,16",
                          field="concurrency")
    return tuple(levels)


@dataclass(frozen=True)
class BenchOptions:
    """`twinfer bench`'s flags: what to bench (a model in process, or a server at `url`) under which traffic."""

    model: str | None = None
    concurrency: str = "1,4,16"  # comma-separated levels
    prompt_tokens: int = 64
    output_tokens: int = 64
    shared_prefix: int = 0
    requests_per_client: int = 2
    corpus: str = "prose"
    backend: str = "auto"
    threads: int | None = None
    url: str | None = None  # a running OpenAI-compatible server instead of a model in process
    api_key: str | None = None
    json_out: bool = False
    speculate: str = "off"
    max_batch_tokens: int | None = None
    memory_budget: str | None = None  # --memory-budget: benched as generate, chat and serve open it
    allow_pruning: bool = False

    def __post_init__(self) -> None:
        from twinfer.runtime.speculative.options import parse_speculate

        _levels(self.concurrency)  # a bad --concurrency fails here
        if self.prompt_tokens < 2 or self.output_tokens < 1:
            raise OptionError("need --prompt-tokens >= 2 and --output-tokens >= 1",
                              field="prompt_tokens" if self.prompt_tokens < 2 else "output_tokens")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise OptionError(f"--max-batch-tokens must be >= 1 (got {self.max_batch_tokens})",
                              field="max_batch_tokens")
        if self.url and self.max_batch_tokens is not None:
            raise OptionError("--max-batch-tokens applies to in-process runs; start the server with "
                              "`twinfer serve --max-batch-tokens`", field="max_batch_tokens")
        if self.url and self.memory_budget is not None:
            raise OptionError("--memory-budget applies to in-process runs; start the server with "
                              "`twinfer serve --memory-budget`", field="memory_budget")
        if self.url and parse_speculate(self.speculate)[0] != "off":
            raise OptionError("--speculate applies to in-process runs; start the server with "
                              "`twinfer serve --speculate`", field="speculate")

    @property
    def levels(self) -> tuple[int, ...]:
        return _levels(self.concurrency)

    def open_options(self) -> OpenOptions:
        """The in-process session: room for the busiest level's prompts and completions at once."""
        from twinfer.app import OpenOptions

        ctx = max(self.levels) * (self.prompt_tokens + self.output_tokens + 32) + 256
        return OpenOptions(self.model, self.backend, max_seqs=max(self.levels), ctx=ctx, threads=self.threads,
                           speculate=self.speculate, memory_budget=self.memory_budget,
                           allow_pruning=self.allow_pruning)


def run_bench_cmd(options: BenchOptions) -> None:
    o = options
    if o.url:
        from twinfer.server.http_bench import run_http_bench

        report = run_http_bench(o.url, list(o.levels), o.prompt_tokens, o.output_tokens, o.api_key,
                                requests_per_client=o.requests_per_client)
    else:
        from twinfer.app import open_session
        from twinfer.app.bench import run_bench

        session = open_session(o.open_options())
        report = run_bench(session, list(o.levels), o.prompt_tokens, o.output_tokens, o.shared_prefix,
                           o.requests_per_client, o.corpus, o.max_batch_tokens)
        if session.strategy is not None:  # what the budget chose is part of the result's context
            report["memory_budget"] = session.strategy.summary()
            measured = session.strategy.measured_kl
            report["memory_budget_kl"] = {"expected": session.strategy.expected_kl,
                                          "measured": asdict(measured) if measured else None}
            report["memory_budget_predicted_bytes"] = session.strategy.predicted_bytes  # the model's, no interpreter
    _print(report, o.json_out)


def _print(report: dict[str, Any], json_out: bool) -> None:
    if json_out:
        typer.echo(json.dumps(report))
        return
    build, hw, traffic = report["build"], report["hardware"], report["traffic"]
    typer.echo(f"hardware: {hw.get('cpu', hw.get('machine'))} ({hw.get('cpus')} cpus)")
    typer.echo(f"build:    twinfer {build.get('twinfer')} {build.get('revision') or ''} backend={build.get('backend')}")
    typer.echo(f"traffic:  {traffic}")
    if "memory_budget" in report:
        typer.echo(f"budget:   {report['memory_budget']}")
    typer.echo(f"{'conc':>5} {'tok/s':>9} {'ttft p50':>9} {'ttft p99':>9} {'tpot p50':>9} {'tpot p99':>9}")
    for r in report["results"]:
        typer.echo(f"{r['concurrency']:>5} {r['output_tokens_per_s']:>9.1f} {r['ttft_p50_s']*1e3:>7.0f}ms "
                   f"{r['ttft_p99_s']*1e3:>7.0f}ms {r['tpot_p50_s']*1e3:>7.1f}ms {r['tpot_p99_s']*1e3:>7.1f}ms")
    for r in report["results"]:
        spec = r.get("speculative")
        if spec:
            typer.echo(f"speculate c={r['concurrency']}: {spec['proposer']} proposed {spec['proposed']}, accepted "
                       f"{spec['accepted']} ({spec['acceptance_rate']:.0%}), est. speedup {spec['speedup_estimate']:.2f}x")
