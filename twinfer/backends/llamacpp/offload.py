"""A plan's `Placement` applied to llama.cpp's model parameters, as llama-server applies its flags:
`n_gpu_layers` and `tensor_buft_overrides` (`-ot PATTERN=CPU`, declared here since llama-cpp-python does
not), with the CPU buffer type ggml's CPU device gives."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from twinfer.planners.llamacpp_build import ggml_function
from twinfer.planners.placement import Placement
from twinfer.runtime.errors import BackendUnavailable

_CPU_DEVICE = 0  # GGML_BACKEND_DEVICE_TYPE_CPU


class BuftOverride(ctypes.Structure):
    """struct llama_model_tensor_buft_override (llama.h)."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


@dataclass(frozen=True)
class AppliedPlacement:
    """What the model parameters were given, read back from them: `n_gpu_layers` None is llama.cpp's
    default (every layer where a GPU backend exists); `overrides` are (pattern, buffer type name)."""

    n_gpu_layers: int | None
    overrides: tuple[tuple[str, str], ...]
    keep: Any = None  # the override array and its strings: llama.cpp keeps the pointer, so they live with the model

    def to_json(self) -> dict[str, Any]:
        return {"n_gpu_layers": self.n_gpu_layers, "tensor_overrides": [f"{p}={b}" for p, b in self.overrides]}


def apply_placement(lib: ModuleType, params: Any, placement: Placement | None) -> AppliedPlacement:
    """Set `params` (llama_model_params) to `placement`; None leaves llama.cpp's defaults."""
    if placement is None:
        return AppliedPlacement(None, ())
    params.n_gpu_layers = placement.n_gpu_layers
    patterns = placement.overrides()
    if not patterns:
        return AppliedPlacement(int(params.n_gpu_layers), ())
    buft, name = cpu_buffer_type(lib)
    encoded = [p.encode() for p in patterns]
    array = (BuftOverride * (len(encoded) + 1))()  # zeroed: the last entry's NULL pattern ends the list
    for i, pattern in enumerate(encoded):
        array[i].pattern, array[i].buft = pattern, buft
    params.tensor_buft_overrides = ctypes.cast(array, ctypes.c_void_p)
    return AppliedPlacement(int(params.n_gpu_layers), read_overrides(params, name), (array, encoded))


def read_overrides(params: Any, buft_name: str) -> tuple[tuple[str, str], ...]:
    """The (pattern, buffer type) entries `params.tensor_buft_overrides` points at, up to its NULL end."""
    if not params.tensor_buft_overrides:
        return ()
    entries = ctypes.cast(params.tensor_buft_overrides, ctypes.POINTER(BuftOverride))
    out = []
    i = 0
    while entries[i].pattern is not None:
        out.append((entries[i].pattern.decode(), buft_name))
        i += 1
    return tuple(out)


def cpu_buffer_type(lib: ModuleType) -> tuple[int, str]:
    """(address, name) of the CPU device's buffer type: where `-ot ...=CPU` puts tensors."""
    by_type = ggml_function(lib, "ggml_backend_dev_by_type", ctypes.c_void_p, ctypes.c_int)
    dev_buft = ggml_function(lib, "ggml_backend_dev_buffer_type", ctypes.c_void_p, ctypes.c_void_p)
    buft_name = ggml_function(lib, "ggml_backend_buft_name", ctypes.c_char_p, ctypes.c_void_p)
    dev = by_type(_CPU_DEVICE) if by_type is not None else None
    buft = dev_buft(dev) if dev and dev_buft is not None else None
    if not buft:
        raise BackendUnavailable("llama.cpp has no CPU buffer type to keep expert tensors in host memory "
                                 "(ggml_backend_dev_by_type found no CPU device); upgrade llama-cpp-python")
    return int(buft), buft_name(buft).decode() if buft_name is not None else "CPU"
