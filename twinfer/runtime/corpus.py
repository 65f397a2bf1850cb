"""The two test corpora every machine has: Python stdlib code and pydoc prose.
Both are deterministic for a given Python version, so KL and bench numbers are comparable across
runs on one machine."""

from __future__ import annotations

import sysconfig
from pathlib import Path

from twinfer.runtime.errors import TwinferError

CORPORA = ("prose", "code")


def prose_text(max_chars: int = 2_000_000) -> str:
    """The language-reference topics of `pydoc_data.topics`, in sorted topic order."""
    from pydoc_data.topics import topics

    parts: list[str] = []
    size = 0
    for name in sorted(topics):
        parts.append(topics[name])
        size += len(topics[name])
        if size >= max_chars:
            break
    return "\n\n".join(parts)[:max_chars]


def code_text(max_chars: int = 2_000_000) -> str:
    """The standard library's top-level `.py` files, in sorted name order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    size = 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= max_chars:
            break
    return "\n\n".join(parts)[:max_chars]


def corpus_text(name: str, max_chars: int = 2_000_000) -> str:
    """`prose`, `code`, or the path of a UTF-8 text file."""
    if name == "prose":
        return prose_text(max_chars)
    if name == "code":
        return code_text(max_chars)
    path = Path(name).expanduser()
    if not path.is_file():
        raise TwinferError(f"corpus {name!r} is neither 'prose', 'code' nor a readable text file")
    return path.read_text(encoding="utf-8", errors="replace")[:max_chars]


def corpus_prompts(name: str, count: int, chars: int) -> list[str]:
    """`count` distinct prompts of about `chars` characters each, cut from the corpus."""
    text = corpus_text(name, max_chars=max(count * chars * 4, 200_000))
    step = max(len(text) // max(count, 1), chars)
    return [text[i * step : i * step + chars] for i in range(count)]
