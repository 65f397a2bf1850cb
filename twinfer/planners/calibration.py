"""Efficiency factors: how much of the hardware's peak each engine reaches, per device class.
Each factor is fitted to measurements in docs/planner-accuracy.md ("The cost model and its calibration")
and can be overridden: `Calibration.load(path)` reads `{"llamacpp/cpu": {"bandwidth": 0.8, ...}, ...}`.
Per-layer costs are GPU clock cycles: a decode step's small kernels are latency-bound."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from twinfer.planners.hardware import APPLE, CPU, Device
from twinfer.runtime.errors import PlanError


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak, and fixed costs, for one engine on one class of device."""

    bandwidth: float = 0.85  # of peak memory bandwidth, streaming weights and KV in decode
    tensor: float = 0.5  # of dense tensor FLOPs in large GEMMs (prefill, big decode batches)
    vector: float = 0.5  # of the FP32 vector rate, in dequantization loops
    attention: float = 0.5  # CPU only: of the f32 FMA peak, in prefill attention (QK^T, PV) on a float KV cache
    overlap_loss: float = 0.3  # share of the shorter of (memory, ALU) time a fused kernel fails to hide
    layer_cycles: float = 60e3  # fixed GPU cycles per layer per step (launches, norms, small ops)
    moe_layer_factor: float = 1.5  # an MoE layer's fixed cost relative to a dense layer's
    step_s: float = 0.0  # fixed host time per step (scheduling, sampling)
    collective_s: float = 10e-6  # latency of one all-reduce / all-to-all inside a node
    hop_s: float = 20e-6  # latency of one pipeline hop between nodes
    dual_die: float = 0.85  # bandwidth factor on two-die packages (Apple Ultra)
    # CPU only: weight bytes a core's matmul kernels stream per cycle at one row (decode), for formats
    # llama.cpp leaves as stored and for those it repacks on this ISA (Device.repacks); 0: no such bound
    stream_plain: float = 0.0
    stream_repacked: float = 0.0
    huge_pages: float = 1.0  # CPU only: weights on huge pages stream this much faster, from DRAM or through the kernels


# (engine, device class) -> factors; classes "hbm", "gddr" (LPDDR GPUs too), "apple", "cpu".
DEFAULTS: dict[str, Efficiency] = {
    # llama.cpp CUDA: fitted per class on llama.cpp's CUDA scoreboard (`python -m twinfer.planners.scoreboard`)
    "llamacpp/gddr": Efficiency(bandwidth=0.85, tensor=0.3, layer_cycles=60e3, moe_layer_factor=1.4),
    "llamacpp/hbm": Efficiency(bandwidth=0.92, tensor=0.1, layer_cycles=130e3, moe_layer_factor=1.7),
    # llama.cpp Metal: fitted on the Apple scoreboard (M4 Pro vs M4 Max separates the two terms)
    "llamacpp/apple": Efficiency(bandwidth=0.90, tensor=0.65, layer_cycles=211e3, moe_layer_factor=1.0),
    "mlx/apple": Efficiency(bandwidth=0.90, tensor=0.65, layer_cycles=211e3, moe_layer_factor=1.0),
    # CPU: bandwidth is relative to the *measured* read bandwidth, cycles are CPU cycles per layer; each
    # factor's fit and history: docs/planner-accuracy.md, "The cost model and its calibration"
    "llamacpp/cpu": Efficiency(bandwidth=0.82, tensor=0.5, vector=0.35, attention=0.49, overlap_loss=0.25,
                               layer_cycles=30e3, moe_layer_factor=1.5, step_s=0.4e-3, stream_plain=3.0,
                               stream_repacked=8.0, huge_pages=1.15),
    "torch/cpu": Efficiency(bandwidth=0.364, tensor=0.262, vector=0.2, attention=0.262, overlap_loss=0.5,
                            layer_cycles=400e3, moe_layer_factor=2.0, step_s=2e-3),
    # vLLM/SGLang-class serving, fitted on Llama-3.1-8B BF16 (A100, H100); twinfer's CUDA backend uses it too
    "vllm/hbm": Efficiency(bandwidth=0.86, tensor=0.6, layer_cycles=56e3, moe_layer_factor=1.5),
    "vllm/gddr": Efficiency(bandwidth=0.86, tensor=0.5, layer_cycles=56e3, moe_layer_factor=1.5),
    "torch/hbm": Efficiency(bandwidth=0.86, tensor=0.6, layer_cycles=56e3, moe_layer_factor=1.5),
    "torch/gddr": Efficiency(bandwidth=0.86, tensor=0.5, layer_cycles=56e3, moe_layer_factor=1.5),
    "torch/apple": Efficiency(bandwidth=0.7, tensor=0.4, layer_cycles=400e3, moe_layer_factor=1.5),
}
ALIASES = {"sglang": "vllm", "trtllm": "vllm", "cuda": "torch", "metal": "mlx"}


def device_class(device: Device) -> str:
    if device.kind == APPLE:
        return "apple"
    if device.kind == CPU:
        return "cpu"
    return "hbm" if device.memory_type == "hbm" else "gddr"


@dataclass(frozen=True)
class Calibration:
    """The factor table in force: defaults plus any overrides loaded from a file."""

    table: tuple[tuple[str, Efficiency], ...] = tuple(DEFAULTS.items())

    def get(self, engine: str, device: Device) -> Efficiency:
        engine = ALIASES.get(engine, engine)
        cls = device_class(device)
        table = dict(self.table)
        for key in (f"{engine}/{cls}", f"{engine}/gddr" if cls == "hbm" else "", f"torch/{cls}"):
            if key in table:
                return table[key]
        return Efficiency()

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        try:
            data: dict[str, Any] = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise PlanError(f"cannot read calibration file {path}: {exc}") from exc
        table = dict(DEFAULTS)
        names = {f.name for f in fields(Efficiency)}
        for key, values in data.items():
            unknown = set(values) - names
            if unknown:
                raise PlanError(f"calibration {key}: unknown fields {sorted(unknown)}; known: {sorted(names)}")
            table[key] = replace(table.get(key, Efficiency()), **values)
        return cls(tuple(table.items()))
