"""Intel AMX in llama.cpp's CPU backend: find out once whether its tile kernels run, and keep them out
when they do not.

`amx_verdict` decodes a tiny generated model in a child process once per library and CPU (cached);
where it crashes, `deny_amx` makes the AMX permission request fail through a seccomp filter, so ggml
uses its AVX-512 layout. `TWINFER_LLAMACPP_AMX=on|off` skips the check (docs/architecture.md, "The
runner contract")."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from twinfer.runtime.cache_dir import cache_dir
from twinfer.runtime.cpu import cpu_model, cpuinfo

ENV = "TWINFER_LLAMACPP_AMX"  # auto (default) | on | off
_ARCH_REQ_XCOMP_PERM = 0x1023  # arch_prctl: ask for an extended state component (AMX tile data is 18)
_SYS_ARCH_PRCTL = 158  # x86_64
_SYS_SECCOMP = 317
_AUDIT_ARCH_X86_64 = 0xC000003E
_PR_SET_NO_NEW_PRIVS = 38
_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_TSYNC = 1
_EPERM = 1
_DECODED = "twinfer-amx-probe: decoded"  # what the probe child prints once its batch has run


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def filter_program() -> list[tuple[int, int, int, int]]:
    """The classic-BPF seccomp program: arch_prctl(ARCH_REQ_XCOMP_PERM, ...) gets EPERM, all else runs.
    Instructions are (code, jump if true, jump if false, k); seccomp_data is nr at 0, arch at 4, args at 16.
    """
    ld_w_abs, jeq_k, ret_k = 0x20, 0x15, 0x06
    allow, deny = 0x7FFF0000, 0x00050000 | _EPERM  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM
    return [
        (ld_w_abs, 0, 0, 4),  # the syscall's architecture
        (jeq_k, 0, 5, _AUDIT_ARCH_X86_64),
        (ld_w_abs, 0, 0, 0),  # its number
        (jeq_k, 0, 3, _SYS_ARCH_PRCTL),
        (ld_w_abs, 0, 0, 16),  # its first argument (low 32 bits)
        (jeq_k, 0, 1, _ARCH_REQ_XCOMP_PERM),
        (ret_k, 0, 0, deny),
        (ret_k, 0, 0, allow),
    ]


def supported_os() -> bool:
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


def cpu_has_amx() -> bool:
    """The CPU advertises AMX int8 tiles (Linux /proc/cpuinfo)."""
    return supported_os() and "amx_int8" in cpuinfo().get("flags", "").split()


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def deny_amx() -> bool:
    """Make AMX tile-state requests fail in every thread of this process and its children, for good; True
    once in place. Must run before llama.cpp's first model load."""
    if not supported_os():
        return False
    libc = _libc()
    program = filter_program()
    filters = (_SockFilter * len(program))(*[_SockFilter(*ins) for ins in program])
    prog = _SockFprog(len(program), filters)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:  # needed without CAP_SYS_ADMIN
        return False
    rc = libc.syscall(ctypes.c_long(_SYS_SECCOMP), ctypes.c_long(_SECCOMP_SET_MODE_FILTER),
                      ctypes.c_long(_SECCOMP_FILTER_FLAG_TSYNC), ctypes.byref(prog))
    return rc == 0


def amx_request_allowed() -> bool:
    """Whether asking for AMX tile data succeeds in this process now (False under `deny_amx`)."""
    if not supported_os():
        return False
    return _libc().syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(_ARCH_REQ_XCOMP_PERM), ctypes.c_long(18)) == 0


