"""The hardware probe: the one part of the planner that asks the machine anything.
NVIDIA GPUs through nvidia-ml-py, Apple silicon through sysctl/ioreg, Linux CPUs through /proc. A device
in the published table keeps the table's peaks; `measure_*` time real copies, cached per machine."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from twinfer.planners.hardware import CPU, GPU, Cluster, Device
from twinfer.planners.hw_table import APPLE_CHIPS, DEVICES
from twinfer.runtime.cache_dir import cache_dir
from twinfer.runtime.cpu import HUGE_PAGE_MODES, cpuinfo, default_threads, thp_mode, usable_cpus
from twinfer.runtime.errors import PlanError

HOST_ENV = "TWINFER_HOST_FACTS"

_NVLINK_GBS = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}  # GB/s per link per direction, by NVLink generation
_PCIE_LANE_GBS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.97, 5: 3.94, 6: 7.88}  # per lane, per direction


def cache_file() -> Path:
    """Measured numbers of this machine, kept with twinfer's other caches (under $TWINFER_CACHE when set)."""
    return cache_dir("hardware") / "hardware.json"


def _cached() -> dict[str, Any]:
    try:
        return dict(json.loads(cache_file().read_text()))
    except (OSError, ValueError, TypeError):
        return {}


def _store(key: str, value: Any) -> None:
    data = _cached()
    data[key] = value
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))
    except OSError:  # a read-only cache costs a re-measurement next time, nothing else
        pass


# -- NVIDIA ------------------------------------------------------------------------------------------
def _match_gpu(name: str, memory_gb: float) -> Device | None:
    from twinfer.planners.hw_table import match_driver_name

    return match_driver_name(name, memory_gb, DEVICES)


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
    m = re.search(r'"gpu-core-count"\s*=\s*(\d+)', _run(["ioreg", "-rc", "AGXAccelerator"]))
    host = read_host()
    return _apple_row(replace(host, apple_chip=host.model.replace("Apple ", ""), gpu_cores=int(m.group(1)) if m else 0))


def _apple_row(host: HostFacts) -> Cluster | None:
    """The table row of an Apple chip (closest GPU-core count), with the machine's memory."""
    rows = [d for d in APPLE_CHIPS if d.chip == host.apple_chip]
    if not rows:
        return None
    device = min(rows, key=lambda d: abs((d.gpu_cores or 0) - host.gpu_cores))
    memory_gb = host.memory_bytes / 2**30
    device = device.with_memory(round(memory_gb)) if memory_gb else device
    return Cluster(device, notes=(f"detected Apple {host.apple_chip} with {host.gpu_cores} GPU cores and "
                                  f"{memory_gb:.0f} GB",))


# -- CPU ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HostFacts:
    """Everything the CPU probe reads of a machine. `read_host()` reads this one; tests build their own
    so that no verdict depends on the machine running them."""

    system: str  # platform.system(): "Linux", "Darwin", "Windows"
    machine: str  # platform.machine(): "x86_64", "arm64", "aarch64"
    model: str  # the CPU's marketing name
    vendor: str  # "GenuineIntel", "AuthenticAMD", "Apple", ...
    flags: frozenset[str]  # ISA feature flags as /proc/cpuinfo spells them
    cpus: int  # logical CPUs this process may use
    cores: int  # physical cores among them
    ghz: float  # the clock the probe saw (0 when unknown)
    memory_bytes: float
    measured_gbs: float | None = None  # read bandwidth measured on this machine, from the cache
    measured_gflops: float | None = None  # f32 GEMM rate measured on this machine (GFLOP/s), from the cache
    apple_chip: str = ""  # "M2 Max" on Apple silicon
    huge_pages: bool = False  # the kernel gives anonymous memory transparent huge pages (THP always or madvise)
    gpu_cores: int = 0  # Apple silicon's GPU cores

    @classmethod
    def from_json(cls, path: str) -> HostFacts:
        """A machine described in a JSON file (the fields above; `flags` a list). Bad files are PlanErrors."""
        try:
            data = json.loads(Path(path).read_text())
            data["flags"] = frozenset(data.get("flags", ()))
            return cls(**data)
        except (OSError, ValueError, TypeError) as e:
            raise PlanError(f"{HOST_ENV}={path}: cannot read a host description ({e}); fields are "
                            f"{', '.join(f.name for f in fields(cls))}") from e

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "flags": sorted(self.flags)}, indent=1)

    @property
    def key(self) -> str:
        """Identifies the machine in the measurement cache: a different CPU or core count measures anew."""
        return f"cpu:{self.model}:{self.cpus}"


def _memory_bytes() -> float:
    total = 0.0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = float(line.split()[1]) * 1024
    except OSError:
        total = float(_run(["sysctl", "-n", "hw.memsize"]).strip() or 8e9)
    try:  # a cgroup limit (containers) caps what a process may use
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            total = min(total, float(limit))
    except OSError:
        pass
    return total


