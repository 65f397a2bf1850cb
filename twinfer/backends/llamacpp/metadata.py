"""The ModelSpec of a model llama.cpp has loaded: twinfer's loader's where it implements the
architecture, else a coarse one from llama.cpp's accessors (defaults err toward larger KV)."""

from __future__ import annotations

import ctypes
from pathlib import Path
from types import ModuleType
from typing import Any

from twinfer.runtime.errors import ModelError
from twinfer.runtime.models import gguf_architecture
from twinfer.runtime.spec import ModelSpec


def model_type(arch: str) -> str:
    """The model_type of a GGUF `general.architecture`: the registry's for architectures twinfer has
    a file for (`deepseek2` is `deepseek_v3`), else the GGUF name itself."""
    known = gguf_architecture(arch)
    return known.name if known is not None else arch


def meta_str(lib: ModuleType, model: Any, key: str) -> str | None:
    """A GGUF metadata value as text, or None when the key is absent."""
    buf = ctypes.create_string_buffer(256)
    n = lib.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    if n < 0:
        return None
    if n >= len(buf):  # truncated: retry with the size llama.cpp reported
        buf = ctypes.create_string_buffer(n + 1)
        lib.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace")


def model_desc(lib: ModuleType, model: Any) -> str:
    buf = ctypes.create_string_buffer(256)
    lib.llama_model_desc(model, buf, len(buf))
    return buf.value.decode("utf-8", "replace")


def _num(text: str | None, kind: type, default: Any) -> Any:
    try:
        return kind(text) if text is not None else default
    except ValueError:  # per-layer arrays and other non-scalars
        return default


def spec_from_model(lib: ModuleType, model: Any, n_vocab: int) -> ModelSpec:
    """A ModelSpec from llama.cpp's accessors and the GGUF metadata of a loaded model."""
    arch = meta_str(lib, model, "general.architecture") or "unknown"

    def key(name: str, kind: type, default: Any) -> Any:
        return _num(meta_str(lib, model, f"{arch}.{name}"), kind, default)

    hidden = int(lib.llama_model_n_embd(model))
    heads = int(lib.llama_model_n_head(model))
    kv_heads = int(lib.llama_model_n_head_kv(model)) if hasattr(lib, "llama_model_n_head_kv") else heads
    window = key("attention.sliding_window", int, None)
    return ModelSpec(
        model_type=model_type(arch),
        vocab_size=n_vocab,
        hidden_size=hidden,
        num_layers=int(lib.llama_model_n_layer(model)),
        num_heads=heads,
        num_kv_heads=max(kv_heads, 1),
        head_dim=key("attention.key_length", int, hidden // max(heads, 1)),
        intermediate_size=key("feed_forward_length", int, 0),
        name=meta_str(lib, model, "general.name") or "",
        max_position=int(lib.llama_model_n_ctx_train(model)),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon", float, 1e-6),
        rope_theta=key("rope.freq_base", float, 10000.0),
        sliding_window=window or None,
        extra=(("source", "llama.cpp metadata"),),
    )


def model_spec(lib: ModuleType, model: Any, path: Path, n_vocab: int) -> ModelSpec:
    """The GGUF loader's exact spec, or llama.cpp's coarse one when twinfer lacks the architecture."""
    from twinfer.runtime.loaders.gguf_file import read_gguf, spec_from_gguf

    try:
        return spec_from_gguf(read_gguf(path))
    except ModelError:
        return spec_from_model(lib, model, n_vocab)
