"""Tokenizers (`load_tokenizer`: GGUF, ids identical to llama.cpp's, or tokenizer.json), streaming
detokenization (`StreamDecoder`) and chat templates (`render_chat`, as transformers renders them)."""

from __future__ import annotations

from pathlib import Path

from twinfer.runtime.errors import ModelError
from twinfer.runtime.tokenizer.chat import FALLBACK_TEMPLATE, render_chat, validate_messages
from twinfer.runtime.tokenizer.detok import StreamDecoder
from twinfer.runtime.tokenizer.gguf_meta import is_gguf
from twinfer.runtime.tokenizer.tokenizer import Tokenizer

__all__ = [
    "FALLBACK_TEMPLATE",
    "StreamDecoder",
    "Tokenizer",
    "load_tokenizer",
    "render_chat",
    "validate_messages",
]


def load_tokenizer(path: str | Path | None = None, cache_dir: str | Path | None = None) -> Tokenizer:
    """The tokenizer of a model (None: the default model); converted GGUF vocabularies are cached in
    `cache_dir`."""
    if path is None:
        from twinfer.runtime.loaders import default_model_path

        path = default_model_path()
    p = Path(path).expanduser()
    if p.is_dir():
        return Tokenizer.from_hf(p)
    if is_gguf(p):
        return Tokenizer.from_gguf(p, cache_dir=cache_dir)
    if p.is_file():
        raise ModelError(
            f"{p} is neither a GGUF file nor a model folder; pass a .gguf file or a folder with tokenizer.json"
        )
    raise ModelError(f"model path not found: {p}")
