"""Which llama-cpp-python build is installed: its ggml backends and the GPU devices they found.
Part of the probe; $TWINFER_LLAMACPP_BUILD (`CPU` or `CPU,CUDA`) pins one for tests and other machines."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from twinfer.planners.placement import LlamaBuild, parse_build

BUILD_ENV = "TWINFER_LLAMACPP_BUILD"
_DEVICE_TYPES = {1: "GPU", 2: "IGPU"}  # enum ggml_backend_dev_type: 0 CPU, 1 GPU, 2 IGPU, 3 ACCEL
_P = ctypes.c_void_p


def read_build() -> LlamaBuild | None:
    """The installed build ($TWINFER_LLAMACPP_BUILD when set); None without llama-cpp-python, and for a
    pinned host ($TWINFER_HOST_FACTS) without a pinned build: this machine's build says nothing of it."""
    from twinfer.planners.probe import HOST_ENV

    pinned = os.environ.get(BUILD_ENV)
    if pinned:
        return parse_build(pinned)
    return None if os.environ.get(HOST_ENV) else _installed()


@functools.cache
def _installed() -> LlamaBuild | None:
    try:
        from llama_cpp import llama_cpp as lib
    except (ImportError, OSError, RuntimeError):
        return None
    offload = bool(lib.llama_supports_gpu_offload())  # first: loads a dynamic-backend build's backends
    version = str(getattr(__import__("llama_cpp"), "__version__", "unknown"))
    fn = _ggml_functions(lib)
    if fn is None:
        return LlamaBuild(version, (), offload)
    regs = tuple(fn["reg_name"](fn["reg_get"](i)).decode() for i in range(fn["reg_count"]()))
    devices = []
    for i in range(fn["dev_count"]()):
        dev = fn["dev_get"](i)
        if fn["dev_type"](dev) in _DEVICE_TYPES:
            devices.append(f"{fn['dev_name'](dev).decode()}: {fn['dev_description'](dev).decode()}")
    return LlamaBuild(version, regs, offload, tuple(devices))


def _ggml_functions(lib: Any) -> dict[str, Callable[..., Any]] | None:
    protos = {
        "reg_count": ("ggml_backend_reg_count", ctypes.c_size_t, ()),
        "reg_get": ("ggml_backend_reg_get", _P, (ctypes.c_size_t,)),
        "reg_name": ("ggml_backend_reg_name", ctypes.c_char_p, (_P,)),
        "dev_count": ("ggml_backend_dev_count", ctypes.c_size_t, ()),
        "dev_get": ("ggml_backend_dev_get", _P, (ctypes.c_size_t,)),
        "dev_type": ("ggml_backend_dev_type", ctypes.c_int, (_P,)),
        "dev_name": ("ggml_backend_dev_name", ctypes.c_char_p, (_P,)),
        "dev_description": ("ggml_backend_dev_description", ctypes.c_char_p, (_P,)),
    }
    out = {key: ggml_function(lib, name, restype, *args) for key, (name, restype, args) in protos.items()}
    return None if any(f is None for f in out.values()) else {k: f for k, f in out.items() if f is not None}


def ggml_function(lib: Any, name: str, restype: Any, *argtypes: Any) -> Callable[..., Any] | None:
    """ggml's C function `name` with this prototype (None where the library lacks it), looked up through
    libllama, whose dependencies hold it, or, where the loader does not search those (Windows), in the
    ggml libraries beside it."""
    for dll in (getattr(lib, "_lib", None), *_siblings(lib)):
        if dll is None:
            continue
        try:
            return ctypes.CFUNCTYPE(restype, *argtypes)((name, dll))  # type: ignore[no-any-return]
        except AttributeError:
            continue
    return None


@functools.cache
def _siblings(lib: Any) -> tuple[ctypes.CDLL, ...]:
    name = getattr(getattr(lib, "_lib", None), "_name", None)
    if not name:
        return ()
    out = []
    for stem in ("ggml", "ggml-base"):
        for candidate in (f"lib{stem}.so", f"lib{stem}.dylib", f"{stem}.dll"):
            path = Path(name).parent / candidate
            if path.exists():
                with contextlib.suppress(OSError):
                    out.append(ctypes.CDLL(str(path)))
    return tuple(out)
