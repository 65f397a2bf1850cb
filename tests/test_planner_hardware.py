"""The published hardware table, name lookup, and the probe's pure parts."""

from __future__ import annotations

import pytest

from twinfer.planners import probe
from twinfer.planners.hardware import Cluster, lookup
from twinfer.planners.hw_table import APPLE_CHIPS, DEVICES, NODE_SHAPES
from twinfer.runtime.errors import PlanError

# Every M1-M4 variant by GPU-core count (Apple's own spec pages).
APPLE_VARIANTS = {
    "M1": {7, 8}, "M1 Pro": {14, 16}, "M1 Max": {24, 32}, "M1 Ultra": {48, 64},
    "M2": {8, 10}, "M2 Pro": {16, 19}, "M2 Max": {30, 38}, "M2 Ultra": {60, 76},
    "M3": {8, 10}, "M3 Pro": {14, 18}, "M3 Max": {30, 40}, "M3 Ultra": {60, 80},
    "M4": {8, 10}, "M4 Pro": {16, 20}, "M4 Max": {32, 40},
}


def test_every_apple_m1_to_m4_variant_is_in_the_table() -> None:
    found: dict[str, set[int]] = {}
    for d in APPLE_CHIPS:
        found.setdefault(d.chip, set()).add(d.gpu_cores or 0)
    assert found == APPLE_VARIANTS


@pytest.mark.parametrize("name,bw,mem", [("m1-8c", 68.25, 16), ("m3-max-30c", 300, 96), ("m3-max-40c", 400, 128),
                                         ("m4-max-32c", 410, 36), ("m4-max-40c", 546, 128), ("m3-ultra-80c", 819, 512),
                                         ("h100-sxm", 3350, 80), ("h200", 4800, 141), ("b200", 8000, 180),
                                         ("gb300", 8000, 288), ("mi300x", 5300, 192), ("mi355x", 8000, 288)])
def test_published_bandwidth_and_memory(name: str, bw: float, mem: float) -> None:
    assert DEVICES[name].bandwidth_gbs == bw and DEVICES[name].memory_gb == mem


def test_every_row_cites_a_source_and_has_positive_peaks() -> None:
    for d in DEVICES.values():
        assert d.source and d.vector_tflops > 0 and d.clock_ghz > 0 and d.tensor_tflops, d.name
    for n in NODE_SHAPES.values():
        assert n.source and n.device in DEVICES


def test_lookup_is_tolerant_and_picks_mac_memory() -> None:
    assert lookup("NVIDIA H100 SXM", DEVICES, NODE_SHAPES)[0].name == "h100-sxm"
    device, _ = lookup("Apple M2 Max 38-core@64GB", DEVICES, NODE_SHAPES)
    assert device.name == "m2-max-38c" and device.memory_gb == 64
    device, node = lookup("gb300-nvl72", DEVICES, NODE_SHAPES)
    assert device.name == "gb300" and node is not None and node.gpus == 72
    with pytest.raises(PlanError, match="h100"):
        lookup("h10", DEVICES, NODE_SHAPES)


def test_cluster_rules() -> None:
    assert Cluster(DEVICES["gb200"], 72).world == 72  # one NVL72 NVLink domain
    with pytest.raises(PlanError, match="--nodes 2"):
        Cluster(DEVICES["b200"], 16)
    mac = Cluster(DEVICES["m2-max-38c"].with_memory(64))
    assert mac.capacity_per_device == pytest.approx(64e9 * 0.75)  # Metal's default wired limit


def test_probe_matches_driver_names_to_table_rows() -> None:
    assert probe._match_gpu("NVIDIA H100 80GB HBM3", 85.0).name == "h100-sxm"
    assert probe._match_gpu("NVIDIA H100 PCIe", 85.0).name == "h100-pcie"
    assert probe._match_gpu("NVIDIA GeForce RTX 4090", 25.3).name == "rtx-4090"
    assert probe._match_gpu("NVIDIA B200", 191.5).name == "b200"
    assert probe._match_gpu("Tesla T4", 16.0).name == "t4"
    assert probe._match_gpu("NVIDIA GeForce RTX 4060 Laptop GPU", 8.6) is None  # fewer SMs than the desktop card
    assert probe._match_gpu("Some Future GPU", 30.0) is None


