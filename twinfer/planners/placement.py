"""Where llama.cpp puts a local plan's weights, and whether the installed llama.cpp build can put them there.
A `Placement` is the plan in llama.cpp's terms (`n_gpu_layers`, `--n-cpu-moe N`), applied by the runner
as it loads; a build without the device's backend refuses (`build_refusal`) (docs/architecture.md, "The
runner contract")."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from twinfer.planners.hardware import APPLE, CPU, GPU, Device

if TYPE_CHECKING:
    from twinfer.planners.cost import Strategy
    from twinfer.planners.model import ModelProfile

# llama.cpp's n_gpu_layers for every layer and the output: any count above the layers does it, in every
# llama.cpp (a negative count means "all" only in newer ones)
ALL_LAYERS = 999
# the routed-expert tensors of a block, as llama.cpp matches them (LLM_FFN_EXPS_REGEX, common/common.h)
EXPERT_TENSORS = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
# ggml backends that run a discrete GPU, by the vendor the hardware table names (CUDA's HIP build registers as ROCm)
GPU_BACKENDS = {"nvidia": ("CUDA", "Vulkan"), "amd": ("ROCm", "HIP", "Vulkan"),
                "": ("CUDA", "ROCm", "HIP", "Vulkan", "SYCL", "MUSA", "OpenCL", "CANN")}
APPLE_BACKENDS = ("Metal",)
GPU_BUILD_HINT = ('CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir --no-binary '
                  'llama-cpp-python llama-cpp-python; -DGGML_VULKAN=on for Vulkan; on macOS Metal is the default')


@dataclass(frozen=True)
class Placement:
    """Where a llama.cpp plan puts the model, with its KV type; `cpu_moe_layers` = N keeps the experts of
    blocks [0, N) in host memory (`--n-cpu-moe N`; `num_layers` is `--cpu-moe`)."""

    device: str  # GPU, APPLE or CPU: where the plan's numbers assume the layers run
    n_gpu_layers: int  # llama.cpp's count: 0 (CPU) or ALL_LAYERS
    num_layers: int
    cpu_moe_layers: int = 0
    kv_type: str = "f16"

    def __post_init__(self) -> None:
        if self.device not in (GPU, APPLE, CPU):
            raise ValueError(f"placement: device must be {GPU}, {APPLE} or {CPU}, not {self.device!r}")
        if self.n_gpu_layers < 0 or not 0 <= self.cpu_moe_layers <= self.num_layers:
            raise ValueError(f"placement: need n_gpu_layers >= 0 and 0 <= cpu_moe_layers <= {self.num_layers} "
                             f"(got {self.n_gpu_layers} and {self.cpu_moe_layers})")
        if self.device == CPU and (self.n_gpu_layers or self.cpu_moe_layers):
            raise ValueError("placement: a CPU placement puts no layer on a device and keeps no expert apart")

    @property
    def offloads(self) -> bool:
        """Whether any layer goes to a device (what a CPU-only llama.cpp build cannot do)."""
        return self.n_gpu_layers > 0

    def overrides(self) -> tuple[str, ...]:
        """Tensor-name patterns (llama.cpp's std::regex_search) whose tensors go to the CPU buffer."""
        n = self.cpu_moe_layers
        if not n:
            return ()
        if n >= self.num_layers:
            return (EXPERT_TENSORS,)
        return (rf"blk\.({'|'.join(str(i) for i in range(n))}){EXPERT_TENSORS}",)

    def args(self) -> str:
        """The same placement as llama-server / llama-cli flags."""
        parts = [f"--n-gpu-layers {self.n_gpu_layers}"]
        if self.cpu_moe_layers >= self.num_layers:
            parts.append("--cpu-moe")
        elif self.cpu_moe_layers:
            parts.append(f"--n-cpu-moe {self.cpu_moe_layers}")
        if self.kv_type != "f16":
            parts.append(f"--cache-type-k {self.kv_type} --cache-type-v {self.kv_type}")
        return " ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "n_gpu_layers": self.n_gpu_layers, "cpu_moe_layers": self.cpu_moe_layers,
                "tensor_overrides": [f"{p}=CPU" for p in self.overrides()], "kv_type": self.kv_type,
                "args": self.args()}


