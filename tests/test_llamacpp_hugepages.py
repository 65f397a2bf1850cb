"""Weights on huge pages: the pure parts of hugepages.py, on texts, so every machine gives one verdict."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import pytest

from twinfer.backends.llamacpp import hugepages as hp
from twinfer.backends.llamacpp.hugepages import mem_available
from twinfer.runtime.cpu import HUGE_PAGE_MODES, thp_mode

MIB = 1 << 20

MAPS = """\
55d0c0000000-55d0c8000000 rw-p 00000000 00:00 0                          [heap]
7f0000000000-7f0010000000 r--s 00000000 08:01 1234                       /models/m.gguf
7f0010000000-7f0030000000 rw-p 00000000 00:00 0
7f0030000000-7f0030100000 r-xp 00000000 08:01 99                         /usr/lib/libllama.so
7f0030100000-7f0030200000 rw-p 00100000 08:01 99                         /usr/lib/libllama.so
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
"""


def test_the_kernel_mode_is_the_bracketed_word(tmp_path: Path):
    f = tmp_path / "enabled"
    alone = tmp_path / "no-status"  # not this process's status: the verdict must not depend on the host
    f.write_text("always [madvise] never\n")
    assert thp_mode(f, alone) == "madvise"
    f.write_text("[always] madvise never\n")
    assert thp_mode(f, alone) == "always"
    assert thp_mode(tmp_path / "missing") is None  # no THP (macOS, or a kernel without it)
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nTHP_enabled:\t0\n")
    assert thp_mode(f, status) == "never"  # this process's THP turned off (PR_SET_THP_DISABLE)
    status.write_text("Name:\tpython\nTHP_enabled:\t1\n")
    assert thp_mode(f, status) == "always"
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       24576000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n")
    assert mem_available(info) == 20000000 * 1024 and mem_available(tmp_path / "none") is None


def test_huge_pages_only_where_the_kernel_gives_them_and_the_model_leaves_half_the_memory():
    gib = 1 << 30
    assert hp.wanted(gib, "madvise", 4 * gib) and hp.wanted(gib, "always", 2 * gib)
    assert not hp.wanted(gib, "never", 64 * gib)
    assert not hp.wanted(3 * gib, "madvise", 4 * gib)  # a big model stays mapped: droppable, shared
    assert not hp.wanted(gib, None, 64 * gib) and not hp.wanted(gib, "madvise", None)


def test_anonymous_ranges_are_private_writable_and_unnamed_or_the_heap():
    assert hp.anonymous_ranges(MAPS) == [(0x55D0C0000000, 0x55D0C8000000), (0x7F0010000000, 0x7F0030000000)]


def test_new_ranges_are_what_the_load_added():
    before = [(0, 10 * MIB), (20 * MIB, 30 * MIB)]
    after = [(0, 14 * MIB), (18 * MIB, 40 * MIB), (50 * MIB, 60 * MIB)]  # grown, merged, new
    assert hp.new_ranges(after, before) == [(10 * MIB, 14 * MIB), (18 * MIB, 20 * MIB), (30 * MIB, 40 * MIB),
                                            (50 * MIB, 60 * MIB)]
    assert hp.new_ranges(before, before) == []


def test_only_whole_aligned_chunks_are_advised():
    assert hp.whole_chunks([(MIB, 7 * MIB), (8 * MIB, 9 * MIB)], 2 * MIB) == [(2 * MIB, 6 * MIB)]


@pytest.mark.skipif(not hp.supported(), reason="mincore and MADV_COLLAPSE on Linux's /proc only")
def test_only_chunks_wholly_in_memory_are_folded():
    """Two chunks written whole and one with a single page: the third is not resident as a whole, so folding
    leaves it on small pages (collapsing it would fill it); the two are folded where the kernel gives
    huge pages, and nothing is where it gives none."""
    size = 4 * hp.HUGE
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        view = ctypes.c_char.from_buffer(m)
        start = ctypes.addressof(view)
        lo = -(-start // hp.HUGE) * hp.HUGE  # the first whole chunk
        offset = lo - start
        m[offset : offset + 2 * hp.HUGE] = b"\1" * (2 * hp.HUGE)
        m[offset + 2 * hp.HUGE] = 1
        assert hp.resident_chunks(lo, lo + 3 * hp.HUGE) == [lo, lo + hp.HUGE]
        assert hp.fold([(lo, lo + 3 * hp.HUGE)], limit=hp.HUGE) == 0  # two whole chunks: over a one-chunk limit
        folded = hp.fold([(lo, lo + 3 * hp.HUGE)], limit=2 * hp.HUGE)
        assert folded in (0, 2 * hp.HUGE)
        if thp_mode() in HUGE_PAGE_MODES:
            assert folded == 2 * hp.HUGE
        assert hp.resident_chunks(lo, lo + 3 * hp.HUGE) == [lo, lo + hp.HUGE]  # the third was not filled
        del view
    finally:
        m.close()
