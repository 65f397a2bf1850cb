"""glm4_moe, deepseek_v3 and gpt_oss under tensor and expert parallelism over gloo, against one process.

The tiny checkpoints of test_arch_logits.py, loaded by every rank from the saved folder, run the
scripted two-sequence workload of test_parallel.py: logits within 1e-5 of the single-process torch
runner and identical greedy tokens under TP=2, EP=2, TP=2 x EP=2 and PP=2. MLA splits its heads (the
absorbed projections included) and replicates the latent cache.
"""

from __future__ import annotations

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


@pytest.mark.parametrize("config", CONFIGS, ids=["tp2", "ep2", "tp2xep2", "pp2"])
@pytest.mark.parametrize("case", CASES)
def test_parallel_matches_single_process(case: str, config: ParallelConfig) -> None:
    folder = saved(case)
    want_rows, want_tokens = workload(load_torch_runner(load_model(folder), kv_tokens=KV_TOKENS, block_size=BLOCK))
    runner = launch(WeightSource(path=str(folder)), config, RunOptions(kv_tokens=KV_TOKENS, block_size=BLOCK,
                                                                      timeout_s=180))
    try:
        got_rows, got_tokens = workload(runner)
    finally:
        runner.close()
    assert got_rows.shape == want_rows.shape
    assert np.abs(got_rows - want_rows).max() <= TOL
    assert got_tokens == want_tokens
