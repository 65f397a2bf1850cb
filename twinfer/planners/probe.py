"""The hardware probe: the one part of the planner that asks the machine anything.

NVIDIA GPUs through nvidia-ml-py (name, memory, count, NVLink links and generation, PCIe link), Apple
silicon through sysctl/ioreg (chip, memory, GPU cores), Linux CPUs through /proc (cores, memory, ISA).
A device found in the published table keeps the table's peaks; an unknown one gets numbers derived
from what the driver reports. `measure_*` time real copies; results are cached so that `twinfer plan`
on a CPU can use the measured bandwidth without measuring again.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from twinfer.planners.hardware import CPU, GPU, Cluster, Device
from twinfer.planners.hw_table import APPLE_CHIPS, DEVICES

_NVLINK_GBS = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}  # GB/s per link per direction, by NVLink generation
_PCIE_LANE_GBS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.97, 5: 3.94, 6: 7.88}  # per lane, per direction


def cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "twinfer" / "hardware.json"


def _cached() -> dict[str, Any]:
    try:
        return dict(json.loads(cache_file().read_text()))
    except (OSError, ValueError):
        return {}


def _store(key: str, value: Any) -> None:
    data = _cached()
    data[key] = value
    path = cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


# -- NVIDIA ------------------------------------------------------------------------------------------
def _match_gpu(name: str, memory_gb: float) -> Device | None:
    n = name.lower().replace("nvidia", "").replace("geforce", "").strip()
    rules = [("gb300", "gb300"), ("gb200", "gb200"), ("b300", "b300"), ("b200", "b200"), ("h200", "h200"),
             ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"), ("a100-pcie", "a100-pcie"), ("a100 pcie", "a100-pcie"),
             ("a100", "a100-sxm"), ("l40s", "l40s"), ("rtx 5090", "rtx-5090"), ("rtx 4090", "rtx-4090"),
             ("rtx 3090", "rtx-3090"), ("rtx 3060", "rtx-3060"), ("gb10", "gb10"),
             ("mi355x", "mi355x"), ("mi325x", "mi325x"), ("mi300x", "mi300x")]
    for needle, key in rules:
        if needle in n:
            d = DEVICES[key]
            return d.with_memory(round(memory_gb)) if abs(d.memory_gb - memory_gb) > 0.1 * d.memory_gb else d
    return None


def probe_nvidia() -> Cluster | None:
    """All visible NVIDIA GPUs as one node, or None without a driver or nvidia-ml-py."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return None
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(h)
        name = name.decode() if isinstance(name, bytes) else name
        mem_gb = pynvml.nvmlDeviceGetMemoryInfo(h).total / 1e9
        links, gen = 0, 0
        for link in range(18):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(h, link):
                    links += 1
                    gen = max(gen, pynvml.nvmlDeviceGetNvLinkVersion(h, link))
            except pynvml.NVMLError:
                break
        try:
            pcie = (_PCIE_LANE_GBS.get(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h), 1.97)
                    * pynvml.nvmlDeviceGetMaxPcieLinkWidth(h) * 2)
        except pynvml.NVMLError:
            pcie = 64.0
        nvlink = links * _NVLINK_GBS.get(gen, 25.0) * 2
        device = _match_gpu(name, mem_gb) or _unknown_gpu(pynvml, h, name, mem_gb, pcie)
        ic = nvlink if links else pcie
        device = replace(device, interconnect_gbs=ic, link=f"nvlink{gen}" if links else "pcie",
                         max_per_node=max(device.max_per_node, count), measured=False)
        return Cluster(device, gpus_per_node=count, notes=(f"detected {count}x {name} ({links} NVLink links)",))
    finally:
        pynvml.nvmlShutdown()


def _unknown_gpu(pynvml: Any, h: Any, name: str, mem_gb: float, pcie: float) -> Device:
    bus = pynvml.nvmlDeviceGetMemoryBusWidth(h)
    mem_clock = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM)  # MHz
    sm_clock = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM) / 1000
    cores = pynvml.nvmlDeviceGetNumGpuCores(h)
    bw = bus / 8 * mem_clock * 2 / 1000  # DDR: two transfers per clock
    vector = cores * 2 * sm_clock / 1000
    return Device(
        name=re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-"), label=name, vendor="nvidia", kind=GPU,
        memory_gb=round(mem_gb, 1), bandwidth_gbs=round(bw), memory_type="hbm" if bus >= 2048 else "gddr",
        interconnect_gbs=pcie, link="pcie", tensor_tflops=(("bf16", vector * 4), ("f16", vector * 4)),
        vector_tflops=vector, clock_ghz=sm_clock, source="probed with nvidia-ml-py (peaks estimated)",
    )


