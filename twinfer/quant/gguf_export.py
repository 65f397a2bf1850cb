"""Export a `twinfer quantize` folder made from a GGUF file as one GGUF file llama.cpp runs.
Only formats a GGUF type holds as they are: int4 -> Q4_1 (scale and bias rounded to float16, the only
change, `GGUFExport.max_abs_change`), mxfp4 -> MXFP4. int8 refuses unless `int8_as_q8_0` (lossy);
TurboQuant, FP8 and NVFP4 refuse. Every other tensor and key is the source's, bytes unchanged."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from twinfer.formats.bitpack import unpack_nibbles
from twinfer.formats.mxfp4 import E8M0_NAN, MXFP4Tensor
from twinfer.quant.affine import AffineTensor
from twinfer.quant.gguf_rewrite import TypedGGUF, rewrite_gguf
from twinfer.quant.linear import QuantizedWeight
from twinfer.runtime.errors import TwinferError
from twinfer.runtime.loaders.gguf_reader import GGUFContents

GGUF_FILE = "model.gguf"  # what `twinfer quantize --gguf` writes inside the folder
EXACT = {"int4": "Q4_1", "mxfp4": "MXFP4"}
LOSSY = {"int8": "Q8_0"}
_FILE_TYPES = {"Q4_1": "MOSTLY_Q4_1", "MXFP4": "MOSTLY_MXFP4_MOE", "Q8_0": "MOSTLY_Q8_0"}
_ROW_PERMUTES = ("unpermute_q", "unpermute_k")  # loader transforms that only reorder rows
_UINT32 = 4  # GGUF value type of general.file_type


@dataclass(frozen=True)
class GGUFExport:
    """What `export_gguf` wrote. `types`: GGML type -> tensors written from the folder in it;
    `max_abs_change`: per twinfer format, the largest |exported - folder| weight value."""

    path: Path
    nbytes: int
    types: dict[str, int]
    kept: int  # tensors copied from the source as stored
    max_abs_change: dict[str, float]
    file_type: str


def formats_that_export() -> str:
    """The exportable formats and their GGUF types, for messages."""
    exact = ", ".join(f"{f} ({t})" for f, t in EXACT.items())
    return f"{exact}; int8 as Q8_0 only when asked (lossy: --gguf-int8-q8_0, int8_as_q8_0=True)"


def unexportable(formats: Iterable[str], int8_as_q8_0: bool = False) -> list[str]:
    """The formats among `formats` that no GGUF type holds without requantizing, sorted."""
    import gguf

    ok = {f for f, t in EXACT.items() if t in gguf.GGMLQuantizationType.__members__}
    ok |= set(LOSSY) if int8_as_q8_0 else set()
    return sorted(set(formats) - ok)


def check_source(source: Path) -> None:
    """Raise TwinferError unless `source` (a quantized folder's source model) is a GGUF file."""
    if source.is_dir():
        raise TwinferError(
            f"GGUF export needs a model quantized from a GGUF file, and {source} is a Hugging Face folder: "
            "convert it with llama.cpp's convert_hf_to_gguf.py, quantize that GGUF with twinfer, then export"
        )
    if not source.is_file():
        raise TwinferError(f"the source model {source} is gone; GGUF export copies its metadata and "
                           "unquantized tensors, so restore it or re-run twinfer quantize")


def export_gguf(folder: str | Path, dest: str | Path, int8_as_q8_0: bool = False) -> GGUFExport:
    """Write the quantized folder `folder` as the GGUF file `dest` (see the module docstring)."""
    from twinfer.runtime.loaders import load_model
    from twinfer.runtime.loaders.quantized import is_quantized_folder

    folder, dest = Path(folder), Path(dest)
    if not is_quantized_folder(folder):
        raise TwinferError(f"{folder} is not a twinfer quantized folder (no quantization_config in config.json)")
    qc = json.loads((folder / "config.json").read_text(encoding="utf-8"))["quantization_config"]
    if not qc.get("source"):
        raise TwinferError(f"{folder} records no source model; re-run twinfer quantize on the GGUF file")
    source = Path(qc["source"])
    formats = {name: str(meta["format"]) for name, meta in qc["tensors"].items()}
    check_source(source)
    if dest.resolve() == source.resolve():
        raise TwinferError(f"{dest} is the source model itself; write the GGUF somewhere else")
    bad = unexportable(formats.values(), int8_as_q8_0)
    if bad:
        listed = "; ".join(f"{f}: {_names([n for n, g in formats.items() if g == f])}" for f in bad)
        raise TwinferError(f"{folder} has tensors in formats no GGUF type holds without requantizing "
                           f"({listed}); formats that export: {formats_that_export()}")
    ours, src = load_model(folder), load_model(source)
    _check_same_model(ours, src, source)
    replaced: dict[str, tuple[np.ndarray, str]] = {}  # source tensor name -> (bytes [rows, row bytes], type)
    changes: dict[str, float] = {}
    for name in formats:
        stored, rows = _stored_name(src.weights, name, source)
        qw: Any = ours.weights.load(name)  # a QuantizedWeight: `name` is a quantized tensor
        blocks, qtype, change = to_gguf_blocks(qw, name)
        replaced[stored] = (blocks if rows is None else blocks[rows], qtype)
        changes[formats[name]] = max(changes.get(formats[name], 0.0), change)
    file_type = _write(source, dest, replaced)
    types: dict[str, int] = {}
    for _, qtype in replaced.values():
        types[qtype] = types.get(qtype, 0) + 1
    kept = len(GGUFContents(source).tensors) - len(replaced)
    return GGUFExport(dest, dest.stat().st_size, types, kept, changes, file_type)


def to_gguf_blocks(qw: QuantizedWeight, name: str = "tensor") -> tuple[np.ndarray, str, float]:
    """(uint8 [out, row bytes] GGUF blocks, GGML type name, max |exported - qw| value) of one weight."""
    p = qw.packed
    if qw.fmt == "int4" and isinstance(p, AffineTensor):
        blocks, change = q4_1_blocks(p)
        if not np.isfinite(change):
            raise TwinferError(f"{name}: an int4 scale or bias overflows float16, which Q4_1 stores; "
                               "this tensor cannot be exported")
        return blocks, "Q4_1", change
    if qw.fmt == "mxfp4" and isinstance(p, MXFP4Tensor):
        if (p.scales == E8M0_NAN).any():
            raise TwinferError(f"{name}: an MXFP4 block scale is NaN, which GGUF's MXFP4 cannot store")
        return mxfp4_blocks(p), "MXFP4", 0.0
    if qw.fmt == "int8":
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize, quantize

        w = qw.dequantize()
        blocks = quantize(w, GGMLQuantizationType.Q8_0)
        change = float(np.abs(dequantize(blocks, GGMLQuantizationType.Q8_0) - w).max())
        return blocks, "Q8_0", change
    raise TwinferError(f"{name}: format {qw.fmt} has no GGUF type; formats that export: {formats_that_export()}")


def q4_1_blocks(p: AffineTensor) -> tuple[np.ndarray, float]:
    """GGUF Q4_1 blocks (ggml's `block_q4_1`) of a 4-bit affine weight, and the largest value change from
    float16 rounding; a group of 64 or 128 is two or four blocks sharing d and m."""
    if p.bits != 4 or p.group_size % 32:
        raise ValueError(f"Q4_1 holds 4-bit groups of a multiple of 32; got {p.bits} bits, group {p.group_size}")
    out, inp = p.shape
    per = p.group_size // 32
    scales, biases = np.repeat(p.scales, per, axis=1), np.repeat(p.biases, per, axis=1)  # [out, in / 32]
    with np.errstate(over="ignore"):
        d, m = scales.astype(np.float16), biases.astype(np.float16)
    codes = p.codes().reshape(out, inp // 32, 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)  # [out, in / 32, 16]
    blocks = np.concatenate([d[..., None].view(np.uint8), m[..., None].view(np.uint8), qs], axis=-1)
    dd, dm = d.astype(np.float32) - scales, m.astype(np.float32) - biases
    change = np.abs(dd[..., None] * codes + dm[..., None]).max() if codes.size else 0.0
    return blocks.reshape(out, -1), float(change)


def mxfp4_blocks(p: MXFP4Tensor) -> np.ndarray:
    """GGUF MXFP4 blocks: the E8M0 byte, then 16 bytes with element j low and j + 16 high
    (ggml's `block_mxfp4`; twinfer's gpt-oss layout pairs elements 2i and 2i + 1 instead)."""
    codes = unpack_nibbles(p.blocks)  # [out, in / 32, 32] in element order
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([p.scales[..., None], qs], axis=-1).reshape(p.blocks.shape[0], -1)


def _stored_name(weights: Any, name: str, source: Path) -> tuple[str, np.ndarray | None]:
    """The source GGUF tensor that `name` was read from, and the row order that undoes the loader's
    transform (None: rows as they are)."""
    from twinfer.runtime.loaders.weights import TRANSFORMS

    sources, transform = weights.sources(name), weights.transform(name)
    if len(sources) != 1 or (transform is not None and transform not in _ROW_PERMUTES):
        raise TwinferError(f"{name} is built from {len(sources)} tensor(s) of {source} with transform "
                           f"{transform}; twinfer cannot write it back as one GGUF tensor")
    if transform is None:
        return sources[0].name, None
    rows = sources[0].shape[0]
    canonical_from = TRANSFORMS[transform].apply([np.arange(rows)[:, None]], weights.spec)[:, 0]
    return sources[0].name, np.argsort(canonical_from)  # stored row s holds canonical row order[s]


def _check_same_model(ours: Any, src: Any, source: Path) -> None:
    from twinfer.runtime.loaders.quantized import spec_to_json

    same = spec_to_json(ours.spec) == spec_to_json(src.spec)
    if same and "norm" in src.weights:
        same = np.array_equal(ours.weights.load("norm"), src.weights.load("norm"))
    if not same:
        raise TwinferError(f"{source} is not the model {ours.path} was quantized from (its config or "
                           "weights differ); re-run twinfer quantize on it")


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _write(source: Path, dest: Path, replaced: Mapping[str, tuple[np.ndarray, str]]) -> str:
    """Copy `source` to `dest` with `replaced` tensors swapped in; returns the file type written."""
    import gguf

    contents = TypedGGUF(source)
    file_type = _file_type(contents, replaced)
    code = int(gguf.LlamaFileType[file_type])

    def value(key: str, v: Any) -> Any:
        return code if key == "general.file_type" else v

    def tensor(name: str, raw: np.ndarray, ggml_type: int) -> tuple[str, np.ndarray, int]:
        if name not in replaced:
            return name, raw, ggml_type
        blocks, qtype = replaced[name]
        return name, blocks, int(gguf.GGMLQuantizationType[qtype])

    extra = [] if "general.file_type" in contents.types else [("general.file_type", code, _UINT32, None)]
    rewrite_gguf(contents, dest, values=value, extra=extra, tensors=tensor)
    return file_type


def _file_type(contents: GGUFContents, replaced: Mapping[str, tuple[np.ndarray, str]]) -> str:
    """The file type of the GGML type holding most layer weights, if the export wrote it; else the source's."""
    import gguf

    weights: dict[str, int] = {}
    for name, info in contents.tensors.items():
        if name.startswith("blk.") and len(info.ne) >= 2:
            qtype = replaced[name][1] if name in replaced else gguf.GGMLQuantizationType(info.ggml_type).name
            weights[qtype] = weights.get(qtype, 0) + int(np.prod(info.ne))
    top = max(weights, key=lambda t: weights[t]) if weights else ""
    if top in _FILE_TYPES and top in {t for _, t in replaced.values()}:
        return _FILE_TYPES[top]
    stored = contents.metadata.get("general.file_type")
    return gguf.LlamaFileType(int(stored)).name if stored is not None else "GUESSED"

