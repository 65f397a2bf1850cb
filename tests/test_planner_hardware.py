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


def test_probe_cpu_reads_this_machine() -> None:
    cluster = probe.probe_cpu()
    d = cluster.device
    assert d.kind == "cpu" and d.memory_gb > 0 and d.bandwidth_gbs > 0 and d.vector_tflops > 0
