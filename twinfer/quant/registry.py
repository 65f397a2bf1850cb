"""The weight formats twinfer can produce, their storage cost, and where they run natively.
`bits_per_weight` counts codes plus amortized scales, biases and norms at a served checkpoint's sizes.
"Native": tensor cores consume the format directly; everything else pays a dequantization loop."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

HARDWARE_FAMILIES = ("blackwell", "hopper", "ada", "ampere", "apple", "cpu")


@dataclass(frozen=True)
class FormatInfo:
    """One weight format: storage cost, block structure and hardware support."""

    name: str
    bits_per_weight: float
    block: int  # weights sharing one scale/norm (0: per tensor)
    native_families: tuple[str, ...]
    note: str

    def __post_init__(self) -> None:
        unknown = set(self.native_families) - set(HARDWARE_FAMILIES)
        if unknown:
            raise ValueError(f"format {self.name}: unknown hardware families {sorted(unknown)}")


def _tq_bits(rate: float, dim: int = 128) -> float:
    parts = 1 if rate == int(rate) else 2
    return rate + 16 * parts / dim


_DEQUANT = "no tensor-core support anywhere: dequantized inside the matmul"
_TQ = (
    "needs a rotation plus a codebook-lookup dequant loop everywhere; pays off only where bandwidth is scarce"
)
_INFO = (
    FormatInfo("int8", 8 + 32 / 64, 64, (), f"{_DEQUANT} (fused in mx.quantized_matmul on Apple)"),
    FormatInfo("int4", 4 + 32 / 64, 64, (), f"{_DEQUANT} (fused in mx.quantized_matmul on Apple)"),
    FormatInfo("fp8", 8.0, 0, ("hopper", "blackwell", "ada"), "E4M3 tensor cores from Ada (sm_89) on"),
    FormatInfo(
        "fp8-block",
        8 + 32 / (128 * 128),
        128 * 128,
        ("hopper", "blackwell", "ada"),
        "DeepSeek-style 128x128 scales",
    ),
    FormatInfo("nvfp4", 4 + 8 / 16, 16, ("blackwell",), "FP4 tensor cores with E4M3 block scales (sm_100+)"),
    FormatInfo(
        "mxfp4", 4 + 8 / 32, 32, ("blackwell",), "OCP MX FP4 with E8M0 scales (sm_100+); gpt-oss ships in it"
    ),
    *(FormatInfo(f"tq{r:g}", _tq_bits(r), 128, (), _TQ) for r in (2, 2.5, 3, 3.5, 4)),
)

FORMAT_INFO: MappingProxyType[str, FormatInfo] = MappingProxyType({f.name: f for f in _INFO})
FORMATS: MappingProxyType[str, float] = MappingProxyType({f.name: f.bits_per_weight for f in _INFO})


def native_on(hardware_family: str) -> tuple[str, ...]:
    """Formats the given hardware family runs natively (no dequantization loop)."""
    if hardware_family not in HARDWARE_FAMILIES:
        raise ValueError(f"unknown hardware family '{hardware_family}'; expected one of {HARDWARE_FAMILIES}")
    return tuple(f.name for f in _INFO if hardware_family in f.native_families)


def pack_weight(fmt: str, w: np.ndarray, seed: int = 0, **options: Any) -> Any:
    """Quantize ``w`` float32 ``[out, in]`` into format ``fmt``; the result has ``unpack()`` and ``nbytes``."""
    from twinfer.formats import fp8, mxfp4, nvfp4
    from twinfer.quant import affine
    from twinfer.quant.turboquant_weight import turboquant_weight

    packers: dict[str, Callable[..., Any]] = {
        "int8": lambda: affine.pack(w, bits=8, **options),
        "int4": lambda: affine.pack(w, bits=4, **options),
        "fp8": lambda: fp8.pack(w),
        "fp8-block": lambda: fp8.pack_block(w, **options),
        "nvfp4": lambda: nvfp4.pack(w, **options),
        "mxfp4": lambda: mxfp4.pack(w),
    }
    if fmt in packers:
        return packers[fmt]()
    if fmt in FORMAT_INFO and fmt.startswith("tq"):
        return turboquant_weight(w, float(fmt[2:]), seed=seed, **options)
    raise ValueError(f"unknown weight format '{fmt}'; choose one of {', '.join(FORMATS)}")
