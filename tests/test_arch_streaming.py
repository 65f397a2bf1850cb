"""Batch-1 expert streaming for glm4_moe, deepseek_v3, gpt_oss, gemma4 (MoE) and the sparse-attention
models: sigmoid routers with score biases and group-limited top-k, gpt-oss's router and expert biases
and clamped SwiGLU, Gemma 4's router input and per-expert scale, DSA's indexer beside its experts, run
from the file through an expert cache of half the experts' bytes, give the resident run's greedy tokens.

The tiny checkpoints are test_arch_logits' (transformers configs, random weights, fp32 safetensors),
test_arch_gemma4's and test_arch_dsa's.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from twinfer.runtime.experts import ExpertReader, expert_params, is_expert_weight
from twinfer.runtime.loaders import load_model
from twinfer.runtime.synthetic import greedy_tokens

pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_arch_logits import saved  # noqa: E402

PROMPT = [3, 17, 99, 5, 64, 120, 8, 41, 77, 2, 56]
STEPS = 8
CASES = ["glm4_moe-a", "deepseek_v3-a", "gpt_oss-b"]


def _runners(backend: str) -> tuple[object, object]:
    if backend == "torch":
        from twinfer.backends.cuda.experts import load_streaming_torch_runner as stream
        from twinfer.backends.cuda.runner import load_torch_runner as full
    else:
        pytest.importorskip("mlx.core")
        from twinfer.backends.metal.experts import load_streaming_mlx_runner as stream  # type: ignore[assignment]
        from twinfer.backends.metal.runner import load_mlx_runner as full  # type: ignore[assignment]
    return stream, full


def test_reader_matches_loaded_experts() -> None:
    """Every expert the reader takes from the file (fused, interleaved, transposed) equals the loaded weight."""
    for case in CASES:
        weights = load_model(saved(case)).weights
        reader = ExpertReader(weights)
        layer = weights.spec.num_layers - 1
        full = [weights.load(f"layers.{layer}.experts.{p}") for p in ("gate", "up", "down")]
        for e in (0, 5):
            for got, want in zip(reader.read(layer, e), full, strict=True):
                assert np.array_equal(got, want[e]), case
        assert not any(is_expert_weight(n) for n in weights.names() if n.endswith("_bias"))


NEW_FAMILIES = [(c, b) for c in ("gemma4:moe-keqv", "dsa:glm_moe_dsa-b", "dsa:deepseek_v32-a") for b in ("torch", "mlx")]


def _folder(case: str) -> Path:
    family, _, name = case.partition(":")
    if family == "gemma4":
        from test_arch_gemma4 import saved as gemma4_saved

        return gemma4_saved(name)
    if family == "dsa":
        from test_arch_dsa import saved as dsa_saved

        return dsa_saved(name)
    return saved(case)


@pytest.mark.parametrize("backend", ["torch", "mlx"])
@pytest.mark.parametrize("case", CASES)
def test_streamed_greedy_equals_resident_at_half_budget(case: str, backend: str) -> None:
    _check(case, backend)


@pytest.mark.parametrize(("case", "backend"), NEW_FAMILIES)
def test_new_families_stream_at_half_budget(case: str, backend: str) -> None:
    _check(case, backend)


def _check(case: str, backend: str) -> None:
    stream, full = _runners(backend)
    loaded = load_model(_folder(case))
    spec = loaded.spec
    assert spec.moe is not None
    want = greedy_tokens(full(loaded, kv_tokens=64), PROMPT, STEPS)  # type: ignore[operator]
    per_expert = expert_params(spec) * 4
    n_experts = spec.moe.num_experts * sum(spec.is_moe_layer(i) for i in range(spec.num_layers))
    half = n_experts * per_expert // 2
    runner = stream(loaded, cache_bytes=half, kv_tokens=64)  # type: ignore[operator]
    cache = runner.ops.cache
    try:
        got = greedy_tokens(runner, PROMPT, STEPS)
        print(f"{case} {backend}: {cache.stats.misses} misses, {cache.stats.evictions} evictions, "
              f"{cache.resident_bytes} of {half} bytes resident")
        assert got == want
        assert cache.stats.misses > 0 and cache.stats.evictions > 0  # the cache really turned over
        assert cache.resident_bytes <= half
    finally:
        cache.close()
    assert math.prod(loaded.weights.shape(f"layers.{spec.num_layers - 1}.experts.gate")) * 3 * 4 == \
        per_expert * spec.moe.num_experts


@pytest.mark.slow
def test_2gb_gpt_oss_moe_at_half_budget(tmp_path: Path) -> None:
    """A synthetic gpt-oss-shaped model (biased router and experts, clamped SwiGLU, sinks, sliding
    layers) of more than 2 GB streams at half its size within the documented slack."""
    from tests.synthetic_gpt_oss import SyntheticGptOss
    from tests.test_experts import RSS_SLACK, _bench
    from twinfer.runtime.synthetic import write_synthetic_moe

    shape = SyntheticGptOss()
    assert shape.expert_bytes >= 2e9
    folder = write_synthetic_moe(tmp_path / "oss2g", shape)
    weight_bytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    budget = weight_bytes // 2
    full = _bench(folder, "torch", 0, 3)
    streamed = _bench(folder, "torch", budget, 3)
    assert streamed["tokens"] == full["tokens"]
    assert streamed["peak_over_baseline"] <= budget + RSS_SLACK, (streamed, budget)  # type: ignore[operator]
    assert full["peak_over_baseline"] > budget  # type: ignore[operator]