# What nvidia-smi calls each card -> (table row, memory the driver reports in decimal GB, memory we plan with)
DRIVER_NAMES = [
    ("NVIDIA GeForce RTX 2080 Ti", 11.8, "rtx-2080-ti", 11), ("NVIDIA TITAN RTX", 25.4, "titan-rtx", 24),
    ("NVIDIA GeForce RTX 3060 Ti", 8.6, "rtx-3060-ti", 8), ("NVIDIA GeForce RTX 3070", 8.6, "rtx-3070", 8),
    ("NVIDIA GeForce RTX 3080", 10.7, "rtx-3080", 10), ("NVIDIA GeForce RTX 3080 Ti", 12.9, "rtx-3080-ti", 12),
    ("NVIDIA GeForce RTX 3090 Ti", 25.8, "rtx-3090-ti", 24), ("NVIDIA GeForce RTX 4060", 8.6, "rtx-4060", 8),
    ("NVIDIA GeForce RTX 4060 Ti", 8.6, "rtx-4060-ti", 8), ("NVIDIA GeForce RTX 4060 Ti", 17.2, "rtx-4060-ti", 16),
    ("NVIDIA GeForce RTX 4070", 12.9, "rtx-4070", 12), ("NVIDIA GeForce RTX 4070 Ti", 12.9, "rtx-4070-ti", 12),
    ("NVIDIA GeForce RTX 4070 Ti SUPER", 17.2, "rtx-4070-ti-super", 16),
    ("NVIDIA GeForce RTX 4080", 17.2, "rtx-4080", 16), ("NVIDIA GeForce RTX 5060 Ti", 17.1, "rtx-5060-ti", 16),
    ("NVIDIA GeForce RTX 5070", 12.8, "rtx-5070", 12), ("NVIDIA GeForce RTX 5070 Ti", 17.1, "rtx-5070-ti", 16),
    ("NVIDIA GeForce RTX 5080", 17.1, "rtx-5080", 16), ("NVIDIA GeForce RTX 5090", 34.2, "rtx-5090", 32),
    ("NVIDIA RTX A2000 12GB", 12.9, "rtx-a2000", 12), ("NVIDIA RTX A2000", 6.4, "rtx-a2000", 6),
    ("NVIDIA RTX A4000", 17.2, "rtx-a4000", 16), ("NVIDIA RTX A4500", 21.5, "rtx-a4500", 20),
    ("NVIDIA RTX A5000", 25.8, "rtx-a5000", 24), ("NVIDIA RTX A6000", 51.5, "rtx-a6000", 48),
    ("NVIDIA RTX 4000 Ada Generation", 21.5, "rtx-4000-ada", 20),
    ("NVIDIA RTX 5000 Ada Generation", 34.4, "rtx-5000-ada", 32),
    ("NVIDIA RTX 6000 Ada Generation", 51.5, "rtx-6000-ada", 48),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", 102.0, "rtx-pro-6000", 96),
    ("NVIDIA L4", 24.1, "l4", 24), ("NVIDIA L40", 48.3, "l40", 48), ("NVIDIA L40S", 48.3, "l40s", 48),
    ("NVIDIA A10", 24.1, "a10", 24), ("NVIDIA A30", 25.4, "a30", 24), ("NVIDIA A40", 48.3, "a40", 48),
    ("Tesla V100-SXM2-16GB", 17.2, "v100-sxm2", 16), ("Tesla V100-SXM2-32GB", 34.4, "v100-sxm2", 32),
    ("Tesla V100-PCIE-16GB", 17.2, "v100-pcie", 16), ("Tesla V100-PCIE-32GB", 34.4, "v100-pcie", 32),
    ("NVIDIA A100-SXM4-40GB", 42.9, "a100-40gb", 40),
]