# -- Apple -------------------------------------------------------------------------------------------
def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=5, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def probe_apple() -> Cluster | None:
    if platform.system() != "Darwin" or platform.machine() != "arm64":
        return None
    brand = _run(["sysctl", "-n", "machdep.cpu.brand_string"]).strip()  # "Apple M2 Max"
    memory_gb = int(_run(["sysctl", "-n", "hw.memsize"]).strip() or 0) / 2**30
    m = re.search(r'"gpu-core-count"\s*=\s*(\d+)', _run(["ioreg", "-rc", "AGXAccelerator"]))
    cores = int(m.group(1)) if m else 0
    chip = brand.replace("Apple ", "")
    rows = [d for d in APPLE_CHIPS if d.chip == chip]
    if not rows:
        return None
    device = min(rows, key=lambda d: abs((d.gpu_cores or 0) - cores))
    device = device.with_memory(round(memory_gb)) if memory_gb else device
    return Cluster(device, notes=(f"detected {brand} with {cores} GPU cores and {memory_gb:.0f} GB",))


# -- CPU ---------------------------------------------------------------------------------------------
def _cpuinfo() -> dict[str, str]:
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def _memory_bytes() -> float:
    total = 0.0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = float(line.split()[1]) * 1024
    except OSError:
        total = 8e9
    try:  # a cgroup limit (containers) caps what a process may use
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            total = min(total, float(limit))
    except OSError:
        pass
    return total


def cpu_key() -> str:
    info = _cpuinfo()
    return f"cpu:{info.get('model name', platform.processor())}:{len(os.sched_getaffinity(0))}"


def probe_cpu() -> Cluster:
    """This machine's CPU: cores we may use, memory, vector width; bandwidth measured or estimated."""
    info = _cpuinfo()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    flags = set(info.get("flags", info.get("Features", "")).split())
    ghz = float(info.get("cpu MHz", 0) or 0) / 1000 or 2.5
    intel = "GenuineIntel" in info.get("vendor_id", "")
    if "avx512f" in flags:
        per_cycle = 64 if intel else 32  # AMD Zen 4 runs 512-bit FMAs on 256-bit units
        isa = "avx512" + ("+bf16" if "avx512_bf16" in flags else "")
    elif "avx2" in flags:
        per_cycle, isa = 32, "avx2"
    elif "asimd" in flags or platform.machine() in ("aarch64", "arm64"):
        per_cycle, isa = 16, "neon"
    else:
        per_cycle, isa = 8, "sse"
    tflops = cores * ghz * per_cycle / 1000
    measured = _cached().get(cpu_key())
    bandwidth = float(measured) if measured else min(8.0 * cores, 200.0)
    name = info.get("model name", platform.processor() or "cpu")
    device = Device(
        name="cpu", label=f"{name} ({cores} cores, {isa})", vendor="cpu", kind=CPU,
        memory_gb=round(_memory_bytes() / 1e9, 1), bandwidth_gbs=round(bandwidth, 1), memory_type="ddr",
        interconnect_gbs=0.0, link="none", tensor_tflops=(("f32", tflops),), vector_tflops=tflops,
        clock_ghz=ghz, source="measured read bandwidth" if measured else "probed; bandwidth estimated at 8 GB/s per core",
        chip=name, storage_gbs=2.0, measured=bool(measured),
    )
    note = () if measured else ("CPU bandwidth is an estimate: run `twinfer hw --measure` once to measure it",)
    return Cluster(device, notes=note)


def detect() -> Cluster:
    """The local machine: NVIDIA GPUs if any, else Apple silicon, else the CPU."""
    return probe_nvidia() or probe_apple() or probe_cpu()


# -- measurements ------------------------------------------------------------------------------------
def measure_cpu_bandwidth(mb: int = 256, repeats: int = 3) -> float:
    """Read bandwidth in GB/s: every usable core sums its own array, best of `repeats`."""
    import numpy as np

    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    arrays = [np.ones(mb * 2**20 // 4, dtype=np.float32) for _ in range(threads)]
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        workers = [threading.Thread(target=a.sum) for a in arrays]  # numpy releases the GIL while summing
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = max(best, threads * arrays[0].nbytes / (time.perf_counter() - start) / 1e9)
    _store(cpu_key(), round(best, 2))
    return best


def measure_gpu_copy_bandwidth(gb: float = 1.0) -> float | None:
    """Device-to-device copy bandwidth of GPU 0 in GB/s (read + write), or None without a CUDA torch."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    n = int(gb * 1e9) // 2
    src = torch.empty(n, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 5 * 2 * src.numel() * 2 / (time.perf_counter() - start) / 1e9
