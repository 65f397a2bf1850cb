"""glm4_moe, deepseek_v3, gpt_oss, gemma4 (MoE) and the sparse-attention models under tensor and expert
parallelism over gloo, against one process.

The tiny checkpoints of test_arch_logits.py (and test_arch_gemma4.py, test_arch_dsa.py), loaded by every
rank from the saved folder, run the scripted two-sequence workload of test_parallel.py: logits within
1e-5 of the single-process torch runner and identical greedy tokens under TP=2, EP=2, TP=2 x EP=2 and
PP=2. MLA splits its heads (the absorbed projections included) and replicates the latent cache; Gemma 4
splits its global layers by their own head size (one global KV head replicated) and routes on every rank
with its replicated router scales; DSA replicates the indexer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("mlx.core")

from test_arch_logits import saved  # noqa: E402
from test_parallel import BLOCK, KV_TOKENS, TOL, workload  # noqa: E402

from twinfer.backends.cuda.parallel import ParallelConfig, RunOptions, WeightSource, launch  # noqa: E402
from twinfer.backends.cuda.runner import load_torch_runner  # noqa: E402
from twinfer.runtime.loaders import load_model  # noqa: E402

CONFIGS = [ParallelConfig(tp=2), ParallelConfig(ep=2), ParallelConfig(tp=2, ep=2), ParallelConfig(pp=2)]
CASES = ["glm4_moe-a", "deepseek_v3-a", "gpt_oss-a"]


def _folder(case: str) -> Path:
    family, _, name = case.partition(":")
    if family == "gemma4":
        from test_arch_gemma4 import saved as gemma4_saved

        return gemma4_saved(name)
    if family == "dsa":
        from test_arch_dsa import saved as dsa_saved

        return dsa_saved(name)
    return saved(case)


@pytest.mark.parametrize("config", CONFIGS, ids=["tp2", "ep2", "tp2xep2", "pp2"])
@pytest.mark.parametrize("case", CASES)
def test_parallel_matches_single_process(case: str, config: ParallelConfig) -> None:
    _check(case, config)


NEW_FAMILIES = [("gemma4:moe-keqv", "tp2"), ("gemma4:moe-keqv", "ep2"), ("dsa:glm_moe_dsa-b", "ep2"),
                pytest.param("dsa:deepseek_v32-a", "ep2", marks=pytest.mark.slow),
                pytest.param("gemma4:moe-keqv", "tp2xep2", marks=pytest.mark.slow),
                pytest.param("gemma4:moe-keqv", "pp2", marks=pytest.mark.slow)]


@pytest.mark.parametrize(("case", "config"), NEW_FAMILIES)
def test_new_families_match_single_process(case: str, config: str) -> None:
    """Gemma 4's MoE block (router input and per-expert scale reach every expert group) and DSA's experts
    split over expert groups (its TP and PP runs are in test_arch_dsa.py)."""
    _check(case, dict(zip(["tp2", "ep2", "tp2xep2", "pp2"], CONFIGS, strict=True))[config])


def _check(case: str, config: ParallelConfig) -> None:
    folder = _folder(case)
    want_rows, want_tokens = workload(load_torch_runner(load_model(folder), kv_tokens=KV_TOKENS, block_size=BLOCK))
    runner = launch(WeightSource(path=str(folder)), config, RunOptions(kv_tokens=KV_TOKENS, block_size=BLOCK,
                                                                      timeout_s=180))
    try:
        got_rows, got_tokens = workload(runner)
    finally:
        runner.close()
    err = float(np.abs(got_rows - want_rows).max())
    print(f"{case} {config.describe()}: max |dlogit| vs one process = {err:.2e}")
    assert got_rows.shape == want_rows.shape
    assert err <= TOL
    assert got_tokens == want_tokens
