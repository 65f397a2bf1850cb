"""The seeds' arithmetic and the strategy verdicts the design asks for (docs/architecture.md), as tests."""

from __future__ import annotations

import pytest

from twinfer.planners.calibration import Calibration
from twinfer.planners.catalog import find
from twinfer.planners.cost import Strategy, _native, decode_step, kv_native
from twinfer.planners.formats import KV_FORMATS, MIXES
from twinfer.planners.hardware import Cluster, lookup
from twinfer.planners.hw_table import DEVICES, NODE_SHAPES
from twinfer.planners.model import parametric
from twinfer.planners.plan import make_plan
from twinfer.planners.search import Request
from twinfer.runtime.errors import PlanError

KIMI_3 = dict(params=2.8e12, active=60e9)


def _cluster(name: str, gpus: int = 1) -> Cluster:
    device, _ = lookup(name, DEVICES, NODE_SHAPES)
    return Cluster(device, gpus_per_node=gpus)


def test_2_8t_moe_at_nvfp4_is_about_1_4_tb() -> None:
    weights = parametric(**KIMI_3).weight_bytes(MIXES["nvfp4"])
    # half a byte per parameter is 1.4 TB; NVFP4's FP8 scale per 16 weights adds 1/16 byte
    assert 1.40e12 <= weights <= 1.60e12


def test_2_8t_moe_fits_8x_gb300_not_8x_b200_nor_8x_h100() -> None:
    model = parametric(**KIMI_3)
    nvfp4 = Request(4096, 1, "nvfp4")
    assert not make_plan(model, _cluster("b200", 8), nvfp4).fits  # 8 x 180 GB = 1.44 TB, nothing left for KV
    assert make_plan(model, _cluster("gb300", 8), nvfp4).fits  # 8 x 288 GB
    assert not make_plan(model, _cluster("h100", 8), Request()).fits  # 640 GB: no faithful format fits
    gb300 = make_plan(model, _cluster("gb300", 8), Request()).to_json()
    assert gb300["fits"] and gb300["parallelism"]["tp"] * gb300["parallelism"]["pp"] == 8


def test_gpt_oss_20b_fits_a_12gb_gpu_by_active_parameters_only_at_batch_one() -> None:
    model = find("gpt-oss-20b").profile()
    gpu = _cluster("rtx-3060")  # 12 GB
    one = make_plan(model, gpu, Request(4096, 1)).to_json()
    assert one["fits"] and one["moe"]["mode"] == "stream"
    assert one["memory"]["weights_bytes"] > gpu.capacity_per_device  # the whole model would not fit
    assert one["moe"]["resident_bytes"] < gpu.capacity_per_device
    served = make_plan(model, gpu, Request(4096, 64))
    j = served.to_json()
    assert j.get("moe") is None or j["moe"]["mode"] == "full"  # every expert is reached at concurrency 64
    assert any("every expert" in r for r in served.reasons) or not served.fits
    big = make_plan(model, _cluster("h100"), Request(4096, 64)).to_json()
    assert big["fits"] and big["moe"]["mode"] == "full"
    assert big["memory"]["resident_weights_bytes_per_device"] == pytest.approx(big["memory"]["weights_bytes"])


@pytest.mark.parametrize("model,gpus", [("llama-3.1-8b", 1), ("llama-3.1-70b", 1), ("gpt-oss-120b", 1),
                                        ("qwen3-30b-a3b", 1), ("deepseek-v3", 8), ("llama-3.1-405b", 8)])
@pytest.mark.parametrize("concurrency", [1, 64])
def test_b200_never_picks_a_dequantization_loop_when_a_native_format_fits(model: str, gpus: int,
                                                                         concurrency: int) -> None:
    cluster = _cluster("b200", gpus)
    plan = make_plan(find(model).profile(), cluster, Request(4096, concurrency))
    assert plan.fits and plan.strategy is not None
    for fmt in plan.strategy.mix.formats() - {"f32"}:
        assert _native(cluster.device, fmt), f"{model}: {fmt} needs dequantization on a B200"
    assert kv_native(cluster.device, plan.strategy.kv), f"{model}: KV {plan.strategy.kv.name} needs dequantization"


