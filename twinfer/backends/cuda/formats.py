"""Native formats only on the datacenter target: what each GPU generation multiplies directly
(Blackwell NVFP4/MXFP4, Hopper and Ada FP8, else BF16); `check_format` refuses the rest with the reason.
`Fp8Linear` runs `torch._scaled_mm` on a capable GPU and the same arithmetic in float32 elsewhere."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from twinfer.runtime.errors import BackendUnavailable

E4M3_MAX = 448.0
FP4 = ("nvfp4", "mxfp4")
_FAMILY_HINT = {
    "gguf": "GGUF k-quants are expanded by a dequantization loop; run the GGUF file with --backend llamacpp, "
            "or serve the original weights",
    "int": "integer weight-only formats are expanded by a dequantization loop",
    "turboquant": "TurboQuant codebooks are expanded by a rotation and a lookup",
}  # fmt: skip


class FormatRefused(BackendUnavailable):
    """A weight format the datacenter target does not run, because its GEMM would dequantize."""


def generation(capability: tuple[int, int]) -> str:
    """The GPU generation name for a CUDA compute capability."""
    if capability >= (10, 0):
        return "Blackwell"
    if capability >= (9, 0):
        return "Hopper"
    if capability >= (8, 9):
        return "Ada"
    if capability >= (8, 0):
        return "Ampere"
    return "pre-Ampere"


def native_formats(capability: tuple[int, int]) -> tuple[str, ...]:
    """Weight formats whose GEMMs run on this GPU's tensor cores without a dequantization loop."""
    if capability >= (10, 0):
        return ("nvfp4", "mxfp4", "fp8", "bf16")
    if capability >= (8, 9):
        return ("fp8", "bf16")
    if capability >= (8, 0):
        return ("bf16",)
    return ("f16",)


def check_format(fmt: str, capability: tuple[int, int]) -> str:
    """Return `fmt` when this GPU multiplies it natively; raise FormatRefused saying why and what to use."""
    from twinfer.planners.formats import FORMATS

    name = fmt.lower()
    native = native_formats(capability)
    if name in native or name == "f32":
        return name
    gen = f"{generation(capability)} (sm_{capability[0]}{capability[1]})"
    use = ", ".join(native)
    if name not in FORMATS:
        raise FormatRefused(f"unknown weight format {fmt!r}; on {gen} twinfer serves {use}")
    f = FORMATS[name]
    if f.family in _FAMILY_HINT:
        why = _FAMILY_HINT[f.family]
    elif name in FP4 or name == "fp8":
        why = f"{generation(capability)} has no {f.compute.upper()} tensor cores, so its GEMM would dequantize"
    else:
        why = f"{name} computes in {f.compute}, which this GPU's tensor cores do not take"
    raise FormatRefused(f"{name} is not a native format on {gen}: {why}. The datacenter target serves only "
                        f"native formats here ({use}); quantize to {native[0]} or serve {native[-1]}")


def fp8_supported(device: torch.device) -> bool:
    """Whether `torch._scaled_mm` runs FP8 on this device (CUDA, compute capability 8.9 or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes of x [N, K] with one float32 scale per row [N, 1]: x ~= codes * scale."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / E4M3_MAX
    codes = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scale


@dataclass
class Fp8Linear:
    """An FP8 weight [out, in] with one scale per output channel (rowwise `_scaled_mm` layout)."""

    codes: torch.Tensor  # float8_e4m3fn [out, in]
    scale: torch.Tensor  # float32 [out, 1]

    @classmethod
    def from_weight(cls, w: torch.Tensor) -> Fp8Linear:
        codes, scale = quantize_rows(w)
        return cls(codes, scale)

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scale

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in] -> [T, out] in x's dtype: a decode step's few rows go to the FP8-weight kernel on a
        capable GPU (activations in 16 bits), more rows to `torch._scaled_mm` with per-row quantization."""
        native = fp8_supported(x.device)
        small = _small_rows_kernel() if native and x.dim() == 2 else None
        if small is not None and small.takes(x.shape[0]):
            y = small.fp8_weight_gemm(x, self.codes, self.scale)
            return y if bias is None else y + bias
        xq, xs = quantize_rows(x)
        if native and x.shape[1] % 16 == 0 and self.codes.shape[0] % 16 == 0:
            y = torch._scaled_mm(xq, self.codes.t(), scale_a=xs, scale_b=self.scale.t(), out_dtype=torch.bfloat16)
        else:
            y = fp8_linear_reference(xq, xs, self.codes, self.scale)
        y = y.to(x.dtype)
        return y if bias is None else y + bias


@functools.cache
def _small_rows_kernel() -> Any:
    """The triton FP8-weight kernel's module for decode rows, or None where the triton kernels are off
    (TWINFER_KERNELS, read once)."""
    from twinfer.backends.cuda.kernels import select_kernels

    if select_kernels(None, "cuda") != "triton":
        return None
    from twinfer.backends.cuda.kernels import fp8_gemm

    return fp8_gemm


def fp8_linear_reference(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """What `_scaled_mm` computes with rowwise scales, in float32: (xq * xs) @ (wq * ws).T."""
    return (xq.float() @ wq.float().t()) * xs * ws.t()


LINEAR_WEIGHTS = ("q", "k", "v", "o", "gate", "up", "down", "lm_head")


def convert_weight(name: str, w: Any, fmt: str) -> Any:
    """A dense projection in `fmt` ("bf16"/"f32": as is; "fp8": an Fp8Linear); other weights as is."""
    if fmt == "fp8" and isinstance(w, torch.Tensor) and w.dim() == 2 and name.split(".")[-1] in LINEAR_WEIGHTS:
        return Fp8Linear.from_weight(w)
    return w


def native_weight_format(weight_format: str | None, device: torch.device) -> str:
    """The torch runner's weight format: None keeps the runner's dtype; on a GPU, only native formats."""
    if weight_format is None:
        return "as-dtype"
    if device.type == "cuda":
        return check_format(weight_format, torch.cuda.get_device_capability(device))
    if weight_format not in ("fp8", "bf16", "f32"):
        raise FormatRefused(f"the torch backend converts weights to bf16, f32 or fp8 itself, not {weight_format!r}; "
                            "quantized checkpoints load through their own format")
    return weight_format
