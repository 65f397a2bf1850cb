"""A llama.cpp load that maps the GGUF unread (Linux), for a paged budget: llama.cpp maps with `MAP_POPULATE`,
reading the whole file first. `unpopulated()` points libllama's `mmap` GOT slot at a wrapper dropping that
flag for the load, then puts it back; without the slot (another platform, a static build) nothing changes."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path

from twinfer.backends.llamacpp.paging import file_mappings, read_maps

MAP_POPULATE = 0x8000
PROT_READ, PROT_WRITE = 1, 2
SHT_RELA, PT_LOAD = 4, 1
# relocation types that fill a function's GOT slot: x86-64 GLOB_DAT/JUMP_SLOT, AArch64 GLOB_DAT/JUMP_SLOT
SLOT_TYPES = {62: (6, 7), 183: (1025, 1026)}
_MMAP = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                         ctypes.c_int, ctypes.c_int64)


def got_slots(elf: bytes, symbol: str) -> list[int]:
    """Offsets from the load base of the GOT slots an ELF64 LE object fills with `symbol` ([] if none)."""
    if elf[:6] != b"\x7fELF\x02\x01":
        return []
    machine, = struct.unpack_from("<H", elf, 0x12)
    phoff, shoff = struct.unpack_from("<QQ", elf, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", elf, 0x36)
    first_load = min((struct.unpack_from("<IIQQ", elf, phoff + i * phentsize)[3] // mmap.PAGESIZE * mmap.PAGESIZE
                      for i in range(phnum)
                      if struct.unpack_from("<I", elf, phoff + i * phentsize)[0] == PT_LOAD), default=0)
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    out = []
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != SHT_RELA or not entsize or link >= len(sections):
            continue
        symtab = sections[link]
        strtab = sections[symtab[6]]
        for at in range(offset, offset + size, entsize):
            r_offset, r_info, _ = struct.unpack_from("<QQq", elf, at)
            if r_info & 0xFFFFFFFF not in SLOT_TYPES.get(machine, ()):
                continue
            name_at, = struct.unpack_from("<I", elf, symtab[4] + (r_info >> 32) * symtab[9])
            start = strtab[4] + name_at
            if elf[start : elf.index(b"\0", start)].decode() == symbol:
                out.append(r_offset - first_load)
    return out


def _writable(address: int, maps: str) -> bool | None:
    """Whether the mapping holding `address` in a /proc/PID/maps text is writable (None: not mapped)."""
    for line in maps.splitlines():
        span, perms = line.split(maxsplit=2)[:2]
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= address < hi:
            return "w" in perms
    return None


@contextlib.contextmanager
def unpopulated(library: str | os.PathLike[str]) -> Iterator[int]:
    """Within the block, `library`'s calls to mmap never populate; yields how many slots were pointed at
    the wrapper (0: nothing changed)."""
    path, maps = os.path.realpath(library), read_maps()
    base = min((start for start, _, offset in file_mappings(Path(path), maps) if offset == 0), default=None)
    try:
        offsets = got_slots(Path(path).read_bytes(), "mmap") if base is not None else []
    except (OSError, ValueError, struct.error):
        offsets = []
    if not offsets or base is None:
        yield 0
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    real = _MMAP(ctypes.cast(libc.mmap, ctypes.c_void_p).value or 0)

    def lazy(addr: int | None, length: int, prot: int, flags: int, fd: int, offset: int) -> int | None:
        return real(addr, length, prot, flags & ~MAP_POPULATE, fd, offset)

    wrapper = _MMAP(lazy)  # referenced until the slots are put back
    saved: list[tuple[int, int, bool]] = []
    try:
        for off in offsets:
            slot = ctypes.c_void_p.from_address(base + off)
            writable = _writable(base + off, maps)
            if writable is None:
                continue
            page = (base + off) // mmap.PAGESIZE * mmap.PAGESIZE
            if not writable and libc.mprotect(page, mmap.PAGESIZE, PROT_READ | PROT_WRITE) != 0:
                continue
            saved.append((base + off, slot.value or 0, writable))
            slot.value = ctypes.cast(wrapper, ctypes.c_void_p).value
        yield len(saved)
    finally:
        for address, value, writable in saved:
            ctypes.c_void_p.from_address(address).value = value
            if not writable:
                libc.mprotect(address // mmap.PAGESIZE * mmap.PAGESIZE, mmap.PAGESIZE, PROT_READ)
