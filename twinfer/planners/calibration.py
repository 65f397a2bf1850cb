"""Efficiency factors: how much of the hardware's peak each engine reaches, per device class.

Peaks come from the hardware table; these factors turn them into predictions. Each was fitted to
public measurements recorded in docs/planner-accuracy.md (the doc shows the fit and the residuals),
and each can be replaced by a measurement: `Calibration.load(path)` reads a JSON object
`{"llamacpp/cpu": {"bandwidth": 0.8, ...}, ...}` that overrides any field of any entry.

The per-layer cost is expressed in GPU clock cycles because the small kernels of a decode step
(norms, rope, router, launches) are latency-bound: the same kernel sequence takes about the same
number of cycles on an A100 and an H100, so its time scales with 1/clock, not with bandwidth.
"""

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


# (engine, device class) -> factors. Device classes: "hbm" and "gddr" GPUs (LPDDR GPUs count as
# gddr), "apple", "cpu". Fitted values; docs/planner-accuracy.md lists the data behind each.
DEFAULTS: dict[str, Efficiency] = {
    # llama.cpp CUDA: bandwidth and layer_cycles fitted per class by `python -m twinfer.planners.scoreboard`
    # on the training rows of llama.cpp's CUDA scoreboard (Llama-2-7B Q4_0, docs/data/llamacpp-cuda-scoreboard.json)
    # and the published gpt-oss / DGX Spark rows: consumer cards sit at ~60k cycles/layer, HBM parts at ~130k
    # (their batch-1 kernels wait on HBM latency); held-out scoreboard rows: median |error| 7.3%
    # (docs/planner-accuracy.md, "Current results").
    "llamacpp/gddr": Efficiency(bandwidth=0.85, tensor=0.3, layer_cycles=60e3, moe_layer_factor=1.4),
    "llamacpp/hbm": Efficiency(bandwidth=0.92, tensor=0.1, layer_cycles=130e3, moe_layer_factor=1.7),
    # llama.cpp Metal, Apple scoreboard (discussion #4167): M4 Pro vs M4 Max separates the
    # bandwidth term from the fixed per-layer term.
    "llamacpp/apple": Efficiency(bandwidth=0.90, tensor=0.65, layer_cycles=211e3, moe_layer_factor=1.0),
    "mlx/apple": Efficiency(bandwidth=0.90, tensor=0.65, layer_cycles=211e3, moe_layer_factor=1.0),
    # CPU: bandwidth relative to the *measured* read bandwidth (twinfer hw --measure); cycles are CPU
    # cycles per layer for thread synchronisation. Calibrate with `twinfer bench` on the machine.
    # bandwidth and tensor fitted by `python bench/bench_planner.py --fit bandwidth,tensor` on the
    # 2-core EPYC of docs/planner-accuracy.md ("This machine"), the rest set by hand.
    # tensor and overlap_loss refitted when the CPU's matmuls moved to its int8 dot-product peak and
    # llama.cpp's weight repacking became the default (docs/planner-accuracy.md, "Against this machine").
    # attention: prefill time per token at 512-4,096 against 64 tokens, one thread, CPU time of llama_decode
    # (docs/planner-accuracy.md, "Prefill attention"). torch keeps its old rate (its tensor factor), unmeasured.
    # tensor 0.72 -> 0.6: time to first token on two hosts (AVX-512 VNNI and AVX2), out of sample for
    # 0.72, was 5-28% under what `twinfer bench` measured (docs/planner-accuracy.md, "Two hosts").
    # bandwidth 0.7 -> 0.79: single-stream decode was predicted low in all 14 plan-vs-bench comparisons on
    # three hosts (7 runs, 64 and 4,096 tokens), median -11% (docs/planner-accuracy.md, "Decode, refitted").
    # bandwidth 0.79 -> 0.88 when decode attention moved to its own one-row f32 term (cost.decode_step): over
    # the 20 plan-vs-bench comparisons of ten runs on three hosts the median error is -1%, 3 outside +-20%
    # (docs/planner-accuracy.md, "Decode attention").
    # bandwidth 0.88 -> 0.82, tensor 0.6 -> 0.5 when unpacking GGUF blocks moved to the int8 rate
    # (cost._unpack_rate): refitted on the 32 comparisons of twelve runs; a second model, a random 0.85B
    # Llama in Q4_K_M, went from "dequantization-bound", decode -65%, to -14%..-39% at 64 tokens and
    # TTFT +4..+9% (docs/planner-accuracy.md, "A second model").
    # stream_plain / stream_repacked: the bytes a core's kernels stream per cycle in decode (cost._kernel_stream_s),
    # fitted on the 2-core AVX-512 EPYC, where DRAM read 20-43 GB/s and decode followed the kernels: Gemma 3
    # 270M's Q8_0/Q5_0 weights at about 3 bytes a cycle a core; the 1B Q4_K model's repacked weights at about
    # 8 or faster once its Q6_K runs at 3, so that bound does not bind there (docs/planner-accuracy.md, "Kernels, not DRAM")
    # huge_pages: the runner's weights on 2 MiB pages decoded Gemma 3 270M 14% faster in an in-process A/B
    # (medians 76.3 -> 87.0 tok/s), and the plan without it was 0-23% low in three runs' six comparisons;
    # 1.15 left them within -13..+11% (1.2: -10..+14%) (docs/planner-accuracy.md, "Huge pages")
    "llamacpp/cpu": Efficiency(bandwidth=0.82, tensor=0.5, vector=0.35, attention=0.49, overlap_loss=0.25,
                               layer_cycles=30e3, moe_layer_factor=1.5, step_s=0.4e-3, stream_plain=3.0,
                               stream_repacked=8.0, huge_pages=1.15),
    "torch/cpu": Efficiency(bandwidth=0.364, tensor=0.262, vector=0.2, attention=0.262, overlap_loss=0.5,
                            layer_cycles=400e3, moe_layer_factor=2.0, step_s=2e-3),
    # vLLM/SGLang-class serving (CUDA graphs, fused MoE): Llama-3.1-8B BF16 on A100 and H100 fit
    # bandwidth 0.86 and ~56k cycles/layer. twinfer's CUDA backend is planned against the same
    # factors until `twinfer bench` measures it.
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
