"""The tokenizer's view of a GGUF header, read with the loaders' parser (loaders/gguf_reader.py).
`gguf.GGUFReader` builds numpy records for each of Gemma 3's 262,144 vocabulary strings (over ten
seconds); the loaders' parser leaves large arrays unread until asked, so this takes a fraction of one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from twinfer.runtime.loaders.gguf_reader import GGUFContents

GGUF_MAGIC = b"GGUF"


def is_gguf(path: str | Path) -> bool:
    """True when `path` is a file that starts with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def read_gguf_metadata(path: str | Path, keys_prefix: tuple[str, ...] = ()) -> dict[str, Any]:
    """The header key/values of the GGUF file at `path`, large arrays included (numpy or lists of str);
    `keys_prefix` filters by key prefix."""
    contents = GGUFContents(Path(path))
    keys = [*contents.metadata, *contents.array_lengths]
    wanted = [k for k in keys if not keys_prefix or k.startswith(keys_prefix)]
    return {k: contents.metadata[k] if k in contents.metadata else contents.array(k) for k in wanted}
