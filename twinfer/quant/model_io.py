"""Quantize a loaded model's weights in memory, and write a quantized model folder.
`quantizable` lists every decoder layer's 2-D projection; embeddings, norms and expert stacks stay.
`QuantizedView` serves assigned names as `QuantizedWeight`; `write_quantized` writes a folder
`runtime.loaders.load_model` opens on every Ops backend."""

from __future__ import annotations

import json
import re
import shutil
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from twinfer.quant.affine import GROUP_SIZES
from twinfer.quant.linear import QuantizedWeight, check_format, supports
from twinfer.quant.registry import pack_weight
from twinfer.runtime.loaders.quantized import QUANT_METHOD, WEIGHTS_FILE, spec_to_json
from twinfer.runtime.spec import ModelSpec

_LINEAR = re.compile(r"^layers\.(\d+)\.(q|k|v|o|gate|up|down)$")
_ST_DTYPES = {"float32": "F32", "float16": "F16", "uint8": "U8", "int8": "I8", "uint16": "U16",
              "int16": "I16", "uint32": "U32", "int32": "I32", "int64": "I64"}  # fmt: skip
F16_ABOVE = 1 << 20  # float tensors with more elements (the embedding) are stored as float16
AFFINE = ("int4", "int8")
DEFAULT_GROUP = 64  # the registry's affine group size (mlx-lm's)


def quantizable(weights: Any) -> list[str]:
    """Names of the 2-D layer projections, in layer order."""
    return [n for n in weights.names() if _LINEAR.match(n) and len(weights.shape(n)) == 2]


def layer_of(name: str) -> int:
    m = _LINEAR.match(name)
    if not m:
        raise ValueError(f"{name!r} is not a layer projection")
    return int(m.group(1))


def kind_of(name: str) -> str:
    """"attn" for q/k/v/o, "mlp" for gate/up/down."""
    return "attn" if name.rsplit(".", 1)[-1] in ("q", "k", "v", "o") else "mlp"


def format_bits(fmt: str, group_size: int = DEFAULT_GROUP) -> float:
    """Nominal bits per weight of `fmt`; affine formats pay a float16 scale and bias per group."""
    from twinfer.quant.registry import FORMATS

    return int(fmt[3:]) + 32 / group_size if fmt in AFFINE else FORMATS[fmt]


class QuantizedView(Mapping[str, Any]):
    """A model's weights with `assignment` (name -> format) applied; quantized weights are cached.

    `group_size` is the affine formats' (int4, int8) group: 32, 64 or 128. The cache holds weights of
    this view's group size only."""

    def __init__(self, weights: Any, assignment: Mapping[str, str], seed: int = 0,
                 cache: dict[tuple[str, str], QuantizedWeight] | None = None,
                 group_size: int = DEFAULT_GROUP) -> None:
        if group_size not in GROUP_SIZES:
            raise ValueError(f"affine group size must be one of {GROUP_SIZES}, got {group_size}")
        self.weights = weights
        self.assignment = dict(assignment)
        self.seed = seed
        self.cache = {} if cache is None else cache
        self.group_size = group_size
        for name, fmt in self.assignment.items():
            check_format(fmt)
            shape = tuple(weights.shape(name))
            if not supports(fmt, shape) or (fmt in AFFINE and shape[1] % group_size):
                raise ValueError(f"format {fmt} cannot store {name} of shape {shape}")

    def names(self) -> list[str]:
        return list(self.weights.names())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.weights.shape(name))

    def load(self, name: str) -> Any:
        fmt = self.assignment.get(name)
        if fmt is None:
            return self.weights.load(name)
        key = (name, fmt)
        if key not in self.cache:
            if fmt in AFFINE and self.group_size != DEFAULT_GROUP:
                w = np.asarray(self.weights.load(name), dtype=np.float32)
                packed = pack_weight(fmt, w, group_size=self.group_size)
                self.cache[key] = QuantizedWeight(fmt, (int(w.shape[0]), int(w.shape[1])), packed)
            else:
                self.cache[key] = QuantizedWeight.quantize(fmt, self.weights.load(name), seed=self.seed)
        return self.cache[key]

    def __getitem__(self, name: str) -> Any:
        return self.load(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())


def average_bits(weights: Any, assignment: Mapping[str, str], group_size: int = DEFAULT_GROUP) -> float:
    """Parameter-weighted bits per weight of the assigned tensors (the formats' nominal costs)."""
    total = params = 0.0
    for name, fmt in assignment.items():
        n = float(np.prod(weights.shape(name)))
        total += n * format_bits(fmt, group_size)
        params += n
    return total / params if params else 0.0


def write_quantized(out: Path, spec: ModelSpec, view: QuantizedView, source: Path,
                    extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Write `view` (weights + assignment) to `out`; returns the config written."""
    out.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    tensors: dict[str, Any] = {}
    for name in view.names():
        if name == "lm_head" and spec.tie_word_embeddings:
            continue
        value = view.load(name)
        if isinstance(value, QuantizedWeight):
            parts, meta = value.to_tensors()
            tensors[name] = meta
            arrays.update({f"{name}.{part}": a for part, a in parts.items()})
        else:
            value = np.asarray(value, dtype=np.float32)
            arrays[name] = value.astype(np.float16) if value.size > F16_ABOVE else value
    _write_safetensors(out / WEIGHTS_FILE, arrays)
    config: dict[str, Any] = {
        "model_type": spec.model_type,
        "twinfer_spec": spec_to_json(spec),
        "quantization_config": {
            "quant_method": QUANT_METHOD,
            "source": str(source),
            "bits_per_weight": average_bits(view.weights, view.assignment, view.group_size),
            "tensors": tensors,
            **(dict(extra) if extra else {}),
        },
    }
    (out / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    write_tokenizer(source, out)
    return config


def update_config(folder: Path, **quantization: Any) -> None:
    """Merge keys into a quantized folder's quantization_config (e.g. the measured KL)."""
    path = folder / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["quantization_config"].update(quantization)
    path.write_text(json.dumps(config, indent=1), encoding="utf-8")


def _write_safetensors(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    header: dict[str, Any] = {}
    offset = 0
    for name, a in arrays.items():
        dtype = _ST_DTYPES[np.dtype(a.dtype).name]
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays.values():
            f.write(np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False).tobytes())
    tmp.replace(path)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "generation_config.json", "chat_template.jinja", "chat_template.json")  # fmt: skip


def write_tokenizer(source: Path, out: Path) -> None:
    """Give the folder the source's tokenizer: copied from a model folder, converted from a GGUF."""
    if source.is_dir():
        for name in _TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, out / name)
        return
    from twinfer.runtime.tokenizer import load_tokenizer

    tok = load_tokenizer(source)
    backend = tok._tok  # the converted `tokenizers` object that reproduces llama.cpp's tokenization
    (out / "tokenizer.json").write_text(backend.to_str(), encoding="utf-8")
    config: dict[str, Any] = {"add_bos_token": tok.add_bos, "add_eos_token": False}
    if tok.bos_id is not None:
        config["bos_token"] = tok.id_to_piece(tok.bos_id)
    if tok.eos_id is not None:
        config["eos_token"] = tok.id_to_piece(tok.eos_id)
    if tok.chat_template:
        config["chat_template"] = tok.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": sorted(tok.eos_ids)}), encoding="utf-8")