def pinned_host() -> HostFacts | None:
    """The machine named by $TWINFER_HOST_FACTS (a HostFacts JSON file) instead of this one, if set:
    tests pin one so every plan sees the same hardware; `twinfer plan` can answer for another computer."""
    path = os.environ.get(HOST_ENV)
    return HostFacts.from_json(path) if path else None


def read_host() -> HostFacts:
    """This machine's CPU facts (Linux /proc and /sys, macOS sysctl, elsewhere what `platform` knows)."""
    pinned = pinned_host()
    if pinned is not None:
        return pinned
    info = cpuinfo()
    system, machine = platform.system(), platform.machine()
    flags = set(info.get("flags", info.get("Features", "")).split())
    model = info.get("model name") or platform.processor() or machine or "cpu"
    vendor = info.get("vendor_id", "")
    if system == "Darwin":
        model = _run(["sysctl", "-n", "machdep.cpu.brand_string"]).strip() or model
        vendor = "Apple" if machine == "arm64" else vendor
        if machine == "arm64":  # every M-series core has dotprod and i8mm from M2 on; M1 has dotprod
            flags |= {"asimd", "asimddp"} | ({"i8mm"} if "M1" not in model else set())
    cpus = len(usable_cpus())
    host = HostFacts(system=system, machine=machine, model=model, vendor=vendor, flags=frozenset(flags),
                     cpus=cpus, cores=min(default_threads(), cpus), ghz=float(info.get("cpu MHz", 0) or 0) / 1000,
                     memory_bytes=_memory_bytes(), huge_pages=thp_mode() in HUGE_PAGE_MODES)
    cached = _cached()
    measured, gemm = cached.get(host.key), cached.get(host.key + ":gemm")
    return replace(host, measured_gbs=float(measured) if measured else None,
                   measured_gflops=float(gemm) if gemm else None)


def llamacpp_repacks(host: HostFacts) -> tuple[str, ...]:
    """Weight formats llama.cpp repacks into interleaved tiles on this CPU (as ggml-cpu/repack.cpp's
    `ggml_repack_get_optimal_repack_type` decides); the rest run the plain dot products."""
    f = host.flags
    if "avx2" in f:
        return ("q4_0", "q4_k", "iq4_nl", "mxfp4") + (("q2_k",) if "avx512f" in f else ())
    arm = host.machine in ("aarch64", "arm64") or "asimd" in f
    if arm and ({"i8mm", "asimddp", "dotprod"} & f):
        return ("q4_0", "q4_k", "q5_k", "q6_k", "q8_0", "iq4_nl", "mxfp4")
    return ()


def cpu_rates(host: HostFacts) -> tuple[str, float, float]:
    """(ISA label, f32 FLOPs per cycle per core, int8 dot-product ops per cycle per core); AVX-512 VNNI
    counts as 256-bit (ggml's K-quant dot products), AMX not at all."""
    f, intel = host.flags, "Intel" in host.vendor
    arm = host.machine in ("aarch64", "arm64") or "asimd" in f
    if "avx512f" in f:
        fma = 64 if intel else 32
        vnni = "avx512_vnni" in f
        return "avx512" + ("+vnni" if vnni else "") + ("+bf16" if "avx512_bf16" in f else ""), fma, (
            128 if vnni else 64)
    if "avx2" in f:
        return ("avx2+vnni", 32, 128) if "avx_vnni" in f else ("avx2", 32, 64)
    if arm:
        if "i8mm" in f:
            return "neon+i8mm", 16, 128
        return ("neon+dotprod", 16, 64) if ("asimddp" in f or "dotprod" in f) else ("neon", 16, 32)
    return "sse", 8, 16


def effective_ghz(host: HostFacts, fma: float) -> float:
    """The clock arithmetic is priced at: the reported one (2.5 GHz if none), or the faster one a measured
    f32 GEMM implies (x86 only; docs/planner-accuracy.md, "The measured clock")."""
    reported = host.ghz or 2.5
    if host.measured_gflops and host.machine in ("x86_64", "AMD64", "amd64"):
        return max(reported, host.measured_gflops / (host.cores * fma))
    return reported


