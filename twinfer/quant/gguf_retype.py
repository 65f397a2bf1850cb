"""Re-encode named tensors of a GGUF file to another ggml type, a block of rows at a time.
llama.cpp's quantizer widens a whole tensor to float32 first (671 MB for the default model's embedding);
rows are independent in every ggml block format, so ~16 MB of rows at a time gives the same bytes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from twinfer.quant.gguf_rewrite import CHUNK_BYTES, Streamed, TypedGGUF, drop_pages, rewrite_gguf
from twinfer.runtime.errors import PlanError


def can_retype(source_type: int, target: str) -> bool:
    """Whether gguf-py can decode `source_type` and encode `target` (K-quant encoders it lacks)."""
    import gguf
    from gguf.quants import quantize

    try:
        tid = gguf.GGMLQuantizationType[target.upper()]
        block, _ = gguf.GGML_QUANT_SIZES[tid]
        quantize(np.zeros((1, block), dtype=np.float32), tid)
        gguf.GGMLQuantizationType(source_type)
    except (KeyError, ValueError, NotImplementedError):
        return False
    return True


def retype_gguf(src: Path, dest: Path, types: dict[str, str]) -> Path:
    """Copy `src` to `dest`, each tensor named in `types` re-encoded to that ggml type ("q5_0", "q8_0"...),
    streamed so that no tensor is ever whole in memory. Tensors already of their type are copied."""
    import gguf

    contents = TypedGGUF(src)

    def edit(name: str, raw: np.ndarray, ggml_type: int) -> tuple[str, Any, int]:
        target = types.get(name)
        if target is None:
            return name, raw, ggml_type
        tid = int(gguf.GGMLQuantizationType[target.upper()])
        if tid == ggml_type:
            return name, raw, ggml_type
        if not can_retype(ggml_type, target):
            raise PlanError(f"cannot stream {name} from ggml type {ggml_type} to {target}")
        return name, _reencoded(raw, ggml_type, tid, contents), tid

    return rewrite_gguf(contents, dest, tensors=edit)


def _reencoded(raw: np.ndarray, source: int, target: int, contents: TypedGGUF) -> Streamed:
    import gguf
    from gguf.quants import dequantize, quantize

    rows = raw.reshape(-1, raw.shape[-1])  # byte rows
    s_block, s_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(source)]
    t_block, t_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(target)]
    elements = rows.shape[1] // s_size * s_block
    if elements % t_block:
        raise PlanError(f"rows of {elements} values do not divide into {t_block}-value blocks")
    out_row = elements // t_block * t_size
    step = max(1, CHUNK_BYTES // (elements * 4))  # rows whose float32 copy is about CHUNK_BYTES

    def chunks() -> Iterator[np.ndarray]:
        for i in range(0, rows.shape[0], step):
            values = dequantize(rows[i : i + step], gguf.GGMLQuantizationType(source)).astype(np.float32)
            yield quantize(values, gguf.GGMLQuantizationType(target)).reshape(-1, out_row)

    return Streamed((*raw.shape[:-1], out_row), chunks, lambda: drop_pages(contents))
