"""Verdicts users can trust: explicit formats planned where a runner runs them."""

from __future__ import annotations

import pytest

from twinfer.planners.catalog import find
from twinfer.planners.hardware import Cluster, lookup
from twinfer.planners.hw_table import DEVICES, NODE_SHAPES
from twinfer.planners.plan import Plan, make_plan
from twinfer.planners.search import Request


def _plan(model: str, hardware: str, fmt: str = "auto", context: int = 4096) -> Plan:
    device, _ = lookup(hardware, DEVICES, NODE_SHAPES)
    return make_plan(find(model).profile(), Cluster(device), Request(context=context, weights_format=fmt))


def test_an_explicit_gguf_format_on_a_datacenter_gpu_runs_on_llama_cpp_with_the_reason() -> None:
    plan = _plan("llama-2-7b", "a30", "q4_0")
    assert plan.target == "datacenter" and plan.fits and plan.strategy is not None
    assert (plan.strategy.mix.name, plan.strategy.engine) == ("q4_0", "llamacpp")
    why = next(r for r in plan.reasons if r.startswith("--format q4_0"))
    assert "not native on NVIDIA A30" in why and "llama.cpp runner" in why
    assert 90 < plan.to_json()["predicted"]["decode_tokens_per_s"] < 130  # the scoreboard's A30: 124.8 at tg128


def test_left_to_choose_the_datacenter_target_still_serves_only_native_formats() -> None:
    plan = _plan("llama-2-7b", "a30")
    assert plan.fits and plan.strategy is not None and plan.strategy.engine != "llamacpp"
    assert not any(r.startswith("--format") for r in plan.reasons)


@pytest.mark.parametrize("hardware", ["rtx-4090", "rtx-3090"])
@pytest.mark.parametrize("fmt", ["mxfp4", "native"])
def test_gpt_oss_as_published_plans_on_the_runner_that_runs_it(hardware: str, fmt: str) -> None:
    plan = _plan("gpt-oss-20b", hardware, fmt)
    assert plan.fits and plan.strategy is not None, plan.suggestion
    assert (plan.strategy.mix.name, plan.strategy.engine) == ("gguf-mxfp4", "llamacpp")
    why = next(r for r in plan.reasons if r.startswith(f"--format {fmt}"))
    assert "MXFP4 experts + BF16" in why and "torch runner does not hold mxfp4" in why
    auto = _plan("gpt-oss-20b", hardware)  # the same file the planner picks unasked, at the same speed
    assert auto.strategy is not None and auto.strategy.mix.name == "gguf-mxfp4"
    assert plan.to_json()["predicted"]["decode_tokens_per_s"] == pytest.approx(
        auto.to_json()["predicted"]["decode_tokens_per_s"])


def test_asking_for_a_models_main_format_means_the_published_mix_not_a_requantization() -> None:
    plan = _plan("gpt-oss-20b", "b200", "mxfp4")  # Blackwell multiplies FP4: the published checkpoint as is
    assert plan.fits and plan.strategy is not None and plan.strategy.mix.name == "mxfp4-moe"
