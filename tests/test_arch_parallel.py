"""glm4_moe, deepseek_v3, gpt_oss, gemma4 (MoE) and the sparse-attention models under tensor and expert
parallelism over gloo, against one process.

The tiny checkpoints of test_arch_logits.py (and test_arch_gemma4.py, test_arch_dsa.py), loaded by every
rank from the saved folder, run the scripted two-sequence workload of test_parallel.py: logits within
1e-5 of the single-process torch runner and identical greedy tokens under TP=2, EP=2, TP=2 x EP=2 and
PP=2. MLA splits its heads (the absorbed projections included) and replicates the latent cache; Gemma 4
splits its global layers by their own head size (one global KV head replicated) and routes on every rank
with its replicated router scales; DSA replicates the indexer. The recurrent hybrids (qwen3_next,
qwen3_5_moe) split their delta-net heads like attention heads, each rank keeping its heads' state, and
release a finished sequence's state on every rank.
"""

from __future__ import annotations

import tempfile
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
    if family == "hybrid":
        from test_arch_hybrid import saved as hybrid_saved

        return Path(hybrid_saved(name, _ROOT.name))
    return saved(case)


_ROOT = tempfile.TemporaryDirectory()


@pytest.mark.parametrize("config", CONFIGS, ids=["tp2", "ep2", "tp2xep2", "pp2"])
@pytest.mark.parametrize("case", CASES)
def test_parallel_matches_single_process(case: str, config: ParallelConfig) -> None:
    _check(case, config)


NEW_FAMILIES = [("gemma4:moe-keqv", "tp2"), ("gemma4:moe-keqv", "ep2"), ("dsa:glm_moe_dsa-b", "ep2"),
                pytest.param("dsa:deepseek_v32-a", "ep2", marks=pytest.mark.slow),
                pytest.param("gemma4:moe-keqv", "tp2xep2", marks=pytest.mark.slow),
                pytest.param("gemma4:moe-keqv", "pp2", marks=pytest.mark.slow),
                ("hybrid:next-a", "tp2"), ("hybrid:next-a", "ep2"), ("hybrid:q35-a", "tp2"),
                pytest.param("hybrid:next-a", "tp2xep2", marks=pytest.mark.slow),
                pytest.param("hybrid:next-a", "pp2", marks=pytest.mark.slow)]


@pytest.mark.parametrize(("case", "config"), NEW_FAMILIES)
def test_new_families_match_single_process(case: str, config: str) -> None:
    """Gemma 4's MoE block (router input and per-expert scale reach every expert group) and DSA's experts
    split over expert groups (its TP and PP runs are in test_arch_dsa.py)."""
    _check(case, dict(zip(["tp2", "ep2", "tp2xep2", "pp2"], CONFIGS, strict=True))[config])


def test_recurrent_engine_text_and_state_release_under_tp() -> None:
    """Through the engine, TP=2 gives one process's greedy tokens for more prompts than sequences at once
    (a finished sequence's state slots are freed on every rank and reused), with no prefix reuse."""
    from test_arch_hybrid import GREEDY, PROMPT_A, PROMPT_B

    from twinfer.runtime.engine import Engine, EngineConfig

    folder = _folder("hybrid:next-a")
    prompts = [PROMPT_A, PROMPT_B, PROMPT_A[:9] + [3, 4], PROMPT_B[::-1]]
    config = EngineConfig(max_seqs=2)
    want = Engine(load_torch_runner(load_model(folder), kv_tokens=KV_TOKENS, block_size=BLOCK), None, config)
    runner = launch(WeightSource(path=str(folder)), ParallelConfig(tp=2),
                    RunOptions(kv_tokens=KV_TOKENS, block_size=BLOCK, timeout_s=180))
    try:
        assert runner.kv.recurrent
        got = Engine(runner, None, config)
        outs = got.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == [o.token_ids for o in want.generate(prompts, GREEDY)]
        assert outs[2].cached_tokens == 0 and runner.model.ops.states is not None
        assert runner.model.ops.states.slots.held == 0 and runner.model.ops.states.slots.capacity == 2
    finally:
        runner.close()


def _check(case: str, config: ParallelConfig) -> None:
    folder = _folder(case)
    want_rows, want_tokens = workload(load_torch_runner(load_model(folder), kv_tokens=KV_TOKENS, block_size=BLOCK))
    runner = launch(WeightSource(path=str(folder)), config, RunOptions(kv_tokens=KV_TOKENS, block_size=BLOCK,
                                                                      timeout_s=180))
    try:
        got_rows, got_tokens = workload(runner)
    finally:
        runner.close()
    err, scale = float(np.abs(got_rows - want_rows).max()), max(1.0, float(np.abs(want_rows).max()))
    print(f"{case} {config.describe()}: max |dlogit| vs one process = {err:.2e} (logits up to {scale:.1f})")
    assert got_rows.shape == want_rows.shape
    assert err <= TOL * scale  # float32 sums in another order: relative to the logits' size (hybrids reach ~6)
    assert got_tokens == want_tokens
