"""Requantize a GGUF file with llama.cpp's own quantizer (the `--memory-budget` plans' smaller formats)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from twinfer.backends.llamacpp._lib import load_llama_cpp, set_quiet
from twinfer.planners.formats import GGML_TYPES, written_format
from twinfer.quant.gguf_retype import retype_gguf
from twinfer.runtime.cache_dir import cache_dir
from twinfer.runtime.errors import PlanError

_GGML_IDS = {name: tid for tid, name in GGML_TYPES.items()}


def requantize_gguf(src: Path, mix: str, ftype: str, threads: int | None = None,
                    embed_type: str | None = None) -> Path:
    """`src` requantized to `mix` (llama.cpp's `LLAMA_FTYPE_<ftype>`), cached in `cache_dir("requant")`;
    `embed_type` sets the embedding/output type (None: llama.cpp's choice)."""
    lib = load_llama_cpp()
    cache = cache_dir("requant")
    cache.mkdir(parents=True, exist_ok=True)
    embed = _embedding_type(src, embed_type) if embed_type else None
    out = cache / f"{src.stem}-{mix}{f'-embed-{embed}' if embed else ''}.gguf"
    if out.is_file() and out.stat().st_mtime >= src.stat().st_mtime:
        return out
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, f"LLAMA_FTYPE_{ftype}")
    params.allow_requantize = True
    params.nthread = threads or 0
    streamed = _streamed_embedding(src, embed) if embed else {}
    if embed:  # for a tied model llama.cpp applies token_embedding_type (it wins over output_tensor_type)
        params.token_embedding_type = params.output_tensor_type = _GGML_IDS[embed]
    for name, source_type in streamed.items():  # llama.cpp copies these; they are re-encoded below
        if name == EMBED:
            params.token_embedding_type = source_type
        else:
            params.output_tensor_type = source_type
    tmp = out.with_suffix(".part")
    what = f"{mix} with a {embed} embedding" if embed else mix
    print(f"twinfer: requantizing {src.name} to {what} with llama.cpp (once; cached as {out})", file=sys.stderr)
    set_quiet(lib, True)  # its per-tensor log is hundreds of lines
    if lib.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
        raise PlanError(f"llama.cpp could not requantize {src} to {mix}")
    if streamed:
        assert embed is not None
        staged = out.with_suffix(".stage")
        tmp.replace(staged)
        try:
            retype_gguf(staged, tmp, dict.fromkeys(streamed, embed))
        finally:
            staged.unlink(missing_ok=True)
    tmp.replace(out)
    return out


def requantize_in_child(src: Path, mix: str, ftype: str, threads: int | None = None,
                        embed_type: str | None = None) -> Path:
    """`requantize_gguf` in a child process: llama.cpp's quantizer holds float32 copies and per-thread work
    buffers (572 MB at its peak for a 79 MB BF16 MoE), which a budgeted run must never count as its own."""
    args = [str(src), mix, ftype, str(threads or 0), embed_type or ""]
    result = subprocess.run([sys.executable, "-m", "twinfer.backends.llamacpp.requantize", *args],
                            stdout=subprocess.PIPE, text=True, check=False)
    if result.returncode != 0 or not result.stdout.strip():
        raise PlanError(f"llama.cpp could not requantize {src} to {mix} (exit code {result.returncode})")
    return Path(result.stdout.strip().splitlines()[-1])


EMBED, OUTPUT = "token_embd.weight", "output.weight"


def _streamed_embedding(src: Path, embed: str) -> dict[str, int]:
    """The embedding/output tensors to re-encode after llama.cpp, with their source types: llama.cpp
    copies them and `retype_gguf` converts a few MB of rows at a time, so memory stays under budget."""
    from twinfer.quant.gguf_retype import can_retype
    from twinfer.quant.gguf_rewrite import TypedGGUF

    tensors = TypedGGUF(src).tensors
    return {name: tensors[name].ggml_type for name in (EMBED, OUTPUT)
            if name in tensors and tensors[name].ggml_type != _GGML_IDS[embed]
            and can_retype(tensors[name].ggml_type, embed)}


def _embedding_type(src: Path, embed_type: str) -> str:
    """The type llama.cpp can write for the embedding: a K-quant whose super-blocks do not divide its rows
    falls back as llama.cpp's own rules would (given as token_embedding_type, it would abort the process)."""
    from twinfer.runtime.loaders import load_model  # reads only the header

    name = embed_type.lower()
    if name not in _GGML_IDS:
        raise PlanError(f"unknown embedding type {embed_type!r}; use a ggml type such as q4_0, q5_0, q6_k or q8_0")
    row = load_model(src).weights.shape("embed")[-1]  # (vocab, hidden): llama.cpp's ne[0] is hidden
    return written_format(name, row)


if __name__ == "__main__":  # requantize_in_child's child: prints the written file's path
    _src, _mix, _ftype, _threads, _embed = sys.argv[1:6]
    print(requantize_gguf(Path(_src), _mix, _ftype, int(_threads) or None, _embed or None))
