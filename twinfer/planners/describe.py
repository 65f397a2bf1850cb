"""`--hardware` as a user writes it: `auto`, `cpu`, a table name, or a described device (inline or a
TOML/JSON file, docs/hardware.md); defaults are recorded in `source`. `resolve_cluster` is the one place
a command turns its hardware flags into the `Cluster` it plans on."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from twinfer.planners.hardware import APPLE, CPU, GPU, LINK_GBS, Cluster, Device, lookup
from twinfer.runtime.errors import PlanError

DTYPES = ("bf16", "f16", "fp8", "int8", "fp4", "f32")  # tensor_tflops keys a description may give
MEMORY_TYPES = ("hbm", "gddr", "lpddr", "ddr")
# Each field: (unit table for a number with a suffix, what to write). A plain number is in the first unit.
_GB = {"gb": 1.0, "gib": 1.073741824, "tb": 1000.0, "tib": 1099.511627776, "mb": 0.001, "mib": 0.001048576}
_GBS = {"gb/s": 1.0, "tb/s": 1000.0, "mb/s": 0.001, "gib/s": 1.073741824}
_TFLOPS = {"tflops": 1.0, "tops": 1.0, "t": 1.0, "pflops": 1000.0, "pops": 1000.0, "gflops": 0.001, "gops": 0.001}
_GHZ = {"ghz": 1.0, "mhz": 0.001}
NUMBERS: dict[str, tuple[dict[str, float], str]] = {
    "memory_gb": (_GB, "memory=24GB"),
    "bandwidth_gbs": (_GBS, "bandwidth=1008GB/s"),
    "vector_tflops": (_TFLOPS, "vector=82.6TFLOPS (FP32, non-tensor)"),
    "clock_ghz": (_GHZ, "clock=2.52GHz"),
    "interconnect_gbs": (_GBS, "interconnect=64GB/s"),
    "storage_gbs": (_GBS, "storage=7GB/s"),
    "host_link_gbs": (_GBS, "host_link=64GB/s"),
    **{d: (_TFLOPS, f"{d}=165TFLOPS (dense, without sparsity)") for d in DTYPES},
}
TEXTS = {"kind": "kind=gpu (or cpu, apple)", "label": "label=My card", "link": "link=pcie4",
         "memory_type": "memory_type=gddr (or hbm, lpddr, ddr)", "max_per_node": "max_per_node=4"}
# CPUs only: what llama.cpp's kernels get there (cost._kernel_stream_s, cost.on_huge_pages)
CPU_KEYS = {"cores": "cores=8 (physical cores llama.cpp computes on)",
            "repacks": "repacks=q4_0/q4_k/iq4_nl/mxfp4 (formats llama.cpp repacks on this ISA)",
            "huge_pages": "huge_pages=yes (Linux gives transparent huge pages)"}
SHORT = {"memory": "memory_gb", "mem": "memory_gb", "bandwidth": "bandwidth_gbs", "bw": "bandwidth_gbs",
         "vector": "vector_tflops", "clock": "clock_ghz", "interconnect": "interconnect_gbs",
         "storage": "storage_gbs", "host_link": "host_link_gbs", "per_node": "max_per_node", "name": "label"}
KNOWN = (*NUMBERS, *TEXTS, *CPU_KEYS, "tensor_tflops")
_DEFAULT_CLOCK = {GPU: 1.8, APPLE: 1.4, CPU: 3.0}


def is_description(hardware: str) -> bool:
    """Whether `--hardware` is a description (a .toml/.json file, or inline `key=value` pairs), not a table name."""
    return "=" in hardware or _is_file_name(hardware)


def _is_file_name(hardware: str) -> bool:
    return "=" not in hardware and hardware.lower().endswith((".toml", ".json"))


ZERO_OK = ("interconnect_gbs", "storage_gbs", "host_link_gbs")  # "none" is a fine answer for these


def _number(key: str, value: Any, origin: str) -> float:
    units, example = NUMBERS[key]
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise PlanError(f"{origin}: {key}: {value!r} is not a number; write e.g. {example}")
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z/]*)\s*", value)
        unit = m.group(2).lower() if m else ""
        if m is None or (unit and unit not in units):
            raise PlanError(f"{origin}: {key}: cannot read {value!r}; write e.g. {example}")
        number = float(m.group(1)) * (units[unit] if unit else 1.0)
    if not (number > 0 or (number == 0 and key in ZERO_OK)):
        raise PlanError(f"{origin}: {key} must be a positive number, got {value!r}; write e.g. {example}")
    return number


def _fields(raw: dict[str, Any], origin: str) -> dict[str, Any]:
    """Canonical keys (`memory` -> `memory_gb`), numbers read with their units, unknown keys refused."""
    out: dict[str, Any] = {}
    for k, v in raw.items():
        key = SHORT.get(k.strip().lower(), k.strip().lower())
        if key == "tensor_tflops":
            if not isinstance(v, dict):
                raise PlanError(f"{origin}: tensor_tflops must be a table of dtype = TFLOPS, e.g. bf16 = 165")
            for dtype, rate in v.items():
                if dtype not in DTYPES:
                    raise PlanError(f"{origin}: tensor_tflops.{dtype} is not a dtype; use {', '.join(DTYPES)}")
                out[dtype] = _number(dtype, rate, origin)
        elif key in NUMBERS:
            out[key] = _number(key, v, origin)
        elif key in TEXTS:
            out[key] = str(v).strip()
        elif key in CPU_KEYS:
            out[key] = _cpu_key(key, v, origin)
        else:
            raise PlanError(f"{origin}: unknown key {k!r}; known keys: {', '.join(KNOWN)} (docs/hardware.md)")
    return out


def _cpu_key(key: str, value: Any, origin: str) -> Any:
    """`cores` a whole number, `repacks` format names ("/"-separated inline, a list in a file),
    `huge_pages` yes or no."""
    from twinfer.planners.formats import FORMATS

    bad = PlanError(f"{origin}: {key}: cannot read {value!r}; write e.g. {CPU_KEYS[key]}")
    if key == "cores":
        if isinstance(value, bool) or not str(value).strip().isdigit() or int(value) < 1:
            raise bad
        return int(value)
    if key == "huge_pages":
        if isinstance(value, bool):
            return value
        word = str(value).strip().lower()
        if word not in ("yes", "no", "true", "false", "1", "0"):
            raise bad
        return word in ("yes", "true", "1")
    names = value if isinstance(value, list) else str(value).replace(",", "/").split("/")
    out = tuple(str(n).strip().lower() for n in names if str(n).strip())
    unknown = [n for n in out if n not in FORMATS]
    if unknown:
        raise PlanError(f"{origin}: repacks: {', '.join(unknown)} is not a weight format; write e.g. {CPU_KEYS[key]}")
    return out


def parse_inline(text: str) -> dict[str, Any]:
    """`gpu:memory=24GB,bandwidth=1008GB/s` -> {"kind": "gpu", "memory_gb": 24.0, ...}."""
    raw: dict[str, Any] = {}
    head, sep, rest = text.partition(":")
    if sep and "=" not in head:
        raw["kind"], text = head, rest
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise PlanError(f"--hardware: cannot read {part!r}; write key=value pairs separated by commas, "
                            "e.g. 'gpu:memory=24GB,bandwidth=1008GB/s,bf16=165TFLOPS'")
        raw[key.strip()] = value.strip()
    return _fields(raw, "--hardware")


def read_file(path: str) -> dict[str, Any]:
    """The description in a `.toml` or `.json` file (TOML needs Python 3.11's tomllib or the tomli package)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise PlanError(f"--hardware {path}: cannot read the file ({e.strerror or e})") from None
    try:
        data = json.loads(text) if p.suffix.lower() == ".json" else _toml().loads(text)
    except (ValueError, TypeError) as e:  # json.JSONDecodeError and tomllib.TOMLDecodeError are ValueErrors
        raise PlanError(f"--hardware {path}: not valid {p.suffix.lstrip('.').upper() or 'TOML'}: {e}") from None
    if not isinstance(data, dict):
        raise PlanError(f"--hardware {path}: expected a table of keys (memory_gb, bandwidth_gbs, ...)")
    return _fields(data, f"--hardware {path}")


def _toml() -> Any:
    import importlib

    for name in ("tomllib", "tomli"):  # tomllib from Python 3.11; the tomli package on 3.10
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise PlanError("reading TOML needs Python 3.11 or `pip install tomli`; or write the description as JSON")


def _compute(kind: str, f: dict[str, Any], assumed: list[str]) -> tuple[tuple[tuple[str, float], ...], float]:
    """(tensor_tflops, vector_tflops) from what was given; GPUs need one of them, CPUs and Macs their rate."""
    tensor = {d: f[d] for d in DTYPES if d in f}
    vector = f.get("vector_tflops")
    if kind == GPU:
        if not tensor and vector is None:
            raise PlanError("hardware description: give the GPU's dense tensor rate (bf16=165TFLOPS, also f16, fp8, "
                            "int8, fp4 as it has them) or its FP32 rate (vector=82.6TFLOPS)")
        if vector is not None and not tensor:
            tensor = {"bf16": 4 * vector, "f16": 4 * vector}
            assumed.append("tensor rate assumed 4x the FP32 rate")
        if vector is None:
            vector = max(tensor.values()) / 4
            assumed.append("FP32 rate assumed a quarter of the fastest tensor rate")
        return tuple(tensor.items()), float(vector)
    main = "f32" if kind == CPU else "f16"
    rate = vector if vector is not None else tensor.get(main, tensor.get("f32", tensor.get("f16")))
    if rate is None:
        what = ("vector=1.2TFLOPS (cores x GHz x 32 for AVX2, x 64 for AVX-512)" if kind == CPU
                else "vector=16TFLOPS (GPU cores x 256 x GHz)")
        raise PlanError(f"hardware description: give the {kind}'s FP32 rate, {what}")
    tensor.setdefault(main, rate)
    if kind == APPLE:
        tensor.setdefault("bf16", rate)
    return tuple(tensor.items()), float(rate)


def _links(kind: str, f: dict[str, Any], assumed: list[str]) -> tuple[str, float, float]:
    """(link, interconnect GB/s, host link GB/s): a GPU's default is a PCIe 4 x16 card."""
    if kind != GPU:
        return f.get("link", "none"), f.get("interconnect_gbs", 0.0), f.get("host_link_gbs", 0.0)
    link = f.get("link", "")
    if not link:
        link = "pcie4"
        assumed.append("link assumed pcie4")
    if "interconnect_gbs" in f:
        ic = f["interconnect_gbs"]
    elif link.lower() in LINK_GBS:
        ic = LINK_GBS[link.lower()]
    else:
        raise PlanError(f"hardware description: unknown link {link!r}; use one of {', '.join(LINK_GBS)}, "
                        "or give its bandwidth (interconnect=200GB/s)")
    host = f.get("host_link_gbs", ic if link.lower().startswith("pcie") else LINK_GBS["pcie4"])
    return link.lower(), ic, host


def describe_device(f: dict[str, Any], origin: str = "--hardware") -> Device:
    """A `Device` from description fields (as `parse_inline`/`read_file` return them), defaults stated."""
    kind = str(f.get("kind", GPU)).lower()
    if kind not in (GPU, CPU, APPLE):
        raise PlanError(f"{origin}: kind must be gpu, cpu or apple, not {kind!r}")
    for key, example in (("memory_gb", "memory=24GB"), ("bandwidth_gbs", "bandwidth=1008GB/s")):
        if key not in f:
            raise PlanError(f"{origin}: {key} is missing; write e.g. {example}")
    assumed: list[str] = [] if "kind" in f else ["kind assumed gpu"]
    tensor, vector = _compute(kind, f, assumed)
    link, ic, host = _links(kind, f, assumed)
    mtype = f.get("memory_type", {GPU: "gddr", APPLE: "lpddr", CPU: "ddr"}[kind]).lower()
    if mtype not in MEMORY_TYPES:
        raise PlanError(f"{origin}: memory_type must be one of {', '.join(MEMORY_TYPES)}, not {mtype!r}")
    if "memory_type" not in f and kind == GPU:
        assumed.append("memory assumed GDDR, a local target (memory_type=hbm for a datacenter GPU)")
    if "clock_ghz" not in f:
        assumed.append(f"clock assumed {_DEFAULT_CLOCK[kind]:g} GHz")
    per_node = f.get("max_per_node", "8" if kind == GPU else "1")
    if not str(per_node).isdigit():
        raise PlanError(f"{origin}: max_per_node must be a whole number of devices, e.g. max_per_node=4")
    given = [k for k in CPU_KEYS if k in f]
    if given and kind != CPU:
        raise PlanError(f"{origin}: {', '.join(given)} describe a CPU's llama.cpp kernels; this device is kind={kind}")
    if kind == CPU and "cores" not in f:
        assumed.append("cores not given, so no bound from llama.cpp's kernels (cores=8 sets one)")
    mem, bw = f["memory_gb"], f["bandwidth_gbs"]
    label = f.get("label") or f"described {kind} ({mem:g} GB, {bw:g} GB/s)"
    source = f"described by {origin}" + (f"; {'; '.join(assumed)}" if assumed else "")
    return Device(
        name="described", label=label, vendor="described", kind=kind, memory_gb=mem, bandwidth_gbs=bw,
        memory_type=mtype, interconnect_gbs=ic, link=link, tensor_tflops=tensor, vector_tflops=vector,
        clock_ghz=f.get("clock_ghz", _DEFAULT_CLOCK[kind]), source=source, chip=label, host_link_gbs=host,
        storage_gbs=f.get("storage_gbs", 0.0), max_per_node=int(per_node),
        cores=f.get("cores", 0), repacks=f.get("repacks", ()), huge_pages=f.get("huge_pages", False),
    )


def device_from(hardware: str) -> Device:
    """The device a description names: inline `key=value` pairs, or a `.toml`/`.json` file."""
    if _is_file_name(hardware):
        return describe_device(read_file(hardware), f"--hardware {hardware}")
    return describe_device(parse_inline(hardware))


def resolve_cluster(hardware: str, gpus: int | None = None, nodes: int | None = None,
                    memory_budget: str | None = None, follow_build: bool = True) -> Cluster:
    """`auto` probes this machine, `cpu` its CPU, else a description or table name; `gpus`/`nodes`
    override the count, `memory_budget` caps each device; `follow_build` plans the CPU where this
    llama.cpp build cannot use the local GPU."""
    from twinfer.planners import probe
    from twinfer.planners.hw_table import DEVICES, NODE_SHAPES
    from twinfer.planners.units import parse_bytes

    if hardware == "auto":
        cluster = probe.detect()
    elif hardware == "cpu":
        cluster = probe.probe_cpu()
    elif is_description(hardware):
        cluster = Cluster(device_from(hardware))
    else:
        device, node = lookup(hardware, DEVICES, NODE_SHAPES)
        per_node = node.gpus if node else 1
        cluster = Cluster(device, gpus_per_node=per_node if gpus is None else gpus,
                          nodes=1 if nodes is None else nodes, scale_out_gbs=node.scale_out_gbs if node else 50.0)
        gpus = nodes = None
    if gpus is not None or nodes is not None:
        cluster = Cluster(cluster.device, cluster.gpus_per_node if gpus is None else gpus,
                          cluster.nodes if nodes is None else nodes, cluster.scale_out_gbs, notes=cluster.notes)
    cluster = with_build(cluster, hardware == "auto" and follow_build)
    if memory_budget is not None:
        budget = parse_bytes(memory_budget)
        if budget <= 0:
            raise PlanError(f"--memory-budget must be positive, got {memory_budget!r}")
        cluster = replace(cluster, memory_budget_bytes=budget)
    return cluster


def with_build(cluster: Cluster, follow: bool = False) -> Cluster:
    """`cluster` with the installed llama.cpp build where it has a GPU or Apple silicon; when `follow` and
    that build cannot use a local one (the CPU-only `pip install`), this machine's CPU instead, saying why."""
    from twinfer.planners import probe
    from twinfer.planners.llamacpp_build import read_build
    from twinfer.planners.placement import GPU_BUILD_HINT
    from twinfer.planners.search import target_of

    device = cluster.device
    if device.kind == CPU:
        return cluster
    build = read_build()
    if build is None:
        return cluster
    if follow and target_of(cluster) == "local" and build.backend_for(device) is None:
        cpu = probe.probe_cpu(probe.pinned_host())
        note = (f"found {device.label}, but the installed llama-cpp-python is {build.kind()} and cannot use "
                f"it: planned on the CPU. To get a GPU build: {GPU_BUILD_HINT}")
        return replace(cpu, memory_budget_bytes=cluster.memory_budget_bytes, notes=(*cpu.notes, note))
    return replace(cluster, llamacpp_build=build)