def test_m_series_64gb_llama_70b_is_compressed_because_of_bandwidth() -> None:
    plan = make_plan(find("llama-3.1-70b").profile(), _cluster("m2-max-38c@64"), Request())
    assert plan.fits and plan.strategy is not None
    assert plan.strategy.mix.name not in ("bf16", "f16", "fp8")
    assert plan.to_json()["memory"]["weights_bytes"] < 0.35 * find("llama-3.1-70b").profile().total_params * 2
    assert any("compressed" in r and "bandwidth" in r for r in plan.reasons)


def test_turboquant_verdict_flips_between_a_laptop_and_a_b200() -> None:
    """Same model, same formats: the dequantization term decides, not the platform's name."""
    model, cal = find("llama-3.1-8b").profile(), Calibration()
    kv = KV_FORMATS["f16"]

    def speed(hw: str, fmt: str, engine: str) -> float:
        s = Strategy(MIXES[fmt], kv, engine)
        return 1 / decode_step(model, _cluster(hw), s, 1, 4096, cal).latency_s

    assert speed("m2-max-38c", "tq4", "mlx") > 2 * speed("m2-max-38c", "f16", "mlx")  # bytes dominate
    laptop = decode_step(model, _cluster("m2-max-38c"), Strategy(MIXES["tq4"], kv, "mlx"), 1, 4096, cal)
    assert laptop.dequant_s < laptop.memory_s
    b200 = decode_step(model, _cluster("b200"), Strategy(MIXES["tq4"], kv, "torch"), 1, 4096, cal)
    nvfp4 = decode_step(model, _cluster("b200"), Strategy(MIXES["nvfp4"], kv, "torch"), 1, 4096, cal)
    assert b200.dequant_s > b200.memory_s  # on 8 TB/s the loop costs more than the bytes it saves
    assert nvfp4.latency_s < b200.latency_s


def test_pipeline_parallel_only_across_nodes() -> None:
    model = find("llama-3.1-405b").profile()
    one_node = make_plan(model, _cluster("h100", 8), Request(4096, 1, "fp8")).to_json()
    assert one_node["fits"] and one_node["parallelism"]["pp"] == 1 and one_node["parallelism"]["tp"] == 8
    bf16 = make_plan(model, Cluster(DEVICES["h100-sxm"], 8, 2), Request(4096, 1, "bf16")).to_json()
    assert bf16["fits"] and bf16["parallelism"]["pp"] == 2 and bf16["parallelism"]["tp"] == 8
    assert any("across nodes" in r for r in bf16["reasons"])


def test_nothing_fits_says_the_smallest_change() -> None:
    plan = make_plan(find("llama-3.1-8b").profile(), _cluster("h100"), Request(131072, 64, "bf16"))
    assert not plan.fits
    assert "--concurrency" in plan.suggestion
    long = make_plan(find("llama-3.1-8b").profile(), _cluster("rtx-4090"), Request(131072, 1, "bf16", "bf16"))
    assert not long.fits and "--context" in long.suggestion
    tight = make_plan(find("llama-3.1-70b").profile(), _cluster("h100"), Request(131072, 1, "fp8", "bf16"))
    assert not tight.fits and "--gpus 2" in tight.suggestion
    more = make_plan(find("deepseek-v3").profile(), _cluster("h100", 8), Request(4096, 1, "fp8"))
    assert not more.fits and "--nodes 2" in more.suggestion


def test_efficiency_factors_are_calibratable_from_a_file(tmp_path) -> None:
    model, gpu = find("llama-2-7b").profile(), _cluster("rtx-4090")
    s = Strategy(MIXES["q4_0"], KV_FORMATS["f16"], "llamacpp")
    base = decode_step(model, gpu, s, 1, 128, Calibration()).latency_s
    path = tmp_path / "cal.json"
    path.write_text('{"llamacpp/gddr": {"bandwidth": 0.425, "layer_cycles": 0}}')
    slower = decode_step(model, gpu, s, 1, 128, Calibration.load(path))
    assert slower.fixed_s == 0.0
    assert slower.memory_s == pytest.approx(2 * decode_step(model, gpu, s, 1, 128, Calibration()).memory_s)
    assert slower.latency_s != base
    path.write_text('{"llamacpp/gddr": {"bandwidht": 0.5}}')
    with pytest.raises(PlanError, match="unknown fields"):
        Calibration.load(path)
