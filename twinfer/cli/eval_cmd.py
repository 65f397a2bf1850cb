"""`twinfer eval kl`: fidelity of a candidate against a reference."""

from __future__ import annotations

import json

import typer

from twinfer.app.runners import RUNNERS
from twinfer.quant.fidelity import measure_kl


def run_eval_kl(model: str | None, reference: str, candidate: str, corpus: str, tokens: int, window: int,
                json_out: bool) -> None:
    report = measure_kl(model, reference, candidate, corpus, tokens, window, runners=RUNNERS)
    if json_out:
        typer.echo(json.dumps(report.as_dict()))
    else:
        typer.echo("\n".join(report.lines()))
