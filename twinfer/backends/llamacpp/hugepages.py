"""Weights on 2 MiB pages: llama.cpp's model buffers backed by transparent huge pages (Linux).
llama.cpp reads the weights into its buffers (load mode "none"); the ranges mapped since the load began
are marked `MADV_HUGEPAGE` at its first progress callback, before any byte is read, and chunks touched
earlier (and the KV cache) are folded with `MADV_COLLAPSE` when wholly in memory. `wanted` keeps a model
over half the available memory mapped (docs/architecture.md, "The runner contract"; figures:
docs/benchmarks.md, "Weights on huge pages")."""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import sys
from collections.abc import Iterable

import numpy as np

from twinfer.runtime.cpu import HUGE_PAGE_MODES, huge_pages_fit


def _pmd_bytes(path: str = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") -> int:
    """A huge page's size: 2 MiB on x86-64 and on arm64 with 4 KiB pages (larger with 16 or 64 KiB)."""
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


HUGE = _pmd_bytes()
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25

Range = tuple[int, int]


def wanted(model_bytes: int, mode: str | None, available: int | None) -> bool:
    """Whether to load weights onto huge pages: the kernel gives them (`thp_mode` "always" or "madvise")
    and the model fits the rule (`huge_pages_fit`: at most half the available memory)."""
    return mode in HUGE_PAGE_MODES and huge_pages_fit(model_bytes, available)


def mem_available(path: str | os.PathLike[str] = "/proc/meminfo") -> int | None:
    """Bytes the kernel can give without swapping (MemAvailable, None where unsaid), capped by this
    process's cgroup headroom: what `wanted` weighs a model against (past a container limit, OOM)."""
    available = None
    try:
        for line in _read(path).splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        available = None
    headroom = cgroup_headroom()
    if available is None or headroom is None:
        return available if headroom is None else headroom
    return min(available, headroom)


_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1


def cgroup_headroom(root: str = "/sys/fs/cgroup", own: str = "/proc/self/cgroup") -> int | None:
    """The least of (limit - anonymous memory charged) over this process's cgroups (v1 or v2), None where
    no limit applies or none can be read."""
    try:
        lines = _read(own).splitlines()
    except OSError:
        return None
    best: int | None = None
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0":  # v2: the root itself, or its `unified` mount on a hybrid host
            unified = os.path.join(root, "unified")
            base, files = (unified if os.path.isdir(unified) else root), ("memory.max", "anon")
        elif "memory" in controllers.split(","):
            base, files = os.path.join(root, "memory"), ("memory.limit_in_bytes", "total_rss")
        else:
            continue
        parts = [p for p in path.strip("/").split("/") if p]
        for depth in range(len(parts), -1, -1):
            room = _group_headroom(os.path.join(base, *parts[:depth]), *files)
            if room is not None:
                best = room if best is None else min(best, room)
    return best


def _group_headroom(folder: str, limit_file: str, anon_key: str) -> int | None:
    try:
        limit_text = _read(os.path.join(folder, limit_file)).strip()
        if limit_text == "max" or int(limit_text) >= _UNLIMITED:
            return None
        stat = dict(line.split() for line in _read(os.path.join(folder, "memory.stat")).splitlines())
        return max(0, int(limit_text) - int(stat.get(anon_key, 0)))
    except (OSError, ValueError):
        return None


def _read(path: str | os.PathLike[str]) -> str:
    with open(path) as f:
        return f.read()


def anonymous_ranges(maps: str) -> list[Range]:
    """The private, writable, anonymous mappings (the heap included) of a /proc/PID/maps text."""
    out = []
    for line in maps.splitlines():
        fields = line.split()
        if len(fields) < 5 or fields[1] != "rw-p" or (len(fields) > 5 and fields[5] != "[heap]"):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        out.append((start, end))
    return sorted(out)


def new_ranges(after: Iterable[Range], before: Iterable[Range]) -> list[Range]:
    """The parts of `after` that no range of `before` covers (both sorted)."""
    out, old = [], sorted(before)
    for start, end in after:
        cursor = start
        for b0, b1 in old:
            if b1 <= cursor or b0 >= end:
                continue
            if b0 > cursor:
                out.append((cursor, b0))
            cursor = max(cursor, b1)
        if cursor < end:
            out.append((cursor, end))
    return out


def whole_chunks(ranges: Iterable[Range], size: int = HUGE) -> list[Range]:
    """Each range cut down to the huge-page-aligned chunks inside it; ranges holding none are dropped."""
    out = []
    for start, end in ranges:
        lo, hi = -(-start // size) * size, end // size * size
        if hi > lo:
            out.append((lo, hi))
    return out


def maps() -> str:
    with open("/proc/self/maps") as f:
        return f.read()


def snapshot() -> list[Range]:
    """This process's anonymous mappings now, to compare a later `mapped_since` against."""
    return anonymous_ranges(maps())


def mapped_since(before: list[Range]) -> list[Range]:
    """The whole huge-page chunks of anonymous memory mapped since `before` (a `snapshot`)."""
    return whole_chunks(new_ranges(snapshot(), before))


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.mincore.restype = ctypes.c_int
    return libc


def resident_chunks(start: int, end: int) -> list[int]:
    """The chunks of [start, end) (huge-page aligned) whose every page is in memory (mincore)."""
    pages = (end - start) // mmap.PAGESIZE
    vec = np.zeros(pages, np.uint8)
    if _libc().mincore(start, end - start, vec.ctypes.data) != 0:
        return []
    full = (vec & 1).reshape(-1, HUGE // mmap.PAGESIZE).all(axis=1)
    return [start + i * HUGE for i in np.flatnonzero(full).tolist()]


def fold(ranges: list[Range], limit: float | None = None) -> int:
    """Collapse every fully resident chunk of `ranges` into a huge page (MADV_COLLAPSE) and return the bytes
    now on huge pages; nothing above `limit` bytes (it copies), never a chunk with an untouched page."""
    chunks = [chunk for start, end in ranges for chunk in resident_chunks(start, end)]
    if limit is not None and len(chunks) * HUGE > limit:
        return 0
    return HUGE * sum(_collapse(chunk) for chunk in chunks)


def _collapse(chunk: int, tries: int = 3) -> bool:
    """MADV_COLLAPSE one chunk; EAGAIN (no huge page free this moment) is the kernel's "retry"."""
    for _ in range(tries):
        if _libc().madvise(chunk, HUGE, MADV_COLLAPSE) == 0:
            return True
        if ctypes.get_errno() != errno.EAGAIN:
            return False
    return False


class HugePageLoad:
    """One model load onto huge pages: `progress` as the load's progress_callback (kept alive until it
    returns), `finish` after; where the kernel refuses the advice the weights stay on small pages."""

    def __init__(self) -> None:
        self._before = snapshot()
        self.advised: list[Range] | None = None  # None until llama.cpp's first progress callback

    def progress(self, _progress: float, _user: object) -> bool:
        """llama.cpp's progress callback: at its first call the buffers exist, still empty; advise them."""
        if self.advised is None:
            self.advised = []
            try:
                self.advised = mapped_since(self._before)
                for start, end in self.advised:
                    _libc().madvise(start, end - start, MADV_HUGEPAGE)
            except Exception:  # noqa: BLE001 - advice only: a failure here must not fail the load
                self.advised = []
        return True  # go on loading

    def finish(self) -> int:
        """Fold chunks touched before the advice, and return the load's bytes on huge pages (0: none)."""
        return fold(whole_chunks(_intersect(self.advised or [], snapshot())))


def _intersect(a: list[Range], b: list[Range]) -> list[Range]:
    out = []
    for a0, a1 in a:
        for b0, b1 in b:
            lo, hi = max(a0, b0), min(a1, b1)
            if hi > lo:
                out.append((lo, hi))
    return out


def supported() -> bool:
    """Linux with /proc: the only place this module does anything."""
    return sys.platform.startswith("linux") and os.path.exists("/proc/self/maps")
