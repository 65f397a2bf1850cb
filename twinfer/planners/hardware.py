"""What the planner knows about hardware: one device, a node shape, and the cluster a plan runs on,
from the published table or the probe; the planner never asks a device itself."""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from twinfer.runtime.errors import PlanError

if TYPE_CHECKING:
    from twinfer.planners.placement import LlamaBuild

GPU, APPLE, CPU = "gpu", "apple", "cpu"
HOST_DRAM_GBS = 60.0  # experts left in host RAM run at desktop DDR5 speed (llama.cpp --n-cpu-moe)
NVME_GBS = 3.0  # a PCIe 4 NVMe drive's sequential read, for rows that publish no storage rate
# Per-device link bandwidth as vendors publish it (bidirectional; PCIe at x16), by the `link` name rows use.
LINK_GBS: dict[str, float] = {
    "none": 0.0, "pcie3": 32.0, "pcie4": 64.0, "pcie5": 128.0, "pcie6": 256.0,
    "nvlink2": 300.0, "nvlink3": 600.0, "nvlink4": 900.0, "nvlink5": 1800.0,
}


@dataclass(frozen=True)
class Device:
    """One accelerator (or CPU socket set) with its published or measured peaks; `interconnect_gbs` is the
    vendor's bidirectional per-device figure (halved per direction), `tensor_tflops` dense peaks."""

    name: str
    label: str
    vendor: str
    kind: str  # GPU, APPLE or CPU
    memory_gb: float
    bandwidth_gbs: float
    memory_type: str  # "hbm", "gddr", "lpddr", "ddr"
    interconnect_gbs: float
    link: str
    tensor_tflops: tuple[tuple[str, float], ...]
    vector_tflops: float  # FP32 non-tensor rate: what a dequantization loop runs on
    clock_ghz: float
    source: str
    chip: str = ""
    gpu_cores: int | None = None
    memory_options_gb: tuple[float, ...] = ()
    host_link_gbs: float = 0.0  # PCIe to host memory (discrete GPUs): where streamed experts come from
    storage_gbs: float = 0.0  # SSD read rate (unified-memory machines stream experts from disk)
    dies: int = 1
    max_per_node: int = 1  # devices that share one fast (NVLink/xGMI) domain
    measured: bool = False
    cores: int = 0  # CPUs: physical cores the runner uses (0: not a CPU, or not known)
    repacks: tuple[str, ...] = ()  # CPUs: weight formats llama.cpp repacks into its interleaved tiles here
    huge_pages: bool = False  # CPUs: the kernel gives huge pages (Linux THP), so llama.cpp's weights sit on them
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in (GPU, APPLE, CPU):
            raise PlanError(f"hardware {self.name}: kind must be {GPU}, {APPLE} or {CPU}, not {self.kind!r}")
        positive = {"memory_gb": self.memory_gb, "bandwidth_gbs": self.bandwidth_gbs,
                    "vector_tflops": self.vector_tflops, "clock_ghz": self.clock_ghz,
                    **{f"tensor_tflops.{k}": v for k, v in self.tensor_tflops}}
        for key, value in positive.items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise PlanError(f"hardware {self.name}: {key} must be a positive number, got {value!r}")
        for key, value in (("interconnect_gbs", self.interconnect_gbs), ("host_link_gbs", self.host_link_gbs),
                           ("storage_gbs", self.storage_gbs)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise PlanError(f"hardware {self.name}: {key} must be zero or a positive number, got {value!r}")
        if self.max_per_node < 1 or self.dies < 1:
            raise PlanError(f"hardware {self.name}: max_per_node and dies must be at least 1")

    @property
    def natives(self) -> frozenset[str]:
        """Compute dtypes the matrix units consume directly (no dequantization loop)."""
        return frozenset(k for k, _ in self.tensor_tflops)

    def tflops(self, dtype: str) -> float:
        table = dict(self.tensor_tflops)
        if dtype in table:
            return table[dtype]
        return table.get("bf16", table.get("f16", self.vector_tflops))

    @property
    def stream_gbs(self) -> float:
        """GB/s at which experts that are not resident are read: the SSD on unified memory, host RAM (at
        desktop DDR5 speed, where llama.cpp's --n-cpu-moe runs them) beside a discrete GPU. A unified row
        that names no SSD rate (a GB10) gets a PCIe 4 NVMe drive's 3 GB/s rather than zero."""
        return (self.storage_gbs or NVME_GBS) if self.unified else HOST_DRAM_GBS

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    @property
    def unified(self) -> bool:
        return self.kind in (APPLE, CPU) or self.memory_type == "lpddr"

    def with_memory(self, gb: float) -> Device:
        return replace(self, memory_gb=gb)

    def row(self) -> dict[str, Any]:
        """The object `twinfer hw --list --json` prints."""
        return {
            "name": self.name,
            "label": self.label,
            "vendor": self.vendor,
            "kind": self.kind,
            "chip": self.chip or self.label,
            "gpu_cores": self.gpu_cores,
            "memory_gb": self.memory_gb,
            "memory_options_gb": list(self.memory_options_gb) or None,
            "memory_type": self.memory_type,
            "bandwidth_gbs": self.bandwidth_gbs,
            "interconnect_gbs": self.interconnect_gbs,
            "link": self.link,
            "tensor_tflops": dict(self.tensor_tflops),
            "vector_tflops": self.vector_tflops,
            "max_per_node": self.max_per_node,
            "source": self.source,
        }


@dataclass(frozen=True)
class NodeShape:
    """A standard server: `gpus` devices in one NVLink/xGMI domain, `scale_out_gbs` per GPU between nodes."""

    name: str
    label: str
    device: str
    gpus: int
    scale_out_gbs: float
    source: str
    aliases: tuple[str, ...] = ()

    def row(self, device: Device) -> dict[str, Any]:
        out = device.row()
        out.update(
            name=self.name, label=self.label, kind="node", gpus=self.gpus, device=device.name,
            total_memory_gb=device.memory_gb * self.gpus, scale_out_gbs=self.scale_out_gbs, source=self.source,
        )
        return out


@dataclass(frozen=True)
class Cluster:
    """The hardware a plan runs on: `gpus_per_node` devices in each of `nodes` nodes."""

    device: Device
    gpus_per_node: int = 1
    nodes: int = 1
    scale_out_gbs: float = 50.0  # one 400 Gb/s NIC per GPU
    memory_budget_bytes: float | None = None  # user cap per device
    notes: tuple[str, ...] = field(default_factory=tuple)
    llamacpp_build: LlamaBuild | None = None  # the installed llama-cpp-python's backends; None: not known

    def __post_init__(self) -> None:
        d = self.device
        if self.gpus_per_node < 1 or self.nodes < 1:
            raise PlanError(f"--gpus and --nodes must be at least 1 (got {self.gpus_per_node} and {self.nodes})")
        if not (math.isfinite(self.scale_out_gbs) and self.scale_out_gbs > 0):
            raise PlanError(f"the network between nodes needs a positive bandwidth, got {self.scale_out_gbs!r} GB/s")
        if self.memory_budget_bytes is not None and not self.memory_budget_bytes > 0:
            raise PlanError(f"--memory-budget must be positive, got {self.memory_budget_bytes!r} bytes")
        if d.kind != GPU and (self.gpus_per_node > 1 or self.nodes > 1):
            raise PlanError(f"{d.label} is a single {d.kind} device: --gpus and --nodes must be 1")
        if self.gpus_per_node > 1 and d.interconnect_gbs <= 0:
            raise PlanError(f"{d.label} names no link between its GPUs (interconnect 0 GB/s): use --gpus 1, "
                            "or describe its link (link=pcie4 or interconnect=64GB/s)")
        if self.gpus_per_node > d.max_per_node:
            nodes = -(-self.gpus_per_node // d.max_per_node)
            raise PlanError(
                f"at most {d.max_per_node} {d.label} share one node's {d.link} domain; "
                f"use --gpus {d.max_per_node} --nodes {nodes * self.nodes}"
            )

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def usable_fraction(self) -> float:
        """Share of device memory a runtime may fill: Metal's default wired limit, a GPU runtime's headroom."""
        if self.device.kind == APPLE:
            return 0.75 if self.device.memory_gb > 36 else 0.67
        if self.device.kind == CPU:
            return 0.85
        return 0.92

    @property
    def capacity_per_device(self) -> float:
        cap = self.device.memory_bytes * self.usable_fraction
        if self.memory_budget_bytes is not None:
            cap = min(cap, float(self.memory_budget_bytes))
        return cap

    @property
    def capacity_bytes(self) -> float:
        return self.capacity_per_device * self.world

    def describe(self) -> str:
        d = self.device
        if d.kind != GPU:
            return f"{d.label} ({d.memory_gb:g} GB, {d.bandwidth_gbs:g} GB/s)"
        shape = f"{self.gpus_per_node}x {d.label}" + (f" x {self.nodes} nodes" if self.nodes > 1 else "")
        return f"{shape} ({d.memory_gb:g} GB, {d.bandwidth_gbs:g} GB/s each)"


def normalize(name: str) -> str:
    """`NVIDIA H100 SXM` -> `h100-sxm`; `Apple M2 Max 38-core` -> `m2-max-38c`; `GeForce RTX 4070` -> `rtx-4070`."""
    s = name.lower().replace("_", "-").replace(" ", "-")
    s = re.sub(r"^((nvidia|amd|apple|instinct|geforce|tesla)-)+", "", s)
    s = re.sub(r"(\d+)-?core", r"\1c", s)
    s = re.sub(r"(\d+)-?gpu\b", r"\1c", s)
    return re.sub(r"-+", "-", s).strip("-")


def compact(name: str) -> str:
    """`normalize` without hyphens, so `rtx4070ti`, `RTX 4070 Ti` and `rtx-4070-ti` are one key."""
    return normalize(name).replace("-", "")


def _index(devices: dict[str, Device], nodes: dict[str, NodeShape]) -> dict[str, tuple[Device | None, NodeShape | None]]:
    index: dict[str, tuple[Device | None, NodeShape | None]] = {}
    for d in devices.values():
        for alias in (d.name, *d.aliases):
            index[compact(alias)] = (d, None)
    for n in nodes.values():
        for alias in (n.name, *n.aliases):
            index[compact(alias)] = (None, n)
    return index


def find(name: str, devices: dict[str, Device], nodes: dict[str, NodeShape]) -> tuple[Device, NodeShape | None] | None:
    """The device or node shape called `name` (any alias, case and punctuation ignored), or None."""
    hit = _index(devices, nodes).get(compact(name))
    if hit is None:
        return None
    device, node = hit
    if node is not None:
        device = devices[node.device]
    assert device is not None
    return device, node


def lookup(name: str, devices: dict[str, Device], nodes: dict[str, NodeShape]) -> tuple[Device, NodeShape | None]:
    """Find a device or node shape by name; `NAME@64` (or `@64GB`) picks a memory size where a row offers several.
    Raises PlanError listing close matches when nothing matches."""
    base, _, mem = name.partition("@")
    hit = find(base, devices, nodes)
    if hit is None:
        names = [normalize(a) for d in devices.values() for a in (d.name, *d.aliases)]
        names += [normalize(a) for n in nodes.values() for a in (n.name, *n.aliases)]
        close = difflib.get_close_matches(normalize(base), names, n=5, cutoff=0.5)
        hint = f"; did you mean {', '.join(dict.fromkeys(close))}?" if close else ""
        raise PlanError(f"unknown hardware {name!r}{hint} (`twinfer hw --list` shows the table; "
                        "--hardware also takes a description, e.g. 'gpu:memory=24GB,bandwidth=1008GB/s,bf16=165')")
    device, node = hit
    if mem:
        options = device.memory_options_gb or (device.memory_gb,)
        listed = ", ".join(f"{o:g}" for o in options)
        try:
            gb = float(re.sub(r"(?i)\s*gi?b$", "", mem.strip()))
        except ValueError:
            raise PlanError(f"cannot read the memory size in {name!r}: write e.g. {base}@{options[-1]:g}") from None
        if gb not in options:
            raise PlanError(f"{device.label} comes with {listed} GB, not {mem}")
        device = device.with_memory(gb)
    return device, node
