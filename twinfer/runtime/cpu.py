"""The CPUs this process may use, how many compute threads that makes, and the memory pages it gets.
llama.cpp's rule: one thread per physical core (performance cores on Apple silicon), read from the
topology: hyperthreads only add barrier waits."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

SYS_CPU = Path("/sys/devices/system/cpu")


def usable_cpus() -> list[int]:
    """Logical CPU ids this process may run on (its affinity mask where the OS has one)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is not None:
        try:
            return sorted(getaffinity(0))
        except OSError:
            pass
    return list(range(os.cpu_count() or 1))


def physical_cores(cpus: list[int] | None = None, sys_cpu: Path = SYS_CPU) -> int:
    """Distinct physical cores among `cpus` (default: the usable ones), from Linux's topology files; the
    logical count where those cannot be read."""
    cpus = usable_cpus() if cpus is None else cpus
    cores: set[tuple[str, str]] = set()
    for cpu in cpus:
        topo = sys_cpu / f"cpu{cpu}" / "topology"
        try:
            package = (topo / "physical_package_id").read_text().strip()
            core = (topo / "core_id").read_text().strip()
        except OSError:
            return max(1, len(cpus))
        cores.add((package, core))
    return max(1, len(cores))


def _apple_performance_cores() -> int | None:
    try:
        out = subprocess.run(["sysctl", "-n", "hw.perflevel0.physicalcpu"], capture_output=True, text=True,
                             timeout=5, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return int(out) if out.isdigit() and int(out) > 0 else None


def default_threads() -> int:
    """Compute threads a runner uses when the user names none: the physical cores we may use."""
    if platform.system() == "Darwin":
        perf = _apple_performance_cores()
        if perf:
            return min(perf, len(usable_cpus()))
    if platform.system() == "Linux":
        return physical_cores()
    return max(1, len(usable_cpus()))


def cpuinfo() -> dict[str, str]:
    """The first value of every /proc/cpuinfo key (the first CPU's model name, flags, MHz); {} off Linux."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def cpu_model() -> str:
    """The CPU's model name as Linux reports it (/proc/cpuinfo), else what `platform` knows."""
    return cpuinfo().get("model name") or platform.processor() or platform.machine() or "cpu"


# Huge pages: the planner's probe and cost model read these as the llama.cpp runner does, and planners
# import no backend, so the mode and the size rule live here, below both.
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGE_PAGE_MODES = ("always", "madvise")  # THP modes in which memory that asks for huge pages gets them


def thp_mode(path: Path = THP, status: Path = Path("/proc/self/status")) -> str | None:
    """The kernel's transparent-huge-page mode for this process's anonymous memory ("always", "madvise",
    "never"); None without THP (macOS, Windows, a kernel built without it). A process whose THP was
    turned off (`prctl(PR_SET_THP_DISABLE)`, which some container runtimes set and children inherit;
    `THP_enabled: 0` in its status) gets "never" whatever the system's mode."""
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        if "THP_enabled:\t0" in status.read_text():
            return "never"
    except OSError:
        pass
    return next((word[1:-1] for word in text.split() if word.startswith("[")), None)


def huge_pages_fit(model_bytes: float, memory_bytes: float | None) -> bool:
    """The llama.cpp runner's rule for weights on huge pages: at most half the memory. A bigger model stays
    mapped, where the kernel can drop and re-read its pages instead of swapping, and processes share them.
    The runner asks the memory available when it loads; a plan, the device's size."""
    return memory_bytes is not None and 2 * model_bytes <= memory_bytes
