"""Parsing and printing of the sizes a planner user types: `2.8T`, `60B`, `64GB`, `12GiB`, `32k`."""

from __future__ import annotations

import re

from twinfer.runtime.errors import PlanError

_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12, "p": 1e15}
_BIN = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_count(text: str | int | float, what: str = "count") -> float:
    """`2.8T` -> 2.8e12, `60B` -> 6e10, `32k` -> 32000. Plain numbers pass through."""
    if isinstance(text, (int, float)):
        return float(text)
    m = _NUMBER.match(text)
    if not m or m.group(2).lower() not in _SCALE:
        raise PlanError(f"cannot read {what} {text!r}: use a number with an optional k/M/B/T suffix (e.g. 60B)")
    return float(m.group(1)) * _SCALE[m.group(2).lower()]


def parse_bytes(text: str | int | float) -> int:
    """`64GB` -> 64e9, `12GiB` -> 12*2**30, `1.5e11` -> 1.5e11 bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    m = _NUMBER.match(text)
    if not m:
        raise PlanError(f"cannot read byte size {text!r}: use e.g. 64GB, 12GiB or a plain number of bytes")
    value, unit = float(m.group(1)), m.group(2).lower()
    unit = unit[:-1] if unit.endswith("b") and unit != "b" else unit
    if unit in ("", "b"):
        return int(value)
    if unit in _BIN:
        return int(value * _BIN[unit])
    if unit in _SCALE:
        return int(value * _SCALE[unit])
    raise PlanError(f"cannot read byte size {text!r}: unknown unit {m.group(2)!r} (use B, KB, MB, GB, TB, GiB)")


def fmt_bytes(n: float) -> str:
    """Decimal units, as GPU and Mac spec sheets print them: 1.58 TB, 42.5 GB, 131 kB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}" if n / scale < 100 else f"{n / scale:.0f} {unit}"
    return f"{n:.0f} B"


def fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def fmt_rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s:.3g}" if tokens_per_s < 100 else f"{tokens_per_s:.0f}"


def fmt_seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    return f"{s:.3g} s"