def probe_cpu(host: HostFacts | None = None, measure: bool = True) -> Cluster:
    """A machine's CPU as the planner sees it: cores, memory, f32 and int8 peaks, read bandwidth; this
    machine's rates are measured once and cached with `measure`, else guessed and said so."""
    if host is None:
        host = read_host()
        if host.measured_gbs is None and measure:
            host = replace(host, measured_gbs=measure_cpu_bandwidth())
        if host.measured_gflops is None and measure and pinned_host() is None:  # a described host is as written
            host = replace(host, measured_gflops=measure_cpu_gemm_apart())
    isa, fma, int8 = cpu_rates(host)
    ghz = effective_ghz(host, fma)
    f32 = host.cores * ghz * fma / 1000
    measured = host.measured_gbs
    bandwidth = measured if measured else min(8.0 * host.cores, 200.0)
    device = Device(
        name="cpu", label=f"{host.model} ({host.cores} cores, {isa})", vendor="cpu", kind=CPU,
        memory_gb=round(host.memory_bytes / 1e9, 1), bandwidth_gbs=round(bandwidth, 1), memory_type="ddr",
        interconnect_gbs=0.0, link="none", tensor_tflops=(("f32", f32), ("int8", host.cores * ghz * int8 / 1000)),
        vector_tflops=f32, clock_ghz=ghz, chip=host.model, storage_gbs=2.0, measured=bool(measured),
        cores=host.cores, repacks=llamacpp_repacks(host), huge_pages=host.huge_pages,
        source=("measured read bandwidth" if measured else "probed; bandwidth estimated at 8 GB/s per core")
        + (f"; clock {ghz:.2f} GHz from a measured f32 GEMM" if ghz > (host.ghz or 2.5) else ""),
    )
    note = () if measured else ("CPU bandwidth is an estimate: run `twinfer hw --measure` once to measure it",)
    return Cluster(device, notes=note)


def detect() -> Cluster:
    """The local machine: NVIDIA GPUs if any, else Apple silicon, else the CPU (a pinned host: its own)."""
    pinned = pinned_host()
    if pinned is not None:
        return _apple_row(pinned) or probe_cpu(pinned)
    return probe_nvidia() or probe_apple() or probe_cpu()


# -- measurements ------------------------------------------------------------------------------------
def _last_level_cache_bytes() -> int:
    for path in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"), reverse=True):
        try:
            text = path.read_text().strip().upper()
            return int(text[:-1]) * (1 << 20 if text.endswith("M") else 1 << 10) if text[-1] in "KM" else int(text)
        except (OSError, ValueError, IndexError):
            continue
    out = _run(["sysctl", "-n", "hw.l3cachesize"]).strip() or _run(["sysctl", "-n", "hw.perflevel0.l2cachesize"]).strip()
    return int(out) if out.isdigit() else 32 << 20


def measure_cpu_bandwidth(total_mb: int | None = None, seconds: float = 1.0) -> float:
    """Read bandwidth in GB/s: each usable core sums its own array for `seconds` (at least three passes);
    the median pass, cached per CPU. Arrays of 2-4x the last-level cache, at most 512 MB."""
    import numpy as np

    threads = max(1, default_threads())
    llc = _last_level_cache_bytes()
    total = total_mb * 2**20 if total_mb else min(max(4 * llc, 64 << 20), max(2 * llc, 256 << 20), 512 << 20)
    arrays = [np.ones(total // threads // 4, dtype=np.float32) for _ in range(threads)]
    passes: list[float] = []
    began = time.perf_counter()
    while len(passes) < 3 or time.perf_counter() - began < seconds:
        start = time.perf_counter()
        workers = [threading.Thread(target=a.sum) for a in arrays]  # numpy releases the GIL while summing
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        passes.append(threads * arrays[0].nbytes / (time.perf_counter() - start) / 1e9)
    measured = float(np.median(passes))
    _store(read_host().key, round(measured, 2))
    return measured


def measure_cpu_gemm(n: int = 2048, seconds: float = 0.5) -> float:
    """f32 matrix-multiply rate in GFLOP/s on every usable core (numpy's BLAS, n x n by n x n): the median
    of about `seconds` of products (at least three), cached beside the bandwidth; read by `effective_ghz`."""
    import numpy as np

    a = np.random.default_rng(0).random((n, n), dtype=np.float32)
    b = a.T.copy()
    # every product into one array: a fresh result per product grows the process's RSS
    c = np.empty_like(a)
    for _ in range(2):  # the BLAS threads start and the pages are touched (one product was not enough)
        np.matmul(a, b, out=c)
    rates: list[float] = []
    began = time.perf_counter()
    while len(rates) < 3 or time.perf_counter() - began < seconds:
        start = time.perf_counter()
        np.matmul(a, b, out=c)
        rates.append(2 * n**3 / (time.perf_counter() - start) / 1e9)
    measured = float(np.median(rates))
    _store(read_host().key + ":gemm", round(measured, 1))
    return measured


def measure_cpu_gemm_apart() -> float:
    """`measure_cpu_gemm` in a child interpreter (it caches the rate there), in-process if that fails: BLAS
    leaves memory behind that would raise a `--memory-budget` run's peak (docs/quantization.md)."""
    code = "from twinfer.planners.probe import measure_cpu_gemm; print(measure_cpu_gemm())"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
        return float(out.stdout.split()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return measure_cpu_gemm()


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
