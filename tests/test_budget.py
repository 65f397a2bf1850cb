"""`--memory-budget`: the local strategy is chosen, applied, and its KL measured."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from twinfer.app import OpenOptions, open_session
from twinfer.app.budget import ops_strategy, parse_budget
from twinfer.quant.fidelity import RunnerSource, corpus_windows
from twinfer.quant.kl import KLAccumulator
from twinfer.runtime.errors import PlanError
from twinfer.runtime.loaders import load_model
from twinfer.runtime.synthetic import SyntheticMoE, write_synthetic_moe


def test_parse_budget() -> None:
    assert parse_budget("800MiB") == 800 * 2**20
    assert parse_budget("12GB") == 12_000_000_000
    assert parse_budget("123456") == 123456
    for bad in ("0", "-5GB", "12XB", "lots"):
        with pytest.raises(PlanError):
            parse_budget(bad)


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shape = SyntheticMoE(hidden=128, intermediate=128, layers=4, experts=16, top_k=2, vocab=256, heads=2, kv_heads=1,
                         head_dim=64)
    return write_synthetic_moe(tmp_path_factory.mktemp("moe"), shape)


def test_moe_strategies_by_budget(moe: Path) -> None:
    loaded = load_model(moe)
    weight_bytes = sum(p.stat().st_size for p in moe.glob("*.safetensors"))
    roomy = ops_strategy(loaded, "torch", 4 * weight_bytes, 256, 4, False)
    assert roomy.dtype == "float32" and roomy.expert_cache_bytes is None  # fits: full residency, any batch
    tight = ops_strategy(loaded, "torch", weight_bytes // 2, 256, 1, False)
    assert tight.dtype == "float32" and tight.expert_cache_bytes is not None
    assert 0 < tight.expert_cache_bytes < weight_bytes // 2
    assert "streamed" in tight.summary()
    batched = ops_strategy(loaded, "torch", weight_bytes // 2, 256, 4, False)
    assert batched.expert_cache_bytes == tight.expert_cache_bytes and "several sequences" in batched.summary()
    with pytest.raises(PlanError, match="memory-budget"):
        ops_strategy(loaded, "torch", weight_bytes // 50, 256, 1, False)


def _kl(ref: object, cand: object, model: Path, tokens: int = 95) -> tuple[float, float]:
    acc = KLAccumulator()
    for w in corpus_windows(str(model), "prose", tokens, 48):
        acc.add(RunnerSource(ref).logits(w)[:-1], RunnerSource(cand).logits(w)[:-1])  # type: ignore[arg-type]
    report = acc.report("unconstrained", "budget", "prose")
    return report.mean_kl, report.top1_agreement


def test_default_model_torch_budget_holds_half_precision(default_model: Path) -> None:
    pytest.importorskip("torch")
    from twinfer.app.models import open_model

    session = open_session(OpenOptions(str(default_model), "torch", ctx=256, memory_budget="700MB"))
    opened, strategy = session.opened, session.strategy
    assert strategy is not None
    assert strategy.dtype == "bfloat16" and strategy.predicted_bytes <= 700e6
    full = open_model(str(default_model), "torch", max_seqs=1, ctx=256)
    mean_kl, top1 = _kl(full.runner, opened.runner, default_model, tokens=47)
    assert 0.0 < mean_kl < 0.02 and top1 > 0.9


def test_default_model_llamacpp_budget_runs_the_plan(default_model: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("llama_cpp")
    from twinfer.app.models import open_model

    monkeypatch.setenv("TWINFER_CACHE", str(tmp_path))
    stored = default_model.stat().st_size
    # the file as stored needs ~284 MB at 1024 tokens with F16 KV (the interpreter's ~150 MB on top of a
    # budget); requantizing only the projections keeps the tied Q8_0 embedding (178 MB), so the plan fits
    # 250 MB by requantizing the embedding too
    session = open_session(OpenOptions(str(default_model), "llamacpp", ctx=1024, memory_budget="250MB"))
    opened, strategy = session.opened, session.strategy
    assert strategy is not None
    assert strategy.predicted_bytes <= 250e6
    assert strategy.requantize is not None and strategy.embed_type is not None
    assert opened.runner.describe()  # the requantized file is what runs
    (written,) = tmp_path.glob("requant/*.gguf")
    assert written.stat().st_size < 0.8 * stored
    full = open_model(str(default_model), "llamacpp", max_seqs=1, ctx=1024)
    mean_kl, top1 = _kl(full.runner, opened.runner, default_model)
    # only the embedding moves (Q8_0 -> Q5_0): 0.042 and 88.7% top-1 on 512 tokens (docs/quantization.md)
    assert np.isfinite(mean_kl) and 0.0 < mean_kl < 0.15 and top1 > 0.75


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_a_budgeted_llamacpp_runner_gets_the_modes_options(default_model: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch, batch_invariant: bool) -> None:
    """`serve --memory-budget X --batch-invariant` runs a KV stream per sequence on unrepacked weights, as
    without a budget; a budget alone keeps llama.cpp's repacking (the fast mode every other path gets)."""
    pytest.importorskip("llama_cpp")
    monkeypatch.setenv("TWINFER_CACHE", str(tmp_path))
    options = OpenOptions(str(default_model), "llamacpp", max_seqs=2, ctx=256, threads=1, memory_budget="2GB",
                          batch_invariant=batch_invariant)
    session = open_session(options)
    try:
        assert session.strategy is not None and session.strategy.requantize is None  # as stored: it fits
        d = session.opened.runner.describe()
        assert d["unified_kv"] is not batch_invariant and d["max_seqs"] == 2
        assert d["repack"] is (not batch_invariant and d["amx"] != "repack-off")
        assert session.engine().exact is not None if batch_invariant else session.engine().exact is None
    finally:
        session.close()
