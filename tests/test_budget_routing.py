"""Expert routing on the budget's MoE GGUF (8 layers, 32 experts top-4, 79 MB), read from llama.cpp's graph:
the uniform builder spreads every layer's top-4 evenly where random weights favour a few experts, and the
expert pager counts each expert a decode step reads once, as a hit or a miss."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from budget_child import tiny_moe_gguf

MB = 2**20


@pytest.fixture(scope="module")
def models() -> dict[str, Path]:
    return {r: tiny_moe_gguf(r, needs="/proc/self/pagemap") for r in ("random", "uniform")}


def test_uniform_routing_spreads_every_layer(models: dict[str, Path]) -> None:
    """On a held-out text that favours no token, every layer's usage entropy is within 5% of log(32) with the
    uniform routers, and at least one layer's is not with the random ones (the builder is what spreads it)."""
    from twinfer.backends.llamacpp.routing import trace, vocabulary_text

    text = vocabulary_text(models["uniform"], 256, seed=0)
    ratios = {}
    for routing, path in models.items():
        _, usage = trace(path, text[:1], text[1:])
        assert usage.counts.sum() == 255 * 8 * 4  # every decode step, every layer, top-4
        ratios[routing] = usage.entropy / math.log(32)
    assert ratios["uniform"].min() >= 0.95, ratios["uniform"]
    assert ratios["random"].min() < 0.9, ratios["random"]


def test_pager_counts_every_expert_load(models: dict[str, Path]) -> None:
    """hits + misses equal the expert loads the steps made; under a zero bound every step starts trimmed (all
    misses), under a bound that holds every expert nearly all loads after the prompt are hits."""
    from twinfer.backends.llamacpp.routing import trace, vocabulary_text

    path = models["random"]
    text = vocabulary_text(path, 65, seed=0)
    for bound, least, most in ((0, 0.0, 0.0), (256 * MB, 0.9, 1.0)):
        rt, usage = trace(path, text[:1], text[1:], bound=bound)
        loads = sum(len(chosen) for step in rt.steps[1:] for chosen in step.values())
        assert usage.pager is not None and loads == 64 * 8 * 4
        assert usage.pager["hits"] + usage.pager["misses"] == loads
        assert least <= usage.pager["hits"] / loads <= most, usage.pager
