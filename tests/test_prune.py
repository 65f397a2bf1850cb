"""Pruning: block influence ranks layers, experts by routing mass, and pruned files load and run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from twinfer.app.runners import RUNNERS
from twinfer.quant.kl import kl_rows
from twinfer.quant.prune import PruneOptions, measure_influence, prune_model, rank_layers_by_kl
from twinfer.quant.prune_write import write_pruned_gguf, write_pruned_hf
from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch
from twinfer.runtime.errors import TwinferError
from twinfer.runtime.loaders import load_model, spec_from_config
from twinfer.runtime.synthetic import SyntheticMoE, write_synthetic_moe

torch = pytest.importorskip("torch")

WINDOWS = [list(np.random.default_rng(0).integers(0, 96, 24)), list(np.random.default_rng(1).integers(0, 96, 24))]


def _gemma3() -> tuple[object, dict[str, np.ndarray]]:
    from tests.fixtures_models import hf_canonical, hf_model, state_dict_np

    model = hf_model("gemma3")
    spec = spec_from_config(model.config.to_dict())
    return spec, hf_canonical(state_dict_np(model), "gemma3", True)


def _logits(runner: object, tokens: list[int]) -> np.ndarray:
    table = list(range(-(-len(tokens) // runner.kv.block_size)))  # type: ignore[attr-defined]
    return runner.step(StepBatch([SeqChunk(1, tokens, 0, table, LogitsWanted.ALL)]))  # type: ignore[attr-defined]


def _renumbered(weights: dict[str, np.ndarray], keep: list[int]) -> dict[str, np.ndarray]:
    out = {}
    for name, value in weights.items():
        if name.startswith("layers."):
            _, layer, rest = name.split(".", 2)
            if int(layer) not in keep:
                continue
            name = f"layers.{keep.index(int(layer))}.{rest}"
        out[name] = value
    return out


def test_a_block_that_does_nothing_is_removed_first() -> None:
    from twinfer.backends.cuda.runner import build_torch_runner

    spec, weights = _gemma3()
    weights = _identity(weights, [4])
    influence = measure_influence(build_torch_runner(spec, weights, kv_tokens=64), WINDOWS)  # type: ignore[arg-type]
    assert influence.layers[4] < 1e-6 < influence.layers.min(initial=1.0, where=np.arange(7) != 4)
    assert influence.layers_to_remove(1) == [4]
    assert influence.tokens == 48
    with pytest.raises(TwinferError, match="keep at least one"):
        influence.layers_to_remove(7)


def _identity(weights: dict[str, np.ndarray], layers: list[int]) -> dict[str, np.ndarray]:
    out = dict(weights)
    for i in layers:  # attention and MLP add 0 (Gemma's post-norms of 0 are 0): the block passes x through
        out[f"layers.{i}.o"] = np.zeros_like(out[f"layers.{i}.o"])
        out[f"layers.{i}.down"] = np.zeros_like(out[f"layers.{i}.down"])
    return out


def test_greedy_kl_ranking_scores_what_removing_the_layers_costs() -> None:
    from twinfer.backends.cuda.runner import build_torch_runner

    spec, weights = _gemma3()
    weights = _identity(weights, [4])
    ranking = rank_layers_by_kl(build_torch_runner(spec, weights, kv_tokens=64), WINDOWS, 3)  # screens 1 row in 4
    assert ranking.removed[0] == 4 and ranking.kl[0] < 1e-6  # removing a no-op block costs nothing
    assert len(set(ranking.removed)) == 3 and ranking.rows == 48
    assert ranking.kl[0] <= ranking.kl[1] <= ranking.kl[2]
    # the ranking's KL is the pruned model's: skip the same blocks in a plain runner and measure
    skipped = _identity(weights, list(ranking.removed[:2]))
    kl = np.concatenate([kl_rows(_logits(build_torch_runner(spec, weights, kv_tokens=64), w),
                                 _logits(build_torch_runner(spec, skipped, kv_tokens=64), w)) for w in WINDOWS]).mean()
    np.testing.assert_allclose(ranking.kl[1], kl, rtol=1e-3, atol=1e-7)
    with pytest.raises(TwinferError, match="keep at least one"):
        rank_layers_by_kl(build_torch_runner(spec, weights, kv_tokens=64), WINDOWS, 7)


def test_pruned_gguf_keeps_layer_types_and_matches_dropped_layers(tmp_path: Path) -> None:
    from tests.fixtures_models import hf_model, write_gguf_like_llamacpp
    from twinfer.backends.cuda.runner import build_torch_runner, load_torch_runner

    canonical = write_gguf_like_llamacpp("gemma3", hf_model("gemma3"), tmp_path / "g.gguf")
    loaded = load_model(tmp_path / "g.gguf")
    keep = [0, 2, 3, 5, 6]  # layer 5 is the global one: after pruning it is layer 3
    write_pruned_gguf(tmp_path / "g.gguf", tmp_path / "p.gguf", loaded.spec, keep)
    pruned = load_model(tmp_path / "p.gguf")
    assert pruned.spec.num_layers == 5
    assert pruned.spec.attention_types == tuple(loaded.spec.attention_types[i] for i in keep)
    assert pruned.spec.attention_types[3] == "full_attention"
    want = _logits(build_torch_runner(pruned.spec, _renumbered(canonical, keep), kv_tokens=64), WINDOWS[0])
    got = _logits(load_torch_runner(pruned, kv_tokens=64), WINDOWS[0])
    np.testing.assert_array_equal(got, want)


def test_hf_moe_expert_and_layer_pruning(tmp_path: Path) -> None:
    shape = SyntheticMoE(hidden=64, intermediate=32, layers=3, experts=6, top_k=2, vocab=96, heads=2, kv_heads=1,
                         head_dim=32)
    src = write_synthetic_moe(tmp_path / "moe", shape)
    original = load_model(src).weights
    keep_experts = {0: [0, 2, 3, 5], 2: [1, 2, 4, 5]}
    write_pruned_hf(src, tmp_path / "out", [0, 2], keep_experts)
    pruned = load_model(tmp_path / "out")
    assert (pruned.spec.num_layers, pruned.spec.moe.num_experts) == (2, 4)  # type: ignore[union-attr]
    np.testing.assert_array_equal(pruned.weights.load("layers.1.router"), original.load("layers.2.router")[[1, 2, 4, 5]])
    np.testing.assert_array_equal(pruned.weights.load("layers.1.experts.down"),
                                  original.load("layers.2.experts.down")[[1, 2, 4, 5]])
    np.testing.assert_array_equal(pruned.weights.load("layers.0.q"), original.load("layers.0.q"))


def test_expert_routing_mass_ranks_experts(tmp_path: Path) -> None:
    from twinfer.backends.cuda.runner import load_torch_runner

    shape = SyntheticMoE(hidden=64, intermediate=32, layers=2, experts=6, top_k=2, vocab=96, heads=2, kv_heads=1,
                         head_dim=32)
    loaded = load_model(write_synthetic_moe(tmp_path / "moe", shape))
    influence = measure_influence(load_torch_runner(loaded, kv_tokens=64), WINDOWS)
    assert influence.experts is not None
    np.testing.assert_allclose(influence.experts.sum(-1), 1.0, rtol=1e-6)  # renormalized top-k per token
    kept = influence.experts_to_keep(2)
    assert all(len(v) == 4 for v in kept.values())
    for layer, experts in kept.items():
        dropped = sorted(set(range(6)) - set(experts))
        assert influence.experts[layer, dropped].max() <= influence.experts[layer, experts].min()


def test_prune_default_model_runs_on_every_backend(tmp_path: Path, default_model: Path) -> None:
    result = prune_model(str(default_model), str(tmp_path), PruneOptions(layers=2, tokens=48, window=48, kl_tokens=47),
                         runners=RUNNERS)
    assert len(result.removed_layers) == 2 and len(result.kept_layers) == 16
    assert result.kl is not None and 0.0 < result.kl.mean_kl < 5.0
    out = Path(result.out)
    assert out.suffix == ".gguf" and load_model(out).spec.num_layers == 16
    from twinfer.quant.fidelity import measure_kl

    # llama.cpp must read the per-layer sliding pattern, or its logits drift from twinfer's
    for backend in ("torch", "mlx"):
        pytest.importorskip(backend)
        same = measure_kl(str(out), "llamacpp", backend, "prose", 47, 48, runners=RUNNERS)
        assert same.mean_kl < 0.02 and same.top1_agreement > 0.9, (backend, same)
