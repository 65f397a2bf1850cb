"""The bill's bytes on the runners tests/test_bill.py leaves out: the window-bounded torch runner
(backends/cuda/window.py) and MLX (backends/metal). Each request's weights, experts and KV read and
written must agree with the planner's per-token figures (`ModelProfile.step_bytes`,
`kv_bytes_per_seq`) on the same checkpoint within 10%, as the llama.cpp runner's do on the default model.
The tensor-parallel torch runner bills the model as a whole: the single-process runner's bytes exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from twinfer.runtime.engine import Engine, EngineConfig, GuardConfig, SamplingParams
from twinfer.runtime.loaders import load_model

PROMPT = [(5 * i + 3) % 96 for i in range(8)]
NEW = 24  # decode well past gpt-oss's windows (4 and 6), so the sliding layers' reads stop at them


def assert_bill_matches_planner(runner: Any, folder: Path, prompt: list[int] = PROMPT, new: int = NEW) -> None:
    """One greedy request of `new` tokens through the engine; its bill against the planner's figures."""
    from twinfer.planners.cost import kv_bytes_per_seq
    from twinfer.planners.formats import KV_FORMATS
    from twinfer.planners.source import profile_from_loaded

    engine = Engine(runner, None, EngineConfig(max_seqs=1, max_context=64))
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, guard=GuardConfig(enabled=False))
    cost = engine.generate([prompt], params)[0].cost
    assert cost is not None and cost["tokens"]["output"] == new and cost["tokens"]["computed"] == len(prompt)
    got = cost["bytes"]
    profile = profile_from_loaded(load_model(folder))
    moe, p = profile.spec.moe, len(prompt)

    def touched(tokens: int) -> float:
        return float(min(moe.num_experts, tokens * moe.top_k)) if moe is not None else 0.0

    # one prefill step (the first token), then a decode step per further token
    weights = profile.step_bytes(profile.stored, touched(p)) + (new - 1) * profile.step_bytes(profile.stored, touched(1))
    assert got["weights_read"] + got["experts_read"] == pytest.approx(weights, rel=0.10)
    assert (got["experts_read"] > 0) == (moe is not None)
    f32 = KV_FORMATS["f32"]  # the runners' KV on a CPU: float32 K and V
    assert got["kv_written"] == pytest.approx((p + new - 1) * kv_bytes_per_seq(profile, f32, 1), rel=0.10)
    read = kv_bytes_per_seq(profile, f32, p) + sum(kv_bytes_per_seq(profile, f32, c) for c in range(p + 1, p + new))
    assert got["kv_read"] == pytest.approx(read, rel=0.10)
    assert got["kv_transferred"] == got["kv_transfer_overhead"] == 0


@pytest.fixture(scope="module")
def gpt_oss() -> Path:
    """test_arch_logits' tiny random gpt-oss (MoE, sinks, sliding windows 4 and 6), saved as transformers does."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from test_arch_logits import saved

    return saved("gpt_oss-a")


def test_windowed_torch_bill_matches_the_planner(gpt_oss: Path) -> None:
    from twinfer.backends.cuda.window import build_windowed_torch_runner

    loaded = load_model(gpt_oss)
    spec = loaded.spec
    runner = build_windowed_torch_runner(spec, loaded.weights, max_seqs=1, max_chunk=8, kv_tokens=64, block_size=2)
    t = runner.traffic
    assert t is not None
    # each layer's own cache per position: the sliding layers' pool is smaller than the context, not cheaper
    assert t.kv_bytes_per_token == spec.kv_bytes_per_token(4.0)
    assert_bill_matches_planner(runner, gpt_oss)


def test_mlx_bill_matches_the_planner(gpt_oss: Path) -> None:
    pytest.importorskip("mlx.core")
    from twinfer.backends.metal.runner import load_mlx_runner

    loaded = load_model(gpt_oss)
    runner = load_mlx_runner(loaded, kv_tokens=64, block_size=2)
    t = runner.traffic
    assert t is not None and t.kv_bytes_per_token == loaded.spec.kv_bytes_per_token(4.0)
    assert t.num_experts == loaded.spec.moe.num_experts and t.expert_bytes > 0  # routed experts apart
    assert_bill_matches_planner(runner, gpt_oss)


def test_windowed_runner_refuses_a_kv_connector_by_name(gpt_oss: Path) -> None:
    """Its sliding layers keep only the window's blocks, which a decoder's fresh table cannot take as they are."""
    pytest.importorskip("fastapi")
    from twinfer.app.pd import attach_kv_connector
    from twinfer.backends.cuda.window import build_windowed_torch_runner
    from twinfer.runtime.errors import TwinferError

    loaded = load_model(gpt_oss)
    runner = build_windowed_torch_runner(loaded.spec, loaded.weights, max_seqs=1, kv_tokens=64, block_size=2)
    engine = Engine(runner, None, EngineConfig(max_seqs=1, max_context=64))
    with pytest.raises(TwinferError, match="WindowedTorchRunner.*window-bounded.*--kv-connector"):
        attach_kv_connector(engine)


def test_tensor_parallel_bill_equals_one_process() -> None:
    """--tp 2 bills the model as a whole (every weight and KV head once, across ranks): the same bytes as
    the single-process torch runner's bill for the same request."""
    pytest.importorskip("torch")
    from test_parallel import BLOCK, KV_TOKENS, SPECS, weights

    from twinfer.backends.cuda.parallel import ParallelConfig, RunOptions, WeightSource, launch
    from twinfer.backends.cuda.runner import build_torch_runner

    spec = SPECS["qwen3_moe"]
    single = build_torch_runner(spec, weights("qwen3_moe"), kv_tokens=KV_TOKENS, block_size=BLOCK)
    tp = launch(WeightSource(spec=spec, weights=weights("qwen3_moe")), ParallelConfig(tp=2),
                RunOptions(kv_tokens=KV_TOKENS, block_size=BLOCK, timeout_s=120))
    try:
        assert tp.traffic == single.traffic
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, guard=GuardConfig(enabled=False))
        costs = [Engine(r, None, EngineConfig(max_seqs=1, max_context=64)).generate([PROMPT], params)[0].cost
                 for r in (single, tp)]
    finally:
        tp.close()
    assert costs[0] is not None and costs[1] is not None
    assert costs[1]["bytes"] == costs[0]["bytes"] and costs[1]["bytes"]["experts_read"] > 0
