"""`twinfer eval kl`: fidelity of a candidate against a reference."""

from __future__ import annotations

import json
from typing import Any

import typer

from twinfer.app.runners import RUNNERS
from twinfer.quant.fidelity import measure_kl


def run_eval_kl(model: str | None, reference: str, candidate: str, corpus: str, tokens: int, window: int,
                json_out: bool, top_k: int = 20, api_key_env: str = "OPENAI_API_KEY", probes: int = 0,
                probe_seconds: float = 60.0) -> None:
    from twinfer.quant.remote import is_url, measure_remote_kl

    report: Any
    if is_url(candidate):
        report = measure_remote_kl(model, reference, candidate, corpus, tokens, window, runners=RUNNERS,
                                   top_k=top_k, api_key_env=api_key_env, probes=probes,
                                   probe_seconds=probe_seconds)
    else:
        report = measure_kl(model, reference, candidate, corpus, tokens, window, runners=RUNNERS)
    if json_out:
        typer.echo(json.dumps(report.as_dict()))
    else:
        typer.echo("\n".join(report.lines()))
