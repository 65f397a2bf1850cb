"""Weights mapped from the GGUF with routed experts paged under a bound: a memory budget's lossless way
to run an MoE bigger than the budget on llama.cpp (Linux).

`ExpertPager` keeps dense tensors resident (locked where allowed), drops expert pages after the load and
again whenever the process's file pages grew past `bound` (`MADV_DONTNEED`; the page cache keeps them):
the process holds the dense weights plus at most `bound` of experts plus one step's touch. `fetch` reads
the experts a layer's router chose before its matmuls fault them in: one readahead per expert slice, all in
flight together (`MADV_WILLNEED`), instead of one page-fault read-around at a time."""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

MADV_DONTNEED, MADV_WILLNEED = 4, 3
PRESENT = 1 << 63  # /proc/self/pagemap: the page is mapped in this process
Range = tuple[int, int]


def is_expert(name: str) -> bool:
    """GGUF names of routed-expert tensors (`blk.N.ffn_{gate,up,down,gate_up}_exps.weight`); shared
    experts (`_shexp`) and the router (`ffn_gate_inp`) are dense: every token reads them."""
    return "_exps." in name


def file_mappings(path: Path, maps: str) -> list[tuple[int, int, int]]:
    """(start, end, file offset) of every mapping of `path` in a /proc/PID/maps text."""
    target = os.path.realpath(path)
    out = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].strip() == target:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out.append((start, end, int(fields[2], 16)))
    return out


def read_maps() -> str:
    """This process's /proc/self/maps ("" off Linux): what `ExpertPager.attach` compares against."""
    try:
        with open("/proc/self/maps") as f:
            return f.read()
    except OSError:
        return ""