def _library_key() -> str | None:
    """Identifies the installed llama.cpp CPU backend build: path, size and modification time."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    for folder in map(Path, (spec.submodule_search_locations or []) if spec else []):
        for lib in sorted((folder / "lib").glob("libggml-cpu*.so*")) or sorted(folder.glob("**/libllama*.so*")):
            st = lib.stat()
            return f"{lib.resolve()}:{st.st_size}:{int(st.st_mtime)}"
    return None


def _verdict_file() -> Path:
    return cache_dir("hardware") / "llamacpp-amx.json"


def probe_child(timeout_s: float = 180.0, command: list[str] | None = None) -> str:
    """Run one AMX-sized batch in a child, its last argument a folder this process removes: "ok", "crash", "unknown"."""
    if command is None and not amx_request_allowed():
        return "unknown"  # this process (and so the child) runs under a filter: nothing can be learned
    env = {**os.environ, ENV: "on"}  # the child runs the kernels as they are
    command = command or [sys.executable, "-m", "twinfer.backends.llamacpp.amx", "--probe"]
    with tempfile.TemporaryDirectory(prefix="twinfer-amx-") as folder:
        try:
            done = subprocess.run([*command, folder], env=env, capture_output=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            return "unknown"
    if done.returncode == 0 or _DECODED in done.stdout.decode(errors="replace"):
        return "ok"  # the batch ran (what happens after it, at interpreter exit, is not the kernels)
    return "crash" if done.returncode < 0 else "unknown"  # killed by a signal: SIGILL / SIGSEGV


def amx_verdict(probe: Callable[[], str] = probe_child) -> str:
    """"on" (AMX kernels run, or there are none), "off" (they crash here: deny them), from cache or a probe."""
    choice = _choice()
    if choice in ("on", "off"):
        return choice
    if not cpu_has_amx():
        return "on"
    key = f"{_library_key()}|{cpu_model()}"
    path = _verdict_file()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if key in cached:
        return "off" if cached[key] == "crash" else "on"
    result = probe()
    if result in ("ok", "crash"):
        cached[key] = result
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(cached, indent=1))
        except OSError:
            pass
    return "off" if result == "crash" else "on"




def _choice() -> str:
    return os.environ.get(ENV, "auto").strip().lower()


@functools.cache
def guard_amx() -> str:
    """Decide once per process, before llama.cpp loads anything: "none" (no AMX on this CPU), "on" (its
    kernels run), "denied" (they crash; this process's AMX requests now fail, so ggml leaves them out)
    or "repack-off" (they crash and the filter could not be installed: run without extra buffer types)."""
    has_amx = cpu_has_amx()
    if not has_amx and _choice() != "off":
        return "none"
    if has_amx and not amx_request_allowed():  # a filter came with the process (a parent's)
        return "denied"
    if amx_verdict() == "on":
        return "on"
    return "denied" if deny_amx() else "repack-off"


@contextlib.contextmanager
def quiet_amx_notice(quiet: bool) -> Iterator[None]:
    """Hold back ggml's "AMX is not ready to be used!", which it prints to stderr (not through llama.cpp's
    logger) at the first model load after `deny_amx`: AMX was left out on purpose. Once per process."""
    global _notice_held
    if not quiet or _notice_held:
        yield
        return
    _notice_held = True
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


_notice_held = False  # quiet_amx_notice has run once in this process


def _exec_denied(argv: list[str]) -> None:
    """`python -m twinfer.backends.llamacpp.amx --deny -- CMD ...`: run CMD with AMX requests failing
    (how `bench/` runs llama.cpp's own tools where their AMX kernels crash)."""
    if not deny_amx():
        raise SystemExit("could not install the seccomp filter that keeps AMX out")
    os.execvp(argv[0], argv)


def _probe_main(folder: Path) -> int:
    """In the child: the probe model, written into `folder`, with extra buffer types, one 32-token batch."""
    from llama_cpp import llama_cpp as lib

    from twinfer.backends.llamacpp._lib import set_quiet
    from twinfer.runtime.models.llama import write_probe_gguf

    lib.llama_backend_init()
    set_quiet(lib, True)
    path = folder / "probe.gguf"
    write_probe_gguf(path)
    params = lib.llama_model_default_params()
    if hasattr(params, "use_extra_bufts"):
        params.use_extra_bufts = True
    model = lib.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        return 2
    cparams = lib.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = 256, 64, 64
    ctx = lib.llama_init_from_model(model, cparams)
    if not ctx:
        return 2
    tokens = (ctypes.c_int32 * 32)(*range(3, 35))  # held here: the batch only points at it
    if lib.llama_decode(ctx, lib.llama_batch_get_one(tokens, 32)) != 0:
        return 2
    print(_DECODED, flush=True)
    return 0


if __name__ == "__main__":
    own = sys.argv[1:sys.argv.index("--")] if "--" in sys.argv else sys.argv[1:]  # after "--": the command's
    if len(own) == 2 and own[0] == "--probe" and Path(own[1]).is_dir():
        sys.exit(_probe_main(Path(own[1])))
    elif own == ["--deny"] and "--" in sys.argv and sys.argv[-1] != "--":
        _exec_denied(sys.argv[sys.argv.index("--") + 1:])
    elif own == ["--verdict"]:
        print(amx_verdict())
    else:
        sys.exit("usage: python -m twinfer.backends.llamacpp.amx --verdict | --probe FOLDER | --deny -- CMD [ARGS]")
