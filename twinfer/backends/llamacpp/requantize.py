"""Requantize a GGUF file with llama.cpp's own quantizer (the `--memory-budget` plans' smaller formats)."""

from __future__ import annotations

import os
from pathlib import Path

from twinfer.backends.llamacpp._lib import load_llama_cpp
from twinfer.runtime.errors import PlanError


def requantize_gguf(src: Path, mix: str, ftype: str, threads: int | None = None) -> Path:
    """`src` requantized to `mix` (llama.cpp's `LLAMA_FTYPE_<ftype>`), cached under ~/.cache/twinfer/requant."""
    lib = load_llama_cpp()
    cache = Path(os.environ.get("TWINFER_CACHE", "~/.cache/twinfer")).expanduser() / "requant"
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"{src.stem}-{mix}.gguf"
    if out.is_file() and out.stat().st_mtime >= src.stat().st_mtime:
        return out
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, f"LLAMA_FTYPE_{ftype}")
    params.allow_requantize = True
    params.nthread = threads or 0
    tmp = out.with_suffix(".part")
    if lib.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
        raise PlanError(f"llama.cpp could not requantize {src} to {mix}")
    tmp.replace(out)
    return out
