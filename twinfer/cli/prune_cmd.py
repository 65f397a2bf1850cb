"""`twinfer prune`: remove the layers (and experts) that cost least, write the model, report its KL."""

from __future__ import annotations

import json

import typer

from twinfer.app.runners import RUNNERS
from twinfer.quant.prune import PruneOptions, prune_model


def run_prune(model: str | None, out: str, options: PruneOptions, json_out: bool = False) -> None:
    result = prune_model(model, out, options, runners=RUNNERS)
    typer.echo(json.dumps(result.as_dict()) if json_out else "\n".join(result.lines()))
