"""Published hardware specs, each row with its source: datacenter GPUs, Apple silicon, node shapes here;
the GeForce, workstation and PCIe data-center cards people own in `hw_table_gpus.py`.

Conventions: memory and bandwidth are per device, in decimal GB and GB/s as the vendor prints them;
`interconnect_gbs` is the per-device peer bandwidth the vendor publishes (bidirectional aggregate for
NVLink / Infinity Fabric, the PCIe x16 figure when a card has no peer link); tensor TFLOPS are *dense*
(half the "with sparsity" marketing number); a PCIe card on fewer lanes (x8) carries its own figure. Clocks are boost clocks: they set how long the small,
latency-bound kernels of a decode step take (see calibration.py). Apple does not publish GPU clocks or
FLOPS; those rows use the clocks measured in github.com/philipturner/metal-benchmarks and
FLOPS = cores x 128 ALUs x 2 x clock.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from twinfer.planners.hardware import APPLE, GPU, Device, NodeShape, find
from twinfer.planners.hw_table_gpus import OWNED_GPUS

_NV_DC = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"


@dataclass(frozen=True)
class _Sheet:
    """A datasheet column: memory (GB, GB/s, type), peer link and its GB/s, dense tensor TFLOPS by dtype,
    vector (FP32) TFLOPS and boost clock (GHz)."""

    mem: float
    bw: float
    mtype: str
    link: str
    ic: float
    tensor: dict[str, float]
    vector: float
    clock: float


def _gpu(name: str, label: str, vendor: str, sheet: _Sheet, source: str, per_node: int = 8, host: float = 64.0,
         aliases: tuple[str, ...] = ()) -> Device:
    s = sheet
    return Device(
        name=name, label=label, vendor=vendor, kind=GPU, memory_gb=s.mem, bandwidth_gbs=s.bw, memory_type=s.mtype,
        interconnect_gbs=s.ic, link=s.link, tensor_tflops=tuple(s.tensor.items()), vector_tflops=s.vector,
        clock_ghz=s.clock, source=source, chip=label, max_per_node=per_node, host_link_gbs=host, aliases=aliases,
    )


_HOPPER = {"bf16": 989.0, "f16": 989.0, "fp8": 1979.0, "int8": 1979.0}
_BLACKWELL = {"bf16": 2250.0, "f16": 2250.0, "fp8": 4500.0, "int8": 4500.0, "fp4": 9000.0}

GPUS: list[Device] = [
    _gpu("a100-sxm", "NVIDIA A100 SXM4 80GB", "nvidia", _Sheet(80, 2039, "hbm", "nvlink3", 600,
         {"bf16": 312.0, "f16": 312.0, "int8": 624.0}, 19.5, 1.41),
         "NVIDIA A100 datasheet, nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
         "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf", aliases=("a100", "a100-80gb")),
    _gpu("a100-40gb", "NVIDIA A100 SXM4 40GB", "nvidia", _Sheet(40, 1555, "hbm", "nvlink3", 600,
         {"bf16": 312.0, "f16": 312.0, "int8": 624.0}, 19.5, 1.41),
         "NVIDIA A100 datasheet (40GB SXM column)"),
    _gpu("a100-pcie", "NVIDIA A100 PCIe 80GB", "nvidia", _Sheet(80, 1935, "hbm", "pcie4", 64,
         {"bf16": 312.0, "f16": 312.0, "int8": 624.0}, 19.5, 1.41), "NVIDIA A100 datasheet (PCIe column)"),
    _gpu("h100-sxm", "NVIDIA H100 SXM5 80GB", "nvidia", _Sheet(80, 3350, "hbm", "nvlink4", 900, _HOPPER, 67.0, 1.98),
         _NV_DC + " (H100 SXM column)", host=128, aliases=("h100",)),
    _gpu("h100-pcie", "NVIDIA H100 PCIe 80GB", "nvidia", _Sheet(80, 2000, "hbm", "pcie5", 128,
         {"bf16": 756.0, "f16": 756.0, "fp8": 1513.0, "int8": 1513.0}, 51.0, 1.755),
         _NV_DC + " (H100 PCIe column)", host=128),
    _gpu("h200", "NVIDIA H200 SXM 141GB", "nvidia", _Sheet(141, 4800, "hbm", "nvlink4", 900, _HOPPER, 67.0, 1.98),
         "nvidia.com/en-us/data-center/h200/ (H200 SXM column)", host=128, aliases=("h200-sxm",)),
    _gpu("b200", "NVIDIA B200 180GB", "nvidia", _Sheet(180, 8000, "hbm", "nvlink5", 1800, _BLACKWELL, 75.0, 1.965),
         "nvidia.com/en-us/data-center/hgx/ (HGX B200: 1.44 TB, 64 TB/s, 72/144 PF FP8/FP4 sparse per 8 GPUs)",
         host=128, aliases=("b200-sxm",)),
    _gpu("b300", "NVIDIA B300 288GB", "nvidia", _Sheet(288, 8000, "hbm", "nvlink5", 1800,
         {**_BLACKWELL, "fp4": 13500.0}, 75.0, 1.965),
         "nvidia.com/en-us/data-center/hgx/ (HGX B300: 2.3 TB, 108 PF dense FP4 per 8 GPUs)",
         host=128, aliases=("b300-sxm", "blackwell-ultra")),
    _gpu("gb200", "NVIDIA GB200 (per GPU, NVL72)", "nvidia", _Sheet(186, 8000, "hbm", "nvlink5", 1800,
         {"bf16": 2500.0, "f16": 2500.0, "fp8": 5000.0, "int8": 5000.0, "fp4": 10000.0}, 80.0, 1.965),
         "nvidia.com/en-us/data-center/gb200-nvl72/ (13.4 TB HBM3e, 576 TB/s, 1440 PF FP4 sparse per 72 GPUs)",
         per_node=72, host=450),
    _gpu("gb300", "NVIDIA GB300 (per GPU, NVL72)", "nvidia", _Sheet(288, 8000, "hbm", "nvlink5", 1800,
         {"bf16": 2500.0, "f16": 2500.0, "fp8": 5000.0, "int8": 5000.0, "fp4": 15000.0}, 80.0, 1.965),
         "nvidia.com/en-us/data-center/gb300-nvl72/ (up to 288 GB HBM3e per GPU, 1080 PF dense FP4 per 72 GPUs)",
         per_node=72, host=450),
    _gpu("gb10", "NVIDIA GB10 (DGX Spark) 128GB", "nvidia", _Sheet(128, 273, "lpddr", "connectx7", 25,
         {"bf16": 125.0, "f16": 125.0, "fp8": 250.0, "fp4": 500.0}, 31.0, 2.5),
         "nvidia.com/en-us/products/workstations/dgx-spark/ (1 PF FP4 sparse, 273 GB/s LPDDR5x; "
         "bf16/FP32 rates estimated from the FP4 figure)", per_node=1, host=273, aliases=("dgx-spark", "spark")),
    _gpu("mi300x", "AMD Instinct MI300X 192GB", "amd", _Sheet(192, 5300, "hbm", "infinity-fabric", 896,
         {"bf16": 1307.4, "f16": 1307.4, "fp8": 2614.9, "int8": 2614.9}, 163.4, 2.1),
         "amd.com/en/products/accelerators/instinct/mi300/mi300x.html", host=128),
    _gpu("mi325x", "AMD Instinct MI325X 256GB", "amd", _Sheet(256, 6000, "hbm", "infinity-fabric", 896,
         {"bf16": 1307.4, "f16": 1307.4, "fp8": 2614.9, "int8": 2614.9}, 163.4, 2.1),
         "amd.com/en/products/accelerators/instinct/mi300/mi325x.html", host=128),
    _gpu("mi355x", "AMD Instinct MI355X 288GB", "amd", _Sheet(288, 8000, "hbm", "infinity-fabric", 1075,
         {"bf16": 2516.6, "f16": 2516.6, "fp8": 5033.2, "int8": 5033.2, "fp4": 10066.3}, 157.3, 2.4),
         "amd.com/en/products/accelerators/instinct/mi350/mi355x.html", host=128),
]

# (chip, GPU cores, GB/s, memory options GB, GPU clock GHz, SSD GB/s, dies, newsroom page)
_APPLE = [
    ("M1", (7, 8), 68.25, (8, 16), 1.278, 2.8, 1, "apple.com/newsroom/2020/11/apple-unleashes-m1/"),
    ("M1 Pro", (14, 16), 200, (16, 32), 1.296, 5.0, 1,
     "apple.com/newsroom/2021/10/introducing-m1-pro-and-m1-max-the-most-powerful-chips-apple-has-ever-built/"),
    ("M1 Max", (24, 32), 400, (32, 64), 1.296, 5.0, 1,
     "apple.com/newsroom/2021/10/introducing-m1-pro-and-m1-max-the-most-powerful-chips-apple-has-ever-built/"),
    ("M1 Ultra", (48, 64), 800, (64, 128), 1.296, 5.0, 2,
     "apple.com/newsroom/2022/03/apple-unveils-m1-ultra-the-worlds-most-powerful-chip-for-a-personal-computer/"),
    ("M2", (8, 10), 100, (8, 16, 24), 1.398, 3.0, 1,
     "apple.com/newsroom/2022/06/apple-unveils-m2-with-breakthrough-performance-and-capabilities/"),
    ("M2 Pro", (16, 19), 200, (16, 32), 1.398, 5.0, 1,
     "apple.com/newsroom/2023/01/apple-unveils-m2-pro-and-m2-max-next-generation-chips-for-next-level-workflows/"),
    ("M2 Max", (30, 38), 400, (32, 64, 96), 1.398, 5.0, 1,
     "apple.com/newsroom/2023/01/apple-unveils-m2-pro-and-m2-max-next-generation-chips-for-next-level-workflows/"),
    ("M2 Ultra", (60, 76), 800, (64, 128, 192), 1.398, 6.0, 2,
     "apple.com/newsroom/2023/06/apple-introduces-m2-ultra/"),
    ("M3", (8, 10), 100, (8, 16, 24), 1.38, 3.0, 1,
     "apple.com/newsroom/2023/10/apple-unveils-m3-m3-pro-and-m3-max-the-most-advanced-chips-for-a-personal-computer/"),
    ("M3 Pro", (14, 18), 150, (18, 36), 1.38, 5.0, 1,
     "apple.com/newsroom/2023/10/apple-unveils-m3-m3-pro-and-m3-max-the-most-advanced-chips-for-a-personal-computer/"),
    ("M3 Max", (30,), 300, (36, 96), 1.38, 6.0, 1,
     "apple.com/macbook-pro/specs/ (M3 Max 14-core CPU / 30-core GPU: 300 GB/s)"),
    ("M3 Max", (40,), 400, (48, 64, 128), 1.38, 6.0, 1,
     "apple.com/newsroom/2023/10/apple-unveils-m3-m3-pro-and-m3-max-the-most-advanced-chips-for-a-personal-computer/"),
    ("M3 Ultra", (60, 80), 819, (96, 256, 512), 1.38, 6.0, 2,
     "apple.com/newsroom/2025/03/apple-reveals-m3-ultra-taking-apple-silicon-to-a-new-extreme/"),
    ("M4", (8, 10), 120, (16, 24, 32), 1.47, 3.0, 1,
     "apple.com/newsroom/2024/05/apple-introduces-m4-chip/"),
    ("M4 Pro", (16, 20), 273, (24, 48, 64), 1.578, 6.0, 1,
     "apple.com/newsroom/2024/10/apple-introduces-m4-pro-and-m4-max/"),
    ("M4 Max", (32,), 410, (36,), 1.578, 7.0, 1,
     "apple.com/macbook-pro/specs/ (M4 Max 14-core CPU / 32-core GPU: 410 GB/s)"),
    ("M4 Max", (40,), 546, (48, 64, 128), 1.578, 7.0, 1,
     "apple.com/newsroom/2024/10/apple-introduces-m4-pro-and-m4-max/"),
]


def _apple_rows() -> list[Device]:
    rows = []
    top: dict[str, int] = {}  # the chip's name alone means its biggest GPU (`m3-max` = the 40-core one)
    for chip, core_counts, *_ in _APPLE:
        top[chip] = max(top.get(chip, 0), *core_counts)
    for chip, core_counts, bw, mems, clock, ssd, dies, src in _APPLE:
        for cores in core_counts:
            flops = cores * 128 * 2 * clock / 1000  # FP32 = FP16 rate on Apple GPUs
            key = f"{chip.lower().replace(' ', '-')}-{cores}c"
            rows.append(Device(
                name=key, label=f"Apple {chip} {cores}-core GPU", vendor="apple", kind=APPLE,
                memory_gb=float(max(mems)), bandwidth_gbs=float(bw), memory_type="lpddr", interconnect_gbs=0.0,
                link="none", tensor_tflops=(("f16", flops), ("bf16", flops)), vector_tflops=flops,
                clock_ghz=clock, source=src + "; GPU clock: github.com/philipturner/metal-benchmarks",
                chip=chip, gpu_cores=cores, memory_options_gb=tuple(float(m) for m in mems),
                storage_gbs=ssd, dies=dies, max_per_node=1,
                aliases=(chip.lower().replace(" ", "-"),) if cores == top[chip] else (),
            ))
    return rows


APPLE_CHIPS: list[Device] = _apple_rows()

_NV_HGX = "nvidia.com/en-us/data-center/hgx/"
NODES: list[NodeShape] = [
    NodeShape("hgx-a100", "NVIDIA HGX/DGX A100 (8x A100 SXM, NVLink 3)", "a100-sxm", 8, 25.0,
              "nvidia.com/en-us/data-center/dgx-a100/ (8x 200 Gb/s HDR)", aliases=("dgx-a100",)),
    NodeShape("hgx-h100", "NVIDIA HGX/DGX H100 (8x H100 SXM, NVLink 4)", "h100-sxm", 8, 50.0,
              _NV_HGX + " (8x 400 Gb/s ConnectX-7)", aliases=("dgx-h100",)),
    NodeShape("hgx-h200", "NVIDIA HGX H200 (8x H200, NVLink 4)", "h200", 8, 50.0,
              _NV_HGX + " (8x 400 Gb/s ConnectX-7)", aliases=("dgx-h200",)),
    NodeShape("hgx-b200", "NVIDIA HGX/DGX B200 (8x B200, NVLink 5)", "b200", 8, 50.0,
              "nvidia.com/en-us/data-center/dgx-b200/ (8x 400 Gb/s ConnectX-7)", aliases=("dgx-b200",)),
    NodeShape("hgx-b300", "NVIDIA HGX B300 (8x B300, NVLink 5)", "b300", 8, 100.0,
              _NV_HGX + " (8x 800 Gb/s ConnectX-8)", aliases=("dgx-b300",)),
    NodeShape("gb200-nvl72", "NVIDIA GB200 NVL72 (72 GPUs, one NVLink 5 domain)", "gb200", 72, 50.0,
              "nvidia.com/en-us/data-center/gb200-nvl72/", aliases=("nvl72",)),
    NodeShape("gb300-nvl72", "NVIDIA GB300 NVL72 (72 GPUs, one NVLink 5 domain)", "gb300", 72, 100.0,
              "nvidia.com/en-us/data-center/gb300-nvl72/ (ConnectX-8 800 Gb/s per GPU)"),
    NodeShape("mi300x-8", "AMD Instinct MI300X platform (8x MI300X, Infinity Fabric)", "mi300x", 8, 50.0,
              "amd.com/en/products/accelerators/instinct/mi300/platform.html"),
    NodeShape("mi325x-8", "AMD Instinct MI325X platform (8x MI325X)", "mi325x", 8, 50.0,
              "amd.com/en/products/accelerators/instinct/mi300/mi325x.html"),
    NodeShape("mi355x-8", "AMD Instinct MI355X platform (8x MI355X)", "mi355x", 8, 50.0,
              "amd.com/en/products/accelerators/instinct/mi350/mi355x.html"),
]

DEVICES: dict[str, Device] = {d.name: d for d in GPUS + OWNED_GPUS + APPLE_CHIPS}
NODE_SHAPES: dict[str, NodeShape] = {n.name: n for n in NODES}

# Driver names (nvidia-smi / NVML) that no table alias spells, as substrings checked in order after the
# exact match: HBM and NVL variants, server editions. Laptop GPUs are left unmatched on purpose: they share
# desktop names with fewer SMs and less bandwidth, so the probe derives their numbers from the driver.
_DRIVER_RULES = (
    ("gb300", "gb300"), ("gb200", "gb200"), ("b300", "b300"), ("b200", "b200"), ("h200", "h200"),
    ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"), ("a100-pcie", "a100-pcie"), ("a100 pcie", "a100-pcie"),
    ("a100-sxm4-40gb", "a100-40gb"), ("a100", "a100-sxm"), ("rtx pro 6000", "rtx-pro-6000"), ("v100s", "v100-pcie"), ("v100-pcie", "v100-pcie"),
    ("v100", "v100-sxm2"), ("gb10", "gb10"), ("mi355x", "mi355x"), ("mi325x", "mi325x"), ("mi300x", "mi300x"),
)


def match_driver_name(name: str, memory_gb: float, devices: dict[str, Device] | None = None) -> Device | None:
    """The table row for a GPU the driver calls `name` with `memory_gb` of memory, or None if unknown.

    The memory size (decimal GB from the driver; vendors print GiB as "GB") picks among a row's options
    (a 16 GB RTX 4060 Ti) and replaces the row's when it differs by more than 10% (an A100 40GB PCIe).
    """
    devices = DEVICES if devices is None else devices
    lowered = name.lower()
    if "laptop" in lowered or "mobile" in lowered:
        return None
    plain = re.sub(r"\b\d+\s*gb\b", " ", lowered)
    plain = re.sub(r"\b(generation|workstation edition|hbm\d?e?)\b", " ", plain)
    hit = find(plain, devices, NODE_SHAPES)
    device = hit[0] if hit and hit[1] is None else None
    if device is None:
        key = next((k for needle, k in _DRIVER_RULES if needle in lowered), None)
        device = devices.get(key) if key else None
    if device is None:
        return None
    gib = memory_gb / 1.073741824
    options = device.memory_options_gb or (device.memory_gb,)
    nearest = min(options, key=lambda o: min(abs(o - memory_gb), abs(o - gib)))
    if min(abs(nearest - memory_gb), abs(nearest - gib)) <= 0.1 * nearest:
        return device.with_memory(nearest) if nearest != device.memory_gb else device
    return device.with_memory(round(gib))
