"""Loading llama-cpp-python's ctypes bindings, once per process, and bridging its API generations.
llama.cpp renamed its KV-cache calls twice (`llama_kv_cache_*` -> `llama_kv_self_*` -> `llama_memory_*`
on a handle from `llama_get_memory`); `MemoryOps` hides which one the installed version has."""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from twinfer.backends.llamacpp.amx import guard_amx
from twinfer.runtime.errors import BackendUnavailable


@functools.cache
def load_llama_cpp() -> ModuleType:
    """Import the low-level bindings and initialise llama.cpp's backends (the one process-wide call)."""
    try:
        from llama_cpp import llama_cpp as lib
    except (ImportError, OSError, RuntimeError) as exc:  # not installed, or its shared library won't load
        raise BackendUnavailable(
            f"llama.cpp backend unavailable: cannot import llama_cpp ({exc}); "
            "install it with `pip install llama-cpp-python`"
        ) from exc
    guard_amx()  # before llama.cpp places any weight: its AMX kernels crash in some builds
    lib.llama_backend_init()
    return lib


_VOIDP = ctypes.c_void_p


def address_function(lib: ModuleType, name: str) -> Callable[[Any], int | None]:
    """`lib.<name>(ctx)` for a function returning a pointer, giving the address as an int (None for
    NULL). A prototype of its own over the same symbol, so llama-cpp-python's function object keeps its
    restype; without that library handle, the pointer it returns is cast."""
    dll = getattr(lib, "_lib", None)
    if dll is not None:
        with contextlib.suppress(AttributeError, TypeError):
            return ctypes.CFUNCTYPE(_VOIDP, _VOIDP)((name, dll))  # type: ignore[no-any-return]
    typed = getattr(lib, name)
    return lambda ctx: ctypes.cast(typed(ctx), _VOIDP).value


def library_path(lib: ModuleType) -> str | None:
    """The file of the libllama llama-cpp-python loaded (None where its loader does not say)."""
    name = getattr(getattr(lib, "_lib", None), "_name", None)
    return name if isinstance(name, str) and name else None


def _sibling(lib: ModuleType, stem: str) -> ctypes.CDLL | None:
    """The ggml library `stem` ("ggml", "ggml-base") next to the libllama llama-cpp-python loaded: the same
    file, so the same loaded instance (and backend registry) as libllama's own."""
    name = library_path(lib)
    if not name:
        return None
    folder = Path(name).parent
    for candidate in (f"lib{stem}.so", f"lib{stem}.dylib", f"{stem}.dll"):
        if (folder / candidate).exists():
            try:
                return ctypes.CDLL(str(folder / candidate))
            except OSError:
                return None
    return None


def attach_threadpool(lib: ModuleType, ctx: Any, n_threads: int) -> Callable[[], None] | None:
    """Give the context a persistent ggml CPU thread pool, as `llama-server` and `llama-bench` do;
    returns what frees it, to call after `llama_free` (None where this llama.cpp lacks the calls). A
    build without OpenMP otherwise starts and joins its threads every `llama_decode` (docs/benchmarks.md,
    "A persistent ggml thread pool"); the params buffer is oversized so its layout is never read here."""
    api = _threadpool_api(lib)
    if api is None:
        return None
    params_init, new, free, attach = api
    params = ctypes.create_string_buffer(16384)  # struct ggml_threadpool_params is about 530 bytes today
    params_init(params, n_threads)
    pool = new(params)
    if not pool:
        return None
    attach(ctx, pool, None)
    return lambda: free(pool)


@functools.cache
def _threadpool_api(lib: ModuleType) -> tuple[Any, Any, Any, Any] | None:
    """(ggml_threadpool_params_init, ggml_threadpool_new, ggml_threadpool_free, llama_attach_threadpool), looked
    up once per process: the pool functions through ggml's backend registry, as llama-bench finds them."""
    dll, ggml, base = getattr(lib, "_lib", None), _sibling(lib, "ggml"), _sibling(lib, "ggml-base")
    if dll is None or ggml is None or base is None:
        return None
    try:
        reg_by_name = ctypes.CFUNCTYPE(_VOIDP, ctypes.c_char_p)(("ggml_backend_reg_by_name", ggml))
        proc = ctypes.CFUNCTYPE(_VOIDP, _VOIDP, ctypes.c_char_p)(("ggml_backend_reg_get_proc_address", ggml))
        params_init = ctypes.CFUNCTYPE(None, _VOIDP, ctypes.c_int)(("ggml_threadpool_params_init", base))
        attach = ctypes.CFUNCTYPE(None, _VOIDP, _VOIDP, _VOIDP)(("llama_attach_threadpool", dll))
    except AttributeError:  # a llama.cpp without these symbols
        return None
    reg = reg_by_name(b"CPU")
    new_addr = proc(reg, b"ggml_threadpool_new") if reg else None
    free_addr = proc(reg, b"ggml_threadpool_free") if reg else None
    if not new_addr or not free_addr:
        return None
    return params_init, ctypes.CFUNCTYPE(_VOIDP, _VOIDP)(new_addr), ctypes.CFUNCTYPE(None, _VOIDP)(free_addr), attach


