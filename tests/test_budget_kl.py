"""A lossy `--memory-budget` choice states the KL it measured, not only the planner's guess.

On the 79 MB random Qwen3-MoE (tests/moe_gguf.py, shape `tiny`) at half its bytes the budget requantizes:
the KL of that file (at the plan's KV type) against the stored one is measured once on a fixed text,
cached beside the file, equal to what `twinfer eval kl` measures for the same pair, and named in the plan.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from gguf_convert import _cache_root

# a pinned 2-core laptop-class CPU reading its SSD at 3 GB/s: the plan does not depend on the test host
HOST = "kind=cpu,memory=16GB,bandwidth=20GB/s,vector=0.2TFLOPS,cores=2,storage=3GB/s"


@pytest.fixture(scope="module")
def moe_gguf() -> Path:
    pytest.importorskip("llama_cpp")
    pytest.importorskip("transformers")
    from moe_gguf import write_qwen3_moe_gguf

    folder = _cache_root() / "budget-gguf"
    folder.mkdir(parents=True, exist_ok=True)
    return write_qwen3_moe_gguf(folder, "tiny")


def test_requantized_budget_measures_its_kl(moe_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from twinfer.app.budget import BudgetRequest, fit_budget
    from twinfer.app.budget_kl import KL_CORPUS, KL_TOKENS, KL_WINDOW
    from twinfer.app.runners import RUNNERS
    from twinfer.planners.describe import resolve_cluster
    from twinfer.quant.fidelity import measure_kl
    from twinfer.runtime.loaders import load_model

    monkeypatch.setenv("TWINFER_CACHE", str(tmp_path))
    request = BudgetRequest(moe_gguf.stat().st_size // 2, 1024, threads=1, hardware=resolve_cluster(HOST))
    strategy, run_path, _ = fit_budget(moe_gguf, load_model(moe_gguf), "llamacpp", request)
    kl = strategy.measured_kl
    assert strategy.requantize and kl is not None and run_path != moe_gguf
    assert kl.tokens == KL_TOKENS - 2  # two windows, each scores all but its last position
    assert kl.mean > 0 and kl.top1 < 1  # lossy, and the measurement says so
    assert "Measured KL against the stored file" in strategy.summary()
    # the same pair through `twinfer eval kl`'s harness: the stored file whole, the budget's file at its KV type
    spec = f"llamacpp:kv={strategy.kv_type}" if strategy.kv_type else "llamacpp"
    report = measure_kl(str(run_path), str(moe_gguf), spec, KL_CORPUS, KL_TOKENS, KL_WINDOW, runners=RUNNERS)
    assert report.mean_kl == pytest.approx(kl.mean, rel=1e-3) and report.tokens == kl.tokens
    # measured once: a second plan reads the cached result instead of starting a child
    run = subprocess.run

    def no_second_measurement(cmd: list[str], **kw: object) -> object:
        assert "twinfer.app.budget_kl" not in cmd, "measured twice"
        return run(cmd, **kw)  # type: ignore[call-overload]

    monkeypatch.setattr(subprocess, "run", no_second_measurement)
    again, _, _ = fit_budget(moe_gguf, load_model(moe_gguf), "llamacpp", request)
    assert again.measured_kl == kl
