"""`twinfer eval kl`: fidelity of a candidate against a reference."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import typer

from twinfer.app.runners import RUNNERS
from twinfer.quant.fidelity import measure_kl
from twinfer.quant.remote import RemoteOptions


@dataclass(frozen=True)
class EvalKLOptions:
    """`twinfer eval kl`'s flags: the two sides, the tokens they are scored on, and how a URL is asked."""

    model: str | None = None
    reference: str = "transformers"
    candidate: str = "torch"  # a backend spec, a model path or an OpenAI-compatible URL
    corpus: str = "prose"
    tokens: int = 512
    window: int = 256
    json_out: bool = False
    remote: RemoteOptions = field(default_factory=RemoteOptions)  # a URL candidate's


def run_eval_kl(options: EvalKLOptions) -> None:
    from twinfer.quant.remote import is_url, measure_remote_kl

    o = options
    report: Any
    if is_url(o.candidate):
        report = measure_remote_kl(o.model, o.reference, o.candidate, o.corpus, o.tokens, o.window, runners=RUNNERS,
                                   options=o.remote)
    else:
        report = measure_kl(o.model, o.reference, o.candidate, o.corpus, o.tokens, o.window, runners=RUNNERS)
    typer.echo(json.dumps(report.as_dict()) if o.json_out else "\n".join(report.lines()))
