"""Comments state the rule, docs state the current truth (STYLE.md, rules 9 and 19), read from twinfer/.

Only `#` comments and docstrings are scanned: string literals that are data (hardware tables, error
messages) are code, not commentary.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "twinfer"
MAX_SHARE = 0.10  # comment and docstring lines over non-empty source lines
MAX_DOCSTRING = 10  # lines of one docstring; design narrative belongs in docs/architecture.md
# Run history belongs in docs/benchmarks.md and docs/data/, never in a comment: the benchmark hosts by
# name, a core count used as a host's name, and measured speeds.
HOST = re.compile(r"\b(EPYC|Sapphire|SPR|Xeon)\b|\b2-core\b|\b\d+-core (VM|host)\b|\bthis host\b|\bZen \d\b")
SPEED = re.compile(r"tok/s|\bGB/s measured|\bms here\b|\bx faster\b|\d(\.\d+)?\s*GFLOP/s")
# "here" as a place of measurement: "1.2 GB here", "here, took 0.3 s"
MEASURED_HERE = re.compile(r"\d(\.\d+)?\s*(ms|s|MB|GB|GiB|%)\s+here\b|\bhere,?\s+(took|ran|read|measured)\b")
# Published specs with their sources are data; their docstrings may name the parts they list.
TABLE_FILES = {
    "twinfer/planners/hw_table.py": "published GPU/CPU specs, each row with its source",
    "twinfer/planners/hw_table_gpus.py": "published GPU specs, each row with its source",
}


@dataclass(frozen=True)
class Commentary:
    """One file's `#` comments and docstrings: the lines they fill and their text with line numbers."""

    nonempty: int
    lines: frozenset[int]
    texts: tuple[tuple[int, str], ...]
    long_docstrings: tuple[tuple[int, int], ...]  # (first line, non-empty lines)


def _docstrings(tree: ast.Module) -> list[ast.Expr]:
    """Every bare string statement in a body: docstrings and attribute docs."""
    found = []
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            found += [s for s in body if isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                      and isinstance(s.value.value, str)]
    return found


def commentary(path: Path) -> Commentary:
    src = path.read_text()
    source_lines = src.splitlines()
    filled: set[int] = set()
    texts: list[tuple[int, str]] = []
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            line = tok.start[0]
            texts.append((line, tok.string))
            if source_lines[line - 1].lstrip().startswith("#"):
                filled.add(line)
    long_docs = []
    for doc in _docstrings(ast.parse(src, str(path))):
        end = doc.end_lineno or doc.lineno
        span = [n for n in range(doc.lineno, end + 1) if source_lines[n - 1].strip()]
        filled.update(span)
        if len(span) > MAX_DOCSTRING:
            long_docs.append((doc.lineno, len(span)))
        value = doc.value.value  # type: ignore[attr-defined]
        texts += [(doc.lineno + i, text) for i, text in enumerate(value.splitlines())]
    nonempty = sum(1 for text in source_lines if text.strip())
    return Commentary(nonempty, frozenset(filled), tuple(texts), tuple(long_docs))


def _all() -> dict[str, Commentary]:
    return {p.relative_to(ROOT.parent).as_posix(): commentary(p) for p in sorted(ROOT.rglob("*.py"))}


def flagged(text: str) -> bool:
    return any(rx.search(text) for rx in (HOST, SPEED, MEASURED_HERE))


def test_the_rules_catch_what_they_should() -> None:
    bad = ["# 2-core EPYC: 75.5 tok/s", "# serve's streams (1.2 GB here, took 0.3-1.1 s)",
           "a Sapphire Rapids VM ran it at half rate", "# 3x faster on this host", "read 107 GFLOP/s",
           "# 14.8 GB/s measured"]
    good = ["# every longer period is a multiple of p here, and needs no fewer tokens",
            "Limits are checked here, once.", "# see docs/benchmarks.md, Weights on huge pages",
            "Start ranks 1..N-1 on this machine; decode is bound by 3.35 TB/s of HBM",
            "`Apple M2 Max 38-core` -> `m2-max-38c`"]
    assert [t for t in bad if not flagged(t)] == []
    assert [t for t in good if flagged(t)] == []


def test_comments_are_a_small_share_of_the_source() -> None:
    files = _all()
    filled = sum(len(c.lines) for c in files.values())
    nonempty = sum(c.nonempty for c in files.values())
    assert filled / nonempty <= MAX_SHARE, f"{filled} of {nonempty} lines are comments or docstrings"


def test_no_host_names_or_measured_speeds_in_comments() -> None:
    found = [f"{name}:{line}: {text.strip()}" for name, c in _all().items() if name not in TABLE_FILES
             for line, text in c.texts if flagged(text)]
    assert found == []


def test_docstrings_state_a_contract_in_at_most_ten_lines() -> None:
    found = [f"{name}:{line} ({n} lines)" for name, c in _all().items() for line, n in c.long_docstrings]
    assert found == []
