"""`twinfer doctor`: the same tokens through every stage that applies; the first one that diverges."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from twinfer.app.doctor import run_doctor


def run_doctor_cmd(model: str | None, prompt: str | None, tokens: int, memory_budget: str | None,
                   skip: list[str], json_out: Path | None) -> None:
    report = run_doctor(model, prompt, tokens=tokens, memory_budget=memory_budget, skip=tuple(skip))
    typer.echo("\n".join(report.lines()))
    if json_out is not None:
        json_out.write_text(json.dumps(report.as_dict(), indent=1) + "\n")
        typer.echo(f"wrote {json_out}")
    if report.first_divergence is not None:
        raise typer.Exit(1)