@pytest.mark.parametrize("driver,reported,row,memory", DRIVER_NAMES)
def test_probe_finds_the_gpus_people_own(driver: str, reported: float, row: str, memory: float) -> None:
    device = probe._match_gpu(driver, reported)
    assert device is not None and (device.name, device.memory_gb) == (row, memory)


def test_probe_cpu_reads_the_pinned_host() -> None:
    host = probe.read_host()  # the suite pins a simulated machine (tests/conftest.py), never this one
    d = probe.probe_cpu(host).device
    assert d.label.startswith(host.model) and d.memory_gb == round(host.memory_bytes / 1e9, 1)
    assert d.kind == "cpu" and d.bandwidth_gbs == host.measured_gbs and d.vector_tflops > 0


def test_hw_reports_each_measurement_in_its_unit() -> None:
    from twinfer.planners.report import render_cluster

    cluster = probe.probe_cpu(probe.read_host())
    rate = probe.measure_cpu_gemm(n=64, seconds=0.01)
    text = render_cluster(cluster, {"cpu read bandwidth": 21.9, "cpu f32 gemm": rate})
    assert "cpu read bandwidth: 21.9 GB/s" in text and f"cpu f32 gemm: {rate:.1f} GFLOP/s" in text


# Headline dense peaks as vendor pages print them ("with sparsity" figures halved; GeForce 40 "AI TOPS" are
# FP8 with sparsity and FP16 accumulate, a quarter of which is the FP32-accumulate dense rate; GeForce 50
# and RTX PRO "AI TOPS" are FP4 with sparsity).
PUBLISHED = [
    ("rtx-2080-ti", "f16", 53.8), ("rtx-2080-ti", "int8", 215.2), ("titan-rtx", "f16", 130.0),
    ("rtx-3090", "bf16", 71.0), ("rtx-4060", "fp8", 242 / 4), ("rtx-4060-ti", "fp8", 353 / 4),
    ("rtx-4070", "fp8", 466 / 4), ("rtx-4070-ti", "fp8", 641 / 4), ("rtx-4080", "fp8", 780 / 4),
    ("rtx-4090", "bf16", 165.2), ("rtx-4090", "fp8", 330.3), ("rtx-5060-ti", "fp4", 759 / 2),
    ("rtx-5070", "fp4", 988 / 2), ("rtx-5070-ti", "fp4", 1406 / 2), ("rtx-5080", "fp4", 1801 / 2),
    ("rtx-5090", "fp4", 3352 / 2), ("rtx-5090", "bf16", 209.5), ("rtx-pro-6000", "fp4", 4000 / 2),
    ("rtx-a2000", "f16", 63.9 / 2), ("rtx-a4000", "f16", 153.4 / 2), ("rtx-a4500", "f16", 189.2 / 2),
    ("rtx-a5000", "f16", 222.2 / 2), ("rtx-a6000", "f16", 309.7 / 2), ("rtx-4500-ada", "fp8", 634 / 2),
    ("rtx-5000-ada", "fp8", 1044.4 / 2), ("rtx-6000-ada", "fp8", 1457 / 2), ("l4", "bf16", 242 / 2),
    ("l4", "fp8", 485 / 2), ("l40", "bf16", 181.05), ("l40s", "bf16", 366.0), ("l40s", "fp8", 733.0),
    ("a10", "bf16", 125.0), ("a10", "int8", 250.0), ("a30", "bf16", 165.0), ("a30", "int8", 330.0),
    ("a40", "bf16", 149.7), ("t4", "f16", 65.0), ("t4", "int8", 130.0), ("v100-sxm2", "f16", 125.0),
    ("v100-pcie", "f16", 112.0),
]
FP32 = [("rtx-2080-ti", 13.4), ("titan-rtx", 16.3), ("rtx-3090", 35.6), ("rtx-4090", 82.6), ("rtx-5090", 104.8), ("rtx-a2000", 8.0), ("rtx-a6000", 38.7),
        ("rtx-4000-ada", 26.7), ("rtx-6000-ada", 91.1), ("rtx-pro-6000", 125.0), ("l4", 30.3), ("l40", 90.5),
        ("l40s", 91.6), ("a10", 31.2), ("a30", 10.3), ("a40", 37.4), ("t4", 8.1), ("v100-sxm2", 15.7),
        ("v100-pcie", 14.0)]


