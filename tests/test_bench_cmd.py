"""`twinfer bench` in-process: the engine step it measures is the one `twinfer serve` runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from twinfer.cli.main import app

pytest.importorskip("llama_cpp")


def _bench(*args: str) -> dict[str, object]:
    r = CliRunner().invoke(app, ["bench", "-c", "2", "-p", "8", "-o", "3", "--requests-per-client", "1",
                                 "--threads", "1", "--json", *args])
    assert r.exit_code == 0, r.output
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


def test_bench_runs_the_runners_step_by_default_and_records_it() -> None:
    report = _bench()
    assert report["traffic"]["max_batch_tokens"] == 2048  # type: ignore[index]  # llama.cpp: llama-server's batch
    assert report["results"][0]["output_tokens"] == 6  # type: ignore[index]
    assert _bench("--max-batch-tokens", "16")["traffic"]["max_batch_tokens"] == 16  # type: ignore[index]


@pytest.mark.parametrize("args, message", [
    (["bench", "--max-batch-tokens", "0"], "--max-batch-tokens must be >= 1"),
    (["bench", "--url", "http://127.0.0.1:9", "--max-batch-tokens", "64"], "twinfer serve --max-batch-tokens"),
    (["serve", "--max-batch-tokens", "0"], "--max-batch-tokens >= 1"),
    (["serve", "--batch-wait-ms", "-5"], "--batch-wait-ms between 0 and 1000"),
])
def test_a_bad_step_budget_is_named(args: list[str], message: str) -> None:
    r = CliRunner().invoke(app, args)
    assert r.exit_code != 0 and message in str(r.exception)


@pytest.mark.parametrize("args, message", [
    (["serve", "--kv-layout", "paged"], "--kv-layout must be one of unified, streams, got 'paged'"),
    (["serve", "--kv-layout", "streams", "--memory-budget", "1GB"], "drop --kv-layout streams"),
])
def test_a_bad_kv_layout_is_named(args: list[str], message: str) -> None:
    r = CliRunner().invoke(app, args)
    assert r.exit_code != 0 and message in str(r.exception)


def test_kv_layout_streams_asks_the_runner_for_streams() -> None:
    from twinfer.cli.serve_cmd import kv_layout_options

    assert kv_layout_options("streams", None) == {"unified_kv": False}
    assert kv_layout_options("unified", None) == {} == kv_layout_options("unified", "1GB")


def test_kv_layout_streams_on_a_runner_without_them_is_named(default_model: Path) -> None:
    """torch and MLX keep paged blocks each sequence owns: `--kv-layout streams` there is an error, not a no-op."""
    r = CliRunner().invoke(app, ["serve", str(default_model), "--backend", "torch", "--kv-layout", "streams"])
    assert r.exit_code != 0 and "the torch runner keeps paged KV blocks" in str(r.exception)
