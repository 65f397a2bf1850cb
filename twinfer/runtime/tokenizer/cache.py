"""On-disk cache of tokenizers converted from GGUF files, keyed by the file's path, size, mtime and
`CONVERTER_VERSION`; writes are atomic, so concurrent processes are safe."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from twinfer.runtime.cache_dir import cache_dir
from twinfer.runtime.errors import ModelError
from twinfer.runtime.tokenizer import convert
from twinfer.runtime.tokenizer.gguf_meta import read_gguf_metadata

# Bump when convert.py changes what it builds.
CONVERTER_VERSION = 1


def default_cache_dir() -> Path:
    """`cache_dir("tokenizers")`: ~/.cache/twinfer/tokenizers on Linux, or under $TWINFER_CACHE."""
    return cache_dir("tokenizers")


def cache_key(path: Path) -> str:
    st = path.stat()
    ident = f"v{CONVERTER_VERSION}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def load_gguf_tokenizer(
    path: str | Path, cache_dir: str | Path | None = None
) -> tuple[HFTokenizer, convert.VocabInfo]:
    """The converted tokenizer and vocabulary info for a GGUF file, from the cache when possible."""
    p = Path(path)
    if not p.is_file():
        raise ModelError(f"GGUF file not found: {p}")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = cache_key(p)
    tok_file, info_file = root / f"{key}.tokenizer.json", root / f"{key}.info.json"
    cached = _read_cached(tok_file, info_file)
    if cached is not None:
        return cached
    if _convert_in_child(p, root):  # the conversion's ~200 MB of scratch lives and dies in a child
        cached = _read_cached(tok_file, info_file)
        if cached is not None:
            return cached
    return convert_and_cache(p, root)


def _convert_in_child(path: Path, root: Path) -> bool:
    """Convert in a child interpreter, so this process's peak memory (what `--memory-budget` bounds) never
    holds the conversion's Python objects; False when the child could not run (then convert here)."""
    code = "import sys; from pathlib import Path; from twinfer.runtime.tokenizer.cache import convert_and_cache; " \
           "convert_and_cache(Path(sys.argv[1]), Path(sys.argv[2]))"
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(path), str(root)], capture_output=True, timeout=600,
                              check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return proc.returncode == 0


def convert_and_cache(p: Path, root: Path) -> tuple[HFTokenizer, convert.VocabInfo]:
    """Convert `p`'s GGUF vocabulary to a `tokenizers` tokenizer and write it to the cache in `root`."""
    key = cache_key(p)
    tok_file, info_file = root / f"{key}.tokenizer.json", root / f"{key}.info.json"
    meta = read_gguf_metadata(p, keys_prefix=("tokenizer.", "general.architecture"))
    if "tokenizer.ggml.tokens" not in meta:
        raise ModelError(
            f"{p} has no tokenizer (tokenizer.ggml.tokens missing); use a GGUF with a vocabulary"
        )
    info = convert.vocab_info(meta)
    tok = convert.build_from_gguf(meta, info)
    _write_cached(root, tok_file, info_file, tok, info)
    return tok, info


def _read_cached(tok_file: Path, info_file: Path) -> tuple[HFTokenizer, convert.VocabInfo] | None:
    try:
        info_json: dict[str, Any] = json.loads(info_file.read_text(encoding="utf-8"))
        tok = HFTokenizer.from_file(str(tok_file))
        return tok, convert.VocabInfo(**info_json)
    except Exception:  # a missing or damaged entry is rebuilt (tokenizers raises plain Exception)
        return None


def _write_cached(
    root: Path, tok_file: Path, info_file: Path, tok: HFTokenizer, info: convert.VocabInfo
) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
        # The tokenizer is written first: an info file only ever sits next to a complete tokenizer.
        _atomic_write(tok_file, _compact_merges(tok.to_str()))
        _atomic_write(info_file, json.dumps(info.to_json(), ensure_ascii=False))
    except OSError:
        pass  # a read-only cache only costs the next start another conversion


def _compact_merges(tokenizer_json: str) -> str:
    """Store merges as "left right" strings, which `tokenizers` loads faster than pairs (~15%)."""
    data = json.loads(tokenizer_json)
    merges = data.get("model", {}).get("merges")
    if not merges or not isinstance(merges[0], list) or any(" " in a or " " in b for a, b in merges):
        return tokenizer_json
    data["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    return json.dumps(data, ensure_ascii=False)


def _atomic_write(target: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