@pytest.mark.parametrize("name,dtype,tflops", PUBLISHED)
def test_owned_gpu_rows_reproduce_published_peaks(name: str, dtype: str, tflops: float) -> None:
    assert dict(DEVICES[name].tensor_tflops)[dtype] == pytest.approx(tflops, rel=0.015)


@pytest.mark.parametrize("name,tflops", FP32)
def test_owned_gpu_rows_reproduce_published_fp32(name: str, tflops: float) -> None:
    assert DEVICES[name].vector_tflops == pytest.approx(tflops, rel=0.015)


def test_chips_list_only_the_dtypes_they_run() -> None:
    assert "bf16" not in DEVICES["t4"].natives and "bf16" not in DEVICES["v100-sxm2"].natives  # Turing, Volta
    assert "int8" not in DEVICES["v100-pcie"].natives and "fp8" not in DEVICES["rtx-3090"].natives
    assert "fp4" in DEVICES["rtx-5060-ti"].natives and "fp4" not in DEVICES["rtx-4090"].natives


@pytest.mark.parametrize("typed,row", [("4070", "rtx-4070"), ("rtx4070", "rtx-4070"), ("RTX 4070 Ti", "rtx-4070-ti"),
                                       ("NVIDIA GeForce RTX 5060 Ti", "rtx-5060-ti"), ("a6000", "rtx-a6000"),
                                       ("RTX A6000", "rtx-a6000"), ("l4", "l4"), ("L40S", "l40s"), ("t4", "t4"),
                                       ("v100", "v100-sxm2"), ("6000-ada", "rtx-6000-ada"),
                                       ("rtx-pro-6000-blackwell", "rtx-pro-6000"), ("3090ti", "rtx-3090-ti")])
def test_names_people_type(typed: str, row: str) -> None:
    assert lookup(typed, DEVICES, NODE_SHAPES)[0].name == row


def test_every_alias_names_one_row_and_memory_options_apply() -> None:
    from twinfer.planners.hardware import compact

    owner: dict[str, str] = {}
    for d in DEVICES.values():
        for alias in (d.name, *d.aliases):
            assert owner.setdefault(compact(alias), d.name) == d.name, f"{alias} names {owner[compact(alias)]} too"
            assert lookup(alias, DEVICES, NODE_SHAPES)[0].name == d.name
    assert lookup("4060-ti@8", DEVICES, NODE_SHAPES)[0].memory_gb == 8
    assert lookup("v100-pcie@16GB", DEVICES, NODE_SHAPES)[0].memory_gb == 16
    with pytest.raises(PlanError, match="cannot read the memory size"):
        lookup("v100@lots", DEVICES, NODE_SHAPES)
    with pytest.raises(PlanError, match="comes with 16, 32 GB"):
        lookup("v100@24", DEVICES, NODE_SHAPES)


def test_a_gpu_without_bf16_plans_f16_on_the_datacenter_target() -> None:
    """V100 multiplies F16 only (the CUDA backend's native format before Ampere): a BF16 checkpoint runs as F16
    weights with an F16 cache, rather than having no native plan at all."""
    from twinfer.planners.catalog import find
    from twinfer.planners.plan import make_plan
    from twinfer.planners.search import Request

    plan = make_plan(find("llama-3.1-8b").profile(), Cluster(DEVICES["v100-sxm2"]), Request(4096, 1)).to_json()
    assert (plan["target"], plan["fits"], plan["weights_format"], plan["kv_format"]) == ("datacenter", True, "f16", "f16")
    h100 = make_plan(find("llama-3.1-8b").profile(), Cluster(DEVICES["h100-sxm"]), Request(4096, 1, "auto", "bf16"))
    assert h100.strategy is not None and h100.strategy.mix.name != "f16"  # BF16 GPUs keep BF16 (or smaller)