@functools.cache
def _noop_log_callback(lib: ModuleType) -> Any:
    # Cached so the ctypes thunk outlives every runner: llama.cpp keeps calling the raw pointer.
    return lib.llama_log_callback(lambda level, text, user_data: None)


def set_quiet(lib: ModuleType, quiet: bool) -> None:
    """Silence llama.cpp's (and ggml's) logging, or send it to stderr again.
    llama.cpp's logger is process-wide, so the most recently created runner decides."""
    if quiet:
        lib.llama_log_set(_noop_log_callback(lib), ctypes.c_void_p(0))
    else:
        lib.llama_log_set(lib.llama_log_callback(), ctypes.c_void_p(0))  # NULL: llama.cpp's stderr logger


def versions(lib: ModuleType) -> dict[str, str]:
    import llama_cpp

    out = {"llama_cpp_python": str(getattr(llama_cpp, "__version__", "unknown"))}
    version_fn = getattr(lib, "llama_version", None)
    if version_fn is not None:
        out["llama_cpp"] = (version_fn() or b"").decode("utf-8", "replace")
    return out


@dataclass(frozen=True)
class MemoryOps:
    """The KV-cache calls of one context, whatever the installed llama.cpp calls them; `seq_rm` returns
    False when a partial removal is impossible, `seq_pos_max` is -1 for an empty sequence."""

    api: str  # "llama_memory", "llama_kv_self" or "llama_kv_cache"
    seq_rm: Callable[[int, int, int], bool]
    seq_cp: Callable[[int, int, int, int], None]
    seq_pos_max: Callable[[int], int]
    clear: Callable[[], None]

    @staticmethod
    def for_context(lib: ModuleType, ctx: Any) -> MemoryOps:
        if hasattr(lib, "llama_get_memory") and hasattr(lib, "llama_memory_seq_rm"):
            mem = lib.llama_get_memory(ctx)
            return MemoryOps(
                api="llama_memory",
                seq_rm=lambda s, p0, p1: bool(lib.llama_memory_seq_rm(mem, s, p0, p1)),
                seq_cp=lambda src, dst, p0, p1: lib.llama_memory_seq_cp(mem, src, dst, p0, p1),
                seq_pos_max=lambda s: int(lib.llama_memory_seq_pos_max(mem, s)),
                clear=lambda: lib.llama_memory_clear(mem, True),
            )
        for prefix in ("llama_kv_self", "llama_kv_cache"):
            if hasattr(lib, f"{prefix}_seq_rm"):
                return MemoryOps._on_context(lib, ctx, prefix)
        raise BackendUnavailable(
            "llama.cpp backend unavailable: this llama-cpp-python has no KV-cache sequence API "
            "(llama_memory_seq_rm / llama_kv_self_seq_rm / llama_kv_cache_seq_rm); upgrade it"
        )

    @staticmethod
    def _on_context(lib: ModuleType, ctx: Any, prefix: str) -> MemoryOps:
        """Older llama.cpp: the same calls, named `{prefix}_*` and taking the context itself."""
        rm, cp = getattr(lib, f"{prefix}_seq_rm"), getattr(lib, f"{prefix}_seq_cp")
        pos_max, clear = getattr(lib, f"{prefix}_seq_pos_max"), getattr(lib, f"{prefix}_clear")
        return MemoryOps(
            api=prefix,
            seq_rm=lambda s, p0, p1: bool(rm(ctx, s, p0, p1)),
            seq_cp=lambda src, dst, p0, p1: cp(ctx, src, dst, p0, p1),
            seq_pos_max=lambda s: int(pos_max(ctx, s)),
            clear=lambda: clear(ctx),
        )