def placement_for(profile: ModelProfile, s: Strategy, device: Device) -> Placement | None:
    """The placement of strategy `s` on `device` (None: not a llama.cpp plan); a streamed share f keeps
    the experts of ceil(f x MoE layers) blocks after the dense ones in host memory."""
    if s.engine != "llamacpp":
        return None
    spec, kv = profile.spec, s.kv.name
    if device.kind == CPU:
        return Placement(CPU, 0, spec.num_layers, kv_type=kv)
    n = 0
    if s.stream_fraction and spec.moe is not None and profile.moe_layers:
        kept = min(profile.moe_layers, math.ceil(s.stream_fraction * profile.moe_layers - 1e-9))
        n = spec.num_layers if kept == profile.moe_layers else spec.moe.first_dense_layers + kept
    return Placement(device.kind, ALL_LAYERS, spec.num_layers, n, kv)


@dataclass(frozen=True)
class LlamaBuild:
    """What the installed llama-cpp-python was built with, as llama.cpp's ggml registry lists it."""

    version: str
    backends: tuple[str, ...]  # registered ggml backends: "CPU", "CUDA", "Metal", "Vulkan", "BLAS", ...
    gpu_offload: bool  # llama_supports_gpu_offload(): a GPU backend found a device here
    devices: tuple[str, ...] = ()  # the GPU devices it found, "CUDA0: NVIDIA GeForce RTX 4070"

    def backend_for(self, device: Device) -> str | None:
        """The backend of this build that runs `device` (None: it cannot; every build runs a CPU)."""
        if device.kind == CPU:
            return "CPU"
        names = APPLE_BACKENDS if device.kind == APPLE else GPU_BACKENDS.get(device.vendor, GPU_BACKENDS[""])
        return next((b for b in self.backends if b in names), None)

    def kind(self) -> str:
        """"a CPU-only build" or "a build with the CPU, Vulkan backends": what a refusal calls it."""
        gpu = [b for b in self.backends if b not in ("CPU", "BLAS", "RPC")]
        return f"a build with the {', '.join(self.backends)} backends" if gpu else "a CPU-only build"

    def describe(self) -> str:
        gpu = "offloads to a GPU" if self.gpu_offload else "no GPU offload"
        found = f"; devices {', '.join(self.devices)}" if self.devices else ""
        return f"llama-cpp-python {self.version}: ggml backends {', '.join(self.backends) or 'none'} ({gpu}{found})"

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "backends": list(self.backends), "gpu_offload": self.gpu_offload,
                "devices": list(self.devices)}


def parse_build(text: str) -> LlamaBuild:
    """A build named by its backends, `CPU` or `CPU,CUDA` (a pinned build: tests, or planning for another
    machine); it offloads where it names a GPU backend."""
    backends = tuple(b.strip() for b in text.split(",") if b.strip())
    gpu = any(b in names for names in (*GPU_BACKENDS.values(), APPLE_BACKENDS) for b in backends)
    return LlamaBuild("pinned", backends, gpu)


def build_refusal(build: LlamaBuild | None, placement: Placement | None, device: Device) -> str:
    """Why `build` cannot run `placement` on `device` ("" when it can, or when either is unknown)."""
    if build is None or placement is None or not placement.offloads or build.backend_for(device):
        return ""
    where = "Apple silicon's GPU (Metal)" if device.kind == APPLE else f"the {device.label}"
    return (f"the installed llama-cpp-python is {build.kind()} and cannot offload to {where}: it would run "
            f"this plan on the CPU, and the numbers above assume a GPU build. To get one: {GPU_BUILD_HINT}")
