"""Triton kernels for the torch backend on NVIDIA GPUs, each next to its plain-torch reference (`reference.py`).
`select_kernels`: "auto" (triton on CUDA where it imports, else torch), "triton" (on CPU only under
TRITON_INTERPRET=1, set before importing these modules), "torch"; TWINFER_KERNELS overrides "auto"."""

from __future__ import annotations

import functools
import importlib.util
import os
from types import SimpleNamespace
from typing import Any

from twinfer.runtime.errors import BackendUnavailable

KERNEL_CHOICES = ("auto", "triton", "torch")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def select_kernels(choice: str | None, device_type: str) -> str:
    """"triton" or "torch" for a device type ("cuda", "cpu", ...); raises BackendUnavailable when triton
    is forced where it cannot run."""
    choice = choice or os.environ.get("TWINFER_KERNELS") or "auto"
    if choice not in KERNEL_CHOICES:
        raise BackendUnavailable(f"kernels={choice!r} is not one of {', '.join(KERNEL_CHOICES)} "
                                 "(check TWINFER_KERNELS)")
    if choice == "torch":
        return "torch"
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    usable = triton_available() and (device_type == "cuda" or interpreted and device_type == "cpu")
    if choice == "auto":
        return "triton" if usable and device_type == "cuda" else "torch"
    if not triton_available():
        raise BackendUnavailable("kernels='triton' needs the triton package: pip install triton")
    if not usable:
        raise BackendUnavailable(f"the triton kernels run on CUDA devices, not {device_type!r} "
                                 "(on CPU set TRITON_INTERPRET=1 to interpret them, for tests)")
    return "triton"


@functools.cache
def sm_count(device: Any) -> int:
    """Streaming multiprocessors of a CUDA device, read once; 4 elsewhere (the interpreter on CPU), so the
    kernels' launch shapes (programs per SM) are computed the same way in tests."""
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def load_kernels() -> Any:
    """The kernel entry points, imported on first use (triton compiles nothing until a launch)."""
    from twinfer.backends.cuda.kernels.fused_moe import fused_moe
    from twinfer.backends.cuda.kernels.paged_attention import paged_decode_attention
    from twinfer.backends.cuda.kernels.rmsnorm import rms_norm, rms_norm_residual
    from twinfer.backends.cuda.kernels.rope import rope, rope_applies

    return SimpleNamespace(fused_moe=fused_moe, paged_decode_attention=paged_decode_attention, rms_norm=rms_norm,
                           rms_norm_residual=rms_norm_residual, rope=rope, rope_applies=rope_applies)