def rss_file() -> int:
    """Bytes of file pages mapped into this process (RssFile), 0 where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssFile:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return 0


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    for fn in (libc.madvise, libc.mlock):
        fn.restype = ctypes.c_int
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _pages(ranges: list[Range]) -> list[Range]:
    """Ranges cut to whole pages (a page shared with a neighbour of the other kind is left alone)."""
    size = mmap.PAGESIZE
    out = []
    for start, end in ranges:
        lo, hi = -(-start // size) * size, end // size * size
        if hi > lo:
            out.append((lo, hi))
    return out


@dataclass
class PagerStats:
    dense_bytes: int = 0
    expert_bytes: int = 0
    locked_bytes: int = 0  # dense bytes mlock accepted (0 where RLIMIT_MEMLOCK is small)
    trims: int = 0
    peak_file: int = 0  # most file bytes mapped at a router or a step's end, before a trim (since `reset_peak`)
    hits: int = 0  # experts a step needed whose pages were all mapped (`need`)
    misses: int = 0
    fetches: int = 0  # experts `fetch` asked the kernel to read ahead


class ExpertPager:
    """One mapped model's expert pages kept under `bound` bytes. Build it with `attach` right after
    llama.cpp loaded the model; call `after_step` after every llama_decode."""

    def __init__(self, dense: list[Range], experts: list[Range], bound: int, stats: PagerStats,
                 slices: dict[int, list[tuple[int, int]]] | None = None):
        self._dense, self._experts, self.bound, self.stats = dense, experts, bound, stats
        self._slices = slices or {}  # layer -> (address, bytes of one expert) of each expert tensor
        self._lock_dense()
        self._floor = self.trim()

    @classmethod
    def attach(cls, path: Path, before_maps: str, bound: int) -> ExpertPager | None:
        """The pager for llama.cpp's mapping of `path` (the mappings of it that `before_maps` lacks);
        None where the file was not mapped (llama.cpp read it into buffers instead)."""
        from twinfer.runtime.loaders.gguf_reader import GGUFContents

        old = set(file_mappings(path, before_maps))
        vmas = [m for m in file_mappings(path, read_maps()) if m not in old]
        if not vmas:
            return None
        dense: list[Range] = []
        experts: list[Range] = []
        slices: dict[int, list[tuple[int, int]]] = {}
        stats = PagerStats()
        for info in GGUFContents(path).tensors.values():
            addr = _address(vmas, info.offset, info.nbytes)
            if addr is None:
                continue  # a part of the file llama.cpp unmapped (unused)
            (experts if is_expert(info.name) else dense).append((addr, addr + info.nbytes))
            if is_expert(info.name):
                stats.expert_bytes += info.nbytes
                layer = re.match(r"blk\.(\d+)\.", info.name)
                if layer:  # ggml's last dimension counts the experts
                    slices.setdefault(int(layer[1]), []).append((addr, info.nbytes // info.ne[-1]))
            else:
                stats.dense_bytes += info.nbytes
        return cls(_pages(dense), _pages(experts), bound, stats, slices)

    def _lock_dense(self) -> None:
        libc = _libc()
        for start, end in self._dense:
            if libc.mlock(start, end - start) == 0:
                self.stats.locked_bytes += end - start
            else:  # over RLIMIT_MEMLOCK: kept resident by use instead
                libc.madvise(start, end - start, MADV_WILLNEED)

    def trim(self) -> int:
        """Drop every expert page from the process; returns RssFile afterwards."""
        libc = _libc()
        for start, end in self._experts:
            libc.madvise(start, end - start, MADV_DONTNEED)
        self.stats.trims += 1
        return rss_file()

    def describe(self) -> dict[str, int]:
        """Sizes in MiB, trims, expert hits and misses and read-aheads, for the runner's `describe()`."""
        mib = 2**20
        s = self.stats
        return {"bound_mb": round(self.bound / mib), "dense_mb": round(s.dense_bytes / mib),
                "experts_mb": round(s.expert_bytes / mib), "locked_mb": round(s.locked_bytes / mib), "trims": s.trims,
                "peak_file_mb": round(s.peak_file / mib), "hits": s.hits, "misses": s.misses, "fetches": s.fetches}

    def need(self, layer: int, experts: Iterable[int]) -> None:
        """Count the experts a step is about to read in `layer` as hits (every page mapped) or misses."""
        size = mmap.PAGESIZE
        with open("/proc/self/pagemap", "rb") as f:
            for e in experts:
                mapped = True
                for addr, nbytes in self._slices.get(layer, []):
                    lo, hi = (addr + e * nbytes) // size, (addr + (e + 1) * nbytes - 1) // size
                    f.seek(lo * 8)
                    words = memoryview(f.read((hi - lo + 1) * 8)).cast("Q")
                    mapped = mapped and all(w & PRESENT for w in words)
                if mapped:
                    self.stats.hits += 1
                else:
                    self.stats.misses += 1

    def make_room(self, layer: int, experts: int) -> None:
        """Trim now if `experts` more experts of `layer` would take the mapped experts past the bound: a
        prompt routes to every expert, so a step is bounded layer by layer, not only at its end."""
        incoming = experts * sum(nbytes for _, nbytes in self._slices.get(layer, []))
        now = rss_file()
        self.stats.peak_file = max(self.stats.peak_file, now)
        if now - self._floor + incoming > self.bound:
            self._floor = self.trim()

    def fetch(self, layer: int, experts: Iterable[int]) -> None:
        """Start reading `experts`' pages of `layer` from the file, every slice at once; pages already
        cached cost nothing. The matmuls that follow wait only for reads still in flight."""
        libc, size = _libc(), mmap.PAGESIZE
        chosen = list(experts)
        for addr, nbytes in self._slices.get(layer, []):
            for e in chosen:
                lo = (addr + e * nbytes) // size * size
                libc.madvise(lo, addr + (e + 1) * nbytes - lo, MADV_WILLNEED)
        self.stats.fetches += len(chosen)

    def reset_peak(self) -> None:
        """Start `stats.peak_file` again (a prompt maps every expert; decode steps map their top-k)."""
        self.stats.peak_file = 0

    def after_step(self) -> None:
        """Trim when the experts mapped since the last trim pass the bound."""
        now = rss_file()
        self.stats.peak_file = max(self.stats.peak_file, now)
        if now - self._floor > self.bound:
            self._floor = self.trim()


def _address(vmas: list[tuple[int, int, int]], offset: int, nbytes: int) -> int | None:
    """The address of file bytes [offset, offset + nbytes) in the mapping, or None where unmapped."""
    for start, end, file_offset in vmas:
        addr = start + offset - file_offset
        if start <= addr and addr + nbytes <= end:
            return addr
    return None
