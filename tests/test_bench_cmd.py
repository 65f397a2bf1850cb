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
    (["serve", "--kv-layout", "paged"], "--kv-layout must be one of auto, unified, streams, got 'paged'"),
    (["serve", "--kv-layout", "streams", "--memory-budget", "1GB"], "drop --kv-layout streams"),
])
def test_a_bad_kv_layout_is_named(args: list[str], message: str) -> None:
    r = CliRunner().invoke(app, args)
    assert r.exit_code != 0 and message in str(r.exception)


def test_kv_layout_auto_takes_streams_while_they_fit_an_eighth_of_memory() -> None:
    """Gemma 3 270M (18,432 bytes of KV a token) at serve's 16 x 4,096 tokens: 1.2 GB of streams."""
    from twinfer.app.models import streams_fit

    assert streams_fit(18_432, 16, 4096, 16e9)  # a 16 GB laptop: 2 GB for streams
    assert not streams_fit(18_432, 16, 4096, 8e9)  # an 8 GB one: 1 GB, too little
    assert not streams_fit(18_432, 1, 4096, 1e12)  # one sequence: a stream is the unified cache
    assert streams_fit(18_432, 16, 4096, 8 * 16 * 4096 * 18_432)  # the boundary fits


@pytest.mark.parametrize("memory_gb, layouts", [
    (16.0, {"auto": False, "unified": True, "streams": False}),  # an explicit layout is taken as asked
    (8.0, {"auto": True}),
])
def test_kv_layout_auto_opens_what_the_machine_fits(default_model: Path, tmp_path: Path, monkeypatch,
                                                     memory_gb: float, layouts: dict[str, bool]) -> None:
    """The session's layout (describe()'s unified_kv) on a pinned host of each size."""
    import os

    from twinfer.app import OpenOptions, open_session

    host = json.loads(Path(os.environ["TWINFER_HOST_FACTS"]).read_text())
    (tmp_path / "host.json").write_text(json.dumps({**host, "memory_bytes": memory_gb * 1e9}))
    monkeypatch.setenv("TWINFER_HOST_FACTS", str(tmp_path / "host.json"))
    for layout, want in layouts.items():
        session = open_session(OpenOptions(str(default_model), "llamacpp", max_seqs=16, ctx=4096, threads=2,
                                           kv_layout=layout))
        try:
            assert session.opened.runner.describe()["unified_kv"] is want, layout
        finally:
            session.close()


def test_kv_layout_streams_on_a_runner_without_them_is_named(default_model: Path) -> None:
    """torch and MLX keep paged blocks each sequence owns: `--kv-layout streams` there is an error, not a no-op."""
    r = CliRunner().invoke(app, ["serve", str(default_model), "--backend", "torch", "--kv-layout", "streams"])
    assert r.exit_code != 0 and "the torch runner keeps paged KV blocks" in str(r.exception)
