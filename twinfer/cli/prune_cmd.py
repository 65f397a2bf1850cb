"""`twinfer prune`: remove the layers (and experts) that cost least, write the model, report its KL."""

from __future__ import annotations

import json

import typer

from twinfer.app.runners import RUNNERS
from twinfer.quant.prune import prune_model


def run_prune(model: str | None, out: str, layers: int, experts: int, corpus: str, tokens: int, window: int,
              backend: str, kl_tokens: int, json_out: bool, rank: str = "kl") -> None:
    result = prune_model(model, out, layers, experts, corpus, tokens, window, backend, kl_tokens, rank=rank,
                         runners=RUNNERS)
    typer.echo(json.dumps(result.as_dict()) if json_out else "\n".join(result.lines()))
