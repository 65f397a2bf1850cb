"""Batch-1 MoE expert streaming: the LRU cache, per-expert reads, and streamed == resident."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from twinfer.runtime.errors import PlanError
from twinfer.runtime.experts import ExpertCache, ExpertReader
from twinfer.runtime.loaders import load_model
from twinfer.runtime.synthetic import SyntheticMoE, write_synthetic_moe

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_experts.py"
TINY = SyntheticMoE(hidden=64, intermediate=32, layers=3, experts=8, top_k=2, vocab=128, heads=2, kv_heads=1,
                    head_dim=32)


class _FakeReader:
    def __init__(self) -> None:
        self.reads: list[tuple[int, int]] = []

    def read(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        self.reads.append((layer, expert))
        v = np.full((2, 2), layer * 100 + expert, dtype=np.float32)
        return v, v, v

    def stored_bytes(self, layer: int, expert: int) -> int:
        return 48


def _cache(capacity_experts: int, prefetch: bool = False) -> tuple[ExpertCache, _FakeReader]:
    reader = _FakeReader()
    cache = ExpertCache(reader, lambda a: a, capacity_experts * 48, 48, 2, prefetch_enabled=prefetch)  # type: ignore[arg-type]
    return cache, reader


def test_cache_is_lru_and_bounded() -> None:
    cache, reader = _cache(3)
    for e in (0, 1, 2):
        cache.fetch(0, e)
    cache.fetch(0, 0)  # 0 becomes most recent; 1 is now the oldest
    cache.fetch(0, 3)  # evicts 1
    assert cache.cached() == [(0, 2), (0, 0), (0, 3)]
    assert cache.resident_bytes <= 3 * 48
    assert cache.fetch(0, 1)[0][0, 0] == 1.0  # read again after eviction
    s = cache.stats
    assert (s.lookups, s.hits, s.misses, s.evictions) == (6, 1, 5, 2)
    assert s.bytes_read == 5 * 48 and reader.reads.count((0, 1)) == 2


def test_prefetch_counts_against_capacity_and_becomes_hits() -> None:
    cache, reader = _cache(4, prefetch=True)
    cache.fetch(0, 0)
    cache.prefetch(1, [5, 6, 7])  # at most top_k=2 in flight
    assert cache.stats.prefetched == 2 and cache.resident_bytes <= 4 * 48
    cache.fetch(1, 5)
    cache.drain()  # the unused prefetch of expert 6 lands in the cache too
    assert cache.stats.prefetch_hits == 1 and (1, 6) in cache.cached()
    assert cache.stats.hit_rate == pytest.approx(1 / 2)
    cache.close()


def test_cache_smaller_than_one_token_is_a_plan_error() -> None:
    with pytest.raises(PlanError, match="memory-budget"):
        _cache(1)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_moe(tmp_path_factory.mktemp("moe"), TINY, seed=3)


def test_reader_matches_loaded_weights(tiny_moe: Path) -> None:
    loaded = load_model(tiny_moe)
    reader = ExpertReader(loaded.weights)
    for part, got in zip(("gate", "up", "down"), reader.read(2, 5), strict=True):
        assert np.array_equal(got, loaded.weights.load(f"layers.2.experts.{part}")[5])
    assert reader.stored_bytes(2, 5) == 3 * 32 * 64 * 4


def test_reader_slices_stacked_gguf_experts(tmp_path: Path) -> None:
    from tests.fixtures_models import hf_model, write_gguf_like_llamacpp

    canonical = write_gguf_like_llamacpp("qwen3_moe", hf_model("qwen3_moe"), tmp_path / "m.gguf")
    reader = ExpertReader(load_model(tmp_path / "m.gguf").weights)
    gate, up, down = reader.read(1, 3)
    assert np.array_equal(gate, canonical["layers.1.experts.gate"][3])
    assert np.array_equal(down, canonical["layers.1.experts.down"][3])


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_streamed_greedy_equals_resident_in_process(tiny_moe: Path, backend: str) -> None:
    pytest.importorskip(backend)
    from twinfer.runtime.synthetic import greedy_tokens

    loaded = load_model(tiny_moe)
    if backend == "torch":
        from twinfer.backends.cuda.experts import load_streaming_torch_runner as stream
        from twinfer.backends.cuda.runner import load_torch_runner as full
    else:
        from twinfer.backends.metal.experts import load_streaming_mlx_runner as stream  # type: ignore[assignment]
        from twinfer.backends.metal.runner import load_mlx_runner as full  # type: ignore[assignment]
    want = greedy_tokens(full(loaded, kv_tokens=64), [1, 2, 3, 4, 5], 6)
    expert = 3 * 32 * 64 * 4
    runner = stream(loaded, cache_bytes=5 * expert, kv_tokens=64)  # 5 of 24 experts
    assert greedy_tokens(runner, [1, 2, 3, 4, 5], 6) == want
    stats = runner.ops.cache.stats  # type: ignore[attr-defined]
    assert stats.misses > 0 and stats.evictions > 0
    assert runner.ops.cache.resident_bytes <= 5 * expert  # type: ignore[attr-defined]
    runner.ops.cache.close()  # type: ignore[attr-defined]


def _bench(folder: Path, backend: str, budget: int, steps: int) -> dict[str, object]:
    cmd = [sys.executable, str(BENCH), "--child", str(folder), "--backend", backend, "--budget", str(budget),
           "--steps", str(steps)]
    root = str(BENCH.parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=root, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


# the documented overhead beyond the budget: allocator slack of the staged reads (no interpreter)
RSS_SLACK = 32 << 20


def _budget_run(folder: Path, backend: str, steps: int) -> None:
    weight_bytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    budget = weight_bytes // 2
    full = _bench(folder, backend, 0, steps)
    streamed = _bench(folder, backend, budget, steps)
    assert streamed["tokens"] == full["tokens"]
    assert streamed["peak_over_baseline"] <= budget + RSS_SLACK, (streamed, budget)  # type: ignore[operator]
    assert full["peak_over_baseline"] > budget  # type: ignore[operator]
    stats = streamed["stats"]
    assert 0.0 < stats["hit_rate"] < 1.0 and stats["bytes_per_token"] > 0  # type: ignore[index]


@pytest.fixture(scope="module")
def moe_200mb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_moe(tmp_path_factory.mktemp("moe200"), SyntheticMoE())


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_200mb_moe_at_half_budget(moe_200mb: Path, backend: str) -> None:
    pytest.importorskip(backend)
    _budget_run(moe_200mb, backend, steps=4)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_2gb_moe_at_half_budget(tmp_path: Path, backend: str) -> None:
    pytest.importorskip(backend)
    shape = SyntheticMoE(hidden=1024, intermediate=512, layers=12, experts=28, top_k=4)
    assert shape.expert_bytes >= 2 << 30 or shape.expert_bytes >= 2e9
    _budget_run(write_synthetic_moe(tmp_path / "moe2g", shape), backend, steps=3)


def test_streaming_builds_for_every_router() -> None:
    """Sigmoid routers (DeepSeek-V3, GLM-4.5) and gpt-oss's biased, clamped experts stream too
    (tests/test_arch_streaming.py checks their tokens): building the ops refuses none of them."""
    from twinfer.runtime.experts import StreamingOps
    from twinfer.runtime.spec import ModelSpec, MoESpec

    def spec(**moe: object) -> ModelSpec:
        return ModelSpec("x", 64, 16, 2, 2, 2, 8, 32, moe=MoESpec(4, 2, 8, **moe))  # type: ignore[arg-type]

    for s in (spec(), spec(scoring="sigmoid", score_bias=True),
              spec(router_bias=True, expert_bias=True, swiglu_limit=7.0)):
        assert StreamingOps(None, None, {}, s).spec is s  # type: ignore[arg-type]
